"""An EAGLE-style head for SmolLM2-135M-Instruct, self-distilled on the built-in prompt set.

    python -m experiments.train_heads --config=configs/heads_eagle.py --config.run_dir=runs/eagle

Sized for about an hour on a 2-core CPU: the data of `heads_medusa.py` (~15 minutes),
then 1000 steps of 4 whole rows (~3 s each): one decoder layer, smooth L1 to the next
hidden state + 0.1 x KL to the model's law of its token, unrolled 2 steps (the second
fed the head's own features).
"""

from configs import heads_common


def get_config():
  config = heads_common.get_base_config()
  config.family = "eagle"
  config.num_heads = 1
  config.num_layers = 1
  config.unroll = 2
  config.samples_per_prompt = 2
  config.feature_dtype = "float16"
  config.steps = 1000
  config.batch_size = 4
  config.optim.update(lr=1e-3, warmup_steps=50)
  config.eval_every = 250
  config.checkpoint_every = 100
  config.max_minutes = 90.0
  config.export_dtype = "bfloat16"  # shipped: half the size; mdjax.load_heads gives float32
  return config
