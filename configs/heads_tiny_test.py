"""A seconds-long heads run for tests and smoke checks: the random tiny llama, whose
prompts must be token ids (point `data.prompts` at a .jsonl file of id lists)."""

from configs import heads_common


def get_config():
  config = heads_common.get_base_config()
  config.model = "random-llama-tiny"
  config.num_heads = 3
  config.data.update(max_new_tokens=16, generation_batch=8)
  config.steps = 40
  config.batch_size = 32
  config.optim.update(lr=1e-2, warmup_steps=5)
  config.log_every = 5
  config.eval_every = 20
  config.checkpoint_every = 10
  config.keep_checkpoints = 2
  return config
