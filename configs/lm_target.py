"""The shipped target (`code-tiny`): a ~12M-parameter llama on the standard library."""

from configs import lm_common


def get_config():
  config = lm_common.get_base_config()
  config.model.update(hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                      num_kv_heads=2, head_dim=64, tie_word_embeddings=False)
  config.seq_len = 512
  config.batch_size = 8
  config.steps = 900  # ~75 min at ~950 tokens/s on 2 CPU cores
  config.optim.update(lr=2e-3, warmup_steps=50)
  config.eval_every = 100
  config.checkpoint_every = 50
  return config
