"""Candidate next user turns for a transcript, and a reply to each:
`python -m experiments.decode --config=configs/predict_user.py`."""

from configs import common


def get_config():
  """The shared fields with pipeline "predict_user" on a short chat with
  SmolLM2-135M-Instruct (the transcript in its ChatML format)."""
  config = common.get_base_config("predict_user")
  config.model = "smollm2-135m-instruct"
  config.prompt = ("<|im_start|>user\nI want to visit a lighthouse this summer.<|im_end|>\n"
                   "<|im_start|>assistant\nGreat idea! Many lighthouses have museums and open "
                   "their towers to visitors in summer.<|im_end|>\n")
  config.user_prefix = "<|im_start|>user\n"
  config.assistant_prefix = "<|im_start|>assistant\n"
  config.turn_end = "<|im_end|>\n"
  config.num_candidates = 4
  config.candidate_tokens = 24
  config.max_new_tokens = 32
  config.temperature = 0.8
  return config
