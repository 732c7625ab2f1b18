"""Candidate next user turns for a transcript, and a reply to each:
`python -m experiments.decode --config=configs/predict_user.py`."""

from configs import common


def get_config():
  """The shared fields with pipeline "predict_user"; the prompt is the transcript."""
  config = common.get_base_config("predict_user")
  config.prompt = "# User: how do I read a file?\n# Assistant: use open(path).read()\n"
  config.user_prefix = "# User:"
  config.assistant_prefix = "# Assistant:"
  config.num_candidates = 4
  config.candidate_tokens = 16
  config.max_new_tokens = 16
  config.temperature = 0.8
  return config
