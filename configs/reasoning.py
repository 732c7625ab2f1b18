"""Sampled reasoning branches, a vote and a join:
`python -m experiments.decode --config=configs/reasoning.py`."""

from configs import common


def get_config():
  """The shared fields with pipeline "reasoning" (the kv join is experimental)."""
  config = common.get_base_config("reasoning")
  config.num_branches = 4
  config.branch_tokens = 48
  config.answer_pattern = r"return (\S+)"
  config.join = "exact"  # or "kv"
  config.position_gap = 0
  config.temperature = 0.8
  return config
