"""Medusa heads for SmolLM2-135M-Instruct, self-distilled on the built-in prompt set.

    python -m experiments.train_heads --config=configs/heads_medusa.py --config.run_dir=runs/medusa

Sized for about an hour on a 2-core CPU: ~450 prompts x 2 answers of up to 128 tokens
(generation and the cached hidden states, float16: ~15 minutes), then 1500 steps of 256
positions (~2 s each, KL to the model's own law of each token). `max_minutes` stops
the run cleanly and exports what it has.
"""

from configs import heads_common


def get_config():
  config = heads_common.get_shipped_config("medusa")
  config.num_heads = 4
  config.num_layers = 1
  config.steps = 1500
  config.batch_size = 256
  return config
