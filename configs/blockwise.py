"""Blockwise parallel decoding (Stern et al. 2018): the chain of every head's top-1
guess, verified in one pass, its longest agreeing prefix kept (greedy: the target's
exact tokens): `python -m experiments.decode --config=configs/blockwise.py`; other
heads with `--config.heads=path/to/heads` (a directory `mdjax.save_heads` wrote)."""

from configs import common


def get_config():
  """The shared fields with strategy "blockwise": a chat question to
  SmolLM2-135M-Instruct and its shipped Medusa heads."""
  config = common.get_base_config("blockwise")
  config.model = "smollm2-135m-instruct"
  config.prompt = "What is the capital of France? Answer in one sentence."
  config.chat = True
  config.heads = "smollm2-135m-instruct-medusa"  # a shipped heads name or a directory
  config.num_heads = 0  # the block: 1 + the first n heads' guesses (0: all)
  return config
