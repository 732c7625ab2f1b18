"""Self-speculation: the target's first layers draft, on its own cache:
`python -m experiments.decode --config=configs/self_speculative.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "self_speculative"."""
  config = common.get_base_config("self_speculative")
  config.draft_layers = 2
  config.num_draft_tokens = 3
  return config
