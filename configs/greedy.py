"""Greedy decoding of a chat question to the real instruct model:
`python -m experiments.decode --config=configs/greedy.py`; code-tiny completes a
held-out function with `--config.model=code-tiny --config.chat=False
--config.prompt="$(python -c 'from configs import common; print(common.HELDOUT_FUNCTION)')"`."""

from configs import common


def get_config():
  """The shared fields with strategy "greedy": one chat question to SmolLM2-135M-Instruct."""
  config = common.get_base_config("greedy")
  config.model = "smollm2-135m-instruct"
  config.prompt = "What is the capital of France? Answer in one sentence."
  config.chat = True
  return config
