"""Entropy-triggered branching (entropix-style):
`python -m experiments.decode --config=configs/entropy_branching.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "entropy_branching" and its thresholds (nats)."""
  config = common.get_base_config("entropy_branching")
  config.num_branches = 3  # top-k tokens forked where the model is unsure
  config.branch_tokens = 4  # tokens each branch holds before the best is kept
  config.branch_entropy = 2.5
  config.branch_varentropy = 1.0
  return config
