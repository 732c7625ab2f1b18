"""Medusa decoding: heads guess several tokens ahead, the target verifies a tree of
their top-k guesses in one pass (greedy: the target's exact tokens; a temperature
switches to the lossless tree rule, `acceptance="typical"` to Medusa's lossy typical
acceptance): `python -m experiments.decode --config=configs/medusa.py`; other heads
with `--config.heads=path/to/heads` (a directory `mdjax.save_heads` wrote)."""

from configs import common


def get_config():
  """The shared fields with strategy "medusa": a chat question to SmolLM2-135M-Instruct
  and its shipped Medusa heads."""
  config = common.get_base_config("medusa")
  config.model = "smollm2-135m-instruct"
  config.prompt = "What is the capital of France? Answer in one sentence."
  config.chat = True
  config.heads = "smollm2-135m-instruct-medusa"  # a shipped heads name or a directory
  config.num_heads = 0  # use the first n heads (0: all)
  config.tree_budget = 0  # nodes verified per pass (0: the heads' calibrated tree, else 16)
  config.temperature = 0.0  # 0: greedy (exact); > 0 samples (lossless with "exact")
  config.acceptance = "exact"  # or "typical" (lossy; needs a temperature > 0)
  config.typical_epsilon = 0.09  # typical: accept p > min(epsilon, delta * exp(-entropy))
  config.typical_delta = 0.3
  return config
