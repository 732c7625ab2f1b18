"""EAGLE decoding: a one-layer head over the target's hidden states drafts a token tree
(EAGLE-2 style), the target verifies it in one pass (greedy: the target's exact
tokens; sampling options switch to the distribution-exact tree rule):
`python -m experiments.decode --config=configs/eagle.py`; other heads with
`--config.heads=path/to/heads` (a directory `mdjax.save_heads` wrote)."""

from configs import common


def get_config():
  """The shared fields with strategy "eagle": a chat question to SmolLM2-135M-Instruct,
  its shipped EAGLE head and the tree."""
  config = common.get_base_config("eagle")
  config.model = "smollm2-135m-instruct"
  config.prompt = "What is the capital of France? Answer in one sentence."
  config.chat = True
  config.heads = "smollm2-135m-instruct-eagle"  # a shipped heads name or a directory
  config.tree_depth = 4  # levels drafted (the longest path accepted per target pass)
  config.tree_top_k = 4  # children per expanded node, and nodes expanded per level
  config.tree_budget = 16  # best nodes (by cumulative head log-probability) verified
  return config
