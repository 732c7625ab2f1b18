"""Jacobi decoding, lookahead's 2-gram case without an n-gram pool (lossless):
`python -m experiments.decode --config=configs/jacobi.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "jacobi" and its window."""
  config = common.get_base_config("jacobi")
  config.window = 8  # tokens fed per pass: the last emitted one and 7 guesses
  return config
