"""Beam search (transformers' semantics): `python -m experiments.decode --config=configs/beam.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "beam", its options, and a chat prompt to
  SmolLM2-135M-Instruct."""
  config = common.get_base_config("beam")
  config.model = "smollm2-135m-instruct"
  config.prompt = "Write a one-line slogan for a lighthouse museum."
  config.chat = True
  config.num_beams = 4
  config.length_penalty = 1.0
  config.early_stopping = False  # True, False or "never", as in transformers
  return config
