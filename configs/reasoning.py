"""Sampled reasoning branches, a vote and a join:
`python -m experiments.decode --config=configs/reasoning.py`."""

from configs import common


def get_config():
  """The shared fields with pipeline "reasoning": six sampled chains of thought from
  SmolLM2-135M-Instruct (chat template), a self-consistency vote, and a join that reads
  them all (the kv join is experimental)."""
  config = common.get_base_config("reasoning")
  config.model = "smollm2-135m-instruct"
  config.prompt = ("Tom has 3 apples and buys 2 more. How many apples does he have now? "
                   "Think step by step, then end with 'The answer is <number>'.")
  config.chat = True
  config.num_branches = 6
  config.branch_tokens = 64
  config.answer_pattern = r"(?i)answer is:?\s*(\d+)"
  config.branch_header = "\n\nAttempt {index}:\n"
  config.join_prompt = "\n\nThe final answer is"
  config.join = "exact"  # or "kv"
  config.position_gap = 0
  config.temperature = 0.7
  config.max_new_tokens = 16
  return config
