"""Writing in the margins over a held-out source file:
`python -m experiments.decode --config=configs/margins.py`."""

from configs import common


def get_config():
  """The shared fields with pipeline "margins": the prompt is the long context."""
  config = common.get_base_config("margins")
  config.prompt = common.HELDOUT_FUNCTION
  config.question = "What does token_hex return?"
  config.chunk_tokens = 48
  config.note_tokens = 16
  config.max_new_tokens = 24
  return config
