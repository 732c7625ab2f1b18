"""The shipped draft (`code-tiny-draft`): ~10x fewer parameters than the target, same tokenizer.

    --config.tokenizer=<target run>/tokenizer   so both share one vocabulary
"""

from configs import lm_common


def get_config():
  return lm_common.get_shipped_config(
      steps=1100, lr=3e-3,  # ~25 min at ~3200 tokens/s on 2 CPU cores
      hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4, num_kv_heads=2,
      head_dim=32, tie_word_embeddings=True)
