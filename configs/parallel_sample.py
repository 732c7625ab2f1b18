"""N samples sharing one prompt's KV:
`python -m experiments.decode --config=configs/parallel_sample.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "parallel_sample", its sampling options, and a
  chat prompt to SmolLM2-135M-Instruct: four names over the prompt's one KV cache."""
  config = common.get_base_config("parallel_sample")
  config.model = "smollm2-135m-instruct"
  config.prompt = "Suggest a name for a small fishing boat. Answer with the name only."
  config.chat = True
  config.num_samples = 4
  config.temperature = 0.8
  config.top_p = 0.95
  config.max_new_tokens = 16
  return config
