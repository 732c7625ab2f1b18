"""Models `mdjax.load` knows by name without a directory: seeded random llamas.

They exist so everything runs offline before any trained model is at hand; their
output is noise and every description says so.
"""

from __future__ import annotations

from mdjax.models.config import ModelConfig

RANDOM_MODELS = {
    # ~31M parameters: the benchmark model of issue #2 (vocab 4096, hidden 512, 8 layers).
    "random-llama": ModelConfig(family="llama", vocab_size=4096, hidden_size=512,
                                intermediate_size=1536, num_layers=8, num_heads=8,
                                num_kv_heads=8, head_dim=64, max_position_embeddings=4096,
                                bos_token_id=1, eos_token_id=(2,)),
    "random-llama-tiny": ModelConfig(family="llama", vocab_size=256, hidden_size=64,
                                     intermediate_size=128, num_layers=2, num_heads=4,
                                     num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                                     bos_token_id=1, eos_token_id=(2,)),
}
