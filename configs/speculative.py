"""Speculative decoding with a draft model (greedy: the target's exact tokens, fewer
target passes; sampling options switch to the distribution-exact rule):
`python -m experiments.decode --config=configs/speculative.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "speculative", the shipped draft and its schedule."""
  config = common.get_base_config("speculative")
  config.draft = "code-tiny-draft"  # a model name or directory, same vocabulary as `model`
  config.num_draft_tokens = 4  # tokens drafted per step (the start, for "heuristic")
  config.draft_schedule = "constant"  # or "heuristic": +2 after a full accept, -1 otherwise
  config.max_draft_tokens = 0  # cap of "heuristic" (0: twice num_draft_tokens)
  config.confidence_threshold = 0.0  # stop a chain after a token the draft gives less
  return config
