"""Sampling: `python -m experiments.decode --config=configs/sample.py`.

The processors run in Hugging Face's order: temperature, top-k, top-p, min-p;
top_k 0, top_p 1 and min_p 0 disable a filter.
"""

from configs import common


def get_config():
  """The shared fields with strategy "sample", its options, and a chat prompt to
  SmolLM2-135M-Instruct."""
  config = common.get_base_config("sample")
  config.model = "smollm2-135m-instruct"
  config.prompt = "Write a short poem about the sea."
  config.chat = True
  config.temperature = 0.8
  config.top_k = 0
  config.top_p = 0.95
  config.min_p = 0.0
  return config
