"""Parallel MTP heads (Gloeckle et al. 2024) for SmolLM2-135M-Instruct, self-distilled on
the built-in prompt set.

    python -m experiments.train_heads --config=configs/heads_mtp.py --config.run_dir=runs/mtp

The data of `heads_medusa.py` (~15 minutes), then 1000 steps of 2 whole rows (about the
256 positions of a Medusa step: each head's loss is KL to the model's law of its token
at every position of a row): 4 heads of one decoder layer each, weights 0.8^(k-1).
Decode with them as Medusa heads: `strategy="medusa"` (or "blockwise") and
`heads=mdjax.load_heads("runs/mtp/export")`; the held-out top-k accuracies in the
export calibrate the tree. `max_minutes` stops the run cleanly and exports what it has.
"""

from configs import heads_common


def get_config():
  config = heads_common.get_shipped_config("mtp")
  config.num_heads = 4
  config.num_layers = 1
  config.steps = 1000
  config.batch_size = 2
  return config
