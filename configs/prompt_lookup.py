"""Prompt lookup decoding (lossless: same tokens as greedy, fewer model passes):
`python -m experiments.decode --config=configs/prompt_lookup.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "prompt_lookup" and its two options."""
  config = common.get_base_config("prompt_lookup")
  config.prompt_lookup_num_tokens = 10  # tokens proposed per step
  config.max_ngram_size = 2  # longest suffix n-gram looked up in prompt + output
  return config
