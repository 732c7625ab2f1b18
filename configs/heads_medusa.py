"""Medusa heads for SmolLM2-135M-Instruct over a draft vocabulary, trained on a data set
`experiments/make_head_data.py` wrote (the model's own answers and hidden states):
the shipped `smollm2-135m-instruct-medusa`.

    python -m experiments.make_head_data --out_dir=runs/head_data
    python -m experiments.train_heads --config=configs/heads_medusa.py \
        --config.run_dir=runs/medusa --config.data.data_dir=runs/head_data

Four heads of one residual block, each scoring the 8192 most frequent tokens of the
training answers, trained by cross-entropy to the model's greedy guesses (what a greedy
verifier accepts), 256 positions a step. Without `data.data_dir` the run generates its own
data from the built-in prompt set first (`configs/heads_common.py`).
"""

from configs import heads_common


def get_config():
  config = heads_common.get_shipped_config("medusa")
  config.num_heads = 4
  config.num_layers = 1
  config.draft_vocab_size = 8192
  config.loss = "greedy"
  config.steps = 3500  # ~5 steps/s on the 2-core CPU: ~11 minutes
  config.batch_size = 256
  config.eval_every = 1750
  config.max_minutes = 45.0
  return config
