"""Several questions over one shared context, answered in one pass per token, each
answer == greedy(context + question): `python -m experiments.decode
--config=configs/multi_question.py`. Override with a tuple, e.g.
`--config.questions="('\\n    return', '\\n    if')"`."""

from configs import common


def get_config():
  """The shared fields with strategy "multi_question" and two continuations of the
  default prompt's docstring as the questions."""
  config = common.get_base_config("multi_question")
  config.questions = ("\n    return", "\n    if nbytes")
  config.max_new_tokens = 24
  return config
