"""EAGLE-3 heads for SmolLM2-135M-Instruct over a draft vocabulary, trained on a data set
`experiments/make_head_data.py` wrote (the model's own answers and hidden states): the
shipped `smollm2-135m-instruct-eagle3`.

    python -m experiments.make_head_data --out_dir=runs/head_data
    python -m experiments.train_heads --config=configs/heads_eagle3.py \
        --config.run_dir=runs/eagle3 --config.data.data_dir=runs/head_data

One decoder layer over three of the model's layers (1, 14 and 26 of 30), 8192 draft
tokens, the training-time test unrolled 7 steps (EAGLE-3's; step j weighted 0.8^j),
cross-entropy to the model's greedy guesses; whole rows of similar length, 8 a step.
On the 2-core CPU a step takes ~6-8 s, so the 30-minute budget stops it near step 220
of the 250 its learning-rate schedule spans. The shipped head is that run (217 steps,
held-out step-1 top-1 0.301) resumed in the same run_dir with the schedule stretched:

    python -m experiments.train_heads --config=configs/heads_eagle3.py \
        --config.run_dir=runs/eagle3 --config.data.data_dir=runs/head_data \
        --config.steps=560 --config.eval_every=200 --config.max_minutes=45

(41 more minutes to step 560, 73 in all: held-out step-1 top-1 0.361.)
"""

from configs import heads_common


def get_config():
  config = heads_common.get_shipped_config("eagle3")
  config.num_heads = 1
  config.num_layers = 1
  config.eagle.unroll = 7
  config.draft_vocab_size = 8192
  config.loss = "ce"
  config.steps = 250
  config.batch_size = 8
  config.eval_every = 125
  config.max_minutes = 30.0
  return config
