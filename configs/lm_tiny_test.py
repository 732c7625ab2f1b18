"""A seconds-long run for tests and smoke checks (point `data_dir` at a small folder)."""

from configs import lm_common


def get_config():
  config = lm_common.get_base_config()
  config.vocab_size = 300
  config.model.update(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=False)
  config.seq_len = 32
  config.batch_size = 4
  config.steps = 20
  config.optim.update(lr=1e-2, warmup_steps=5)
  config.log_every = 5
  config.eval_every = 10
  config.eval_sequences = 4
  config.checkpoint_every = 5
  config.keep_checkpoints = 2
  config.export_dtype = "float32"
  return config
