"""N samples sharing one prompt's KV:
`python -m experiments.decode --config=configs/parallel_sample.py`."""

from configs import common


def get_config():
  """The shared fields with strategy "parallel_sample" and its sampling options."""
  config = common.get_base_config("parallel_sample")
  config.num_samples = 4
  config.temperature = 0.8
  config.top_p = 0.95
  return config
