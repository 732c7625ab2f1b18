"""An EAGLE-style head for SmolLM2-135M-Instruct, self-distilled on the built-in prompt set.

    python -m experiments.train_heads --config=configs/heads_eagle.py --config.run_dir=runs/eagle

Sized for about an hour on a 2-core CPU: the data of `heads_medusa.py` (~15 minutes),
then 1000 steps of 4 whole rows (~3 s each): one decoder layer, smooth L1 to the next
hidden state + 0.1 x KL to the model's law of its token, unrolled 2 steps (the second
fed the head's own features).
"""

from configs import heads_common


def get_config():
  config = heads_common.get_shipped_config("eagle")
  config.num_heads = 1
  config.num_layers = 1
  config.eagle.unroll = 2
  config.steps = 1000
  config.batch_size = 4
  return config
