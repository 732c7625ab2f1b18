"""Speculative decoding with a draft token tree (EAGLE-2 style; greedy: the target's
exact tokens; sampling options switch to the distribution-exact multi-candidate rule):
`python -m experiments.decode --config=configs/speculative_tree.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "speculative_tree", the shipped draft and the tree."""
  config = common.get_base_config("speculative_tree")
  config.draft = "code-tiny-draft"  # a model name or directory, same vocabulary as `model`
  config.tree_depth = 4  # levels drafted (the longest path accepted per target pass)
  config.tree_top_k = 4  # children per expanded node, and nodes expanded per level
  config.tree_budget = 16  # best nodes (by cumulative draft log-probability) verified
  return config
