"""Greedy decoding: `python -m experiments.decode --config=configs/greedy.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "greedy" (it takes no options)."""
  return common.get_base_config("greedy")
