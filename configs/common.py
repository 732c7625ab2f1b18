"""The fields every decode config shares; `greedy.py` and `sample.py` build on them.

Conventions (ConfigDict overrides cannot express None or lists well, so these are
strings):
- `prompt`: text, tokenized by the model's tokenizer. When empty, `prompt_ids` is
  the prompt: comma-separated token ids (random models have no tokenizer).
- `eos_token_id`: "" = the model's own EOS ids, "none" = no EOS (always generate
  `max_new_tokens`), else comma-separated ids such as "2" or "2,7".
"""

import ml_collections


def get_base_config(strategy: str) -> ml_collections.ConfigDict:
  """The shared fields, set to decode 32 tokens of the seeded random llama."""
  config = ml_collections.ConfigDict()
  config.model = "random-llama"  # HF directory, hub id, shipped or built-in random model name
  config.dtype = "float32"  # or "bfloat16"
  config.strategy = strategy
  config.prompt = ""
  config.prompt_ids = "1,15,27,100,7,42"
  config.max_new_tokens = 32
  config.eos_token_id = ""
  config.seed = 0  # seeds sampling; a random model always has its canonical (seed 0) weights
  return config
