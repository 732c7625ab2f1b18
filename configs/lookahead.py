"""Lookahead decoding (lossless: same tokens as greedy, fewer model passes, no draft
model): `python -m experiments.decode --config=configs/lookahead.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "lookahead" and its three options."""
  config = common.get_base_config("lookahead")
  config.window = 7  # W: Jacobi window columns (tokens per level, the last emitted one included)
  config.ngram = 5  # N: n-gram length; the window keeps N - 1 levels of past guesses
  config.guess_set = 7  # G: pool n-grams verified per pass
  return config
