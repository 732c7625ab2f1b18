"""A target meant to copy: code-tiny's shape with tied embeddings, trained from scratch
for many small steps, 40% of them on copy rows at varied distances.

    python -m experiments.train_lm --config=configs/lm_target_long.py \\
        --config.run_dir=runs/target-long --config.tokenizer=mdjax/assets/code-tiny

Why this shape of run. Copying needs an induction circuit (a previous-token head feeding
a head that attends to the token after an earlier occurrence of the current one).
Induction forms abruptly, after a plateau whose length in tokens grows with
sqrt(batch x context) (Aoyama et al. 2025, "Predicting the emergence of induction heads",
~5e5 x sqrt(B C) tokens on natural text). On a CPU the cost is in tokens, so
the run takes small steps: 2 x 512 tokens. Two 2-layer probes on this machine showed the
rest of the recipe: on repeated random blocks of a vocabulary of 8192, a tied model's
loss fell below uniform within 400 steps (8.56 vs ln 8192 = 9.01), an untied one's did
not (9.02). An earlier run of this shape (a quarter copy rows, all at distance 257)
learned to copy from step ~2,000: held-out copy accuracy 0.76 at step 6,000 of a
16,000-step schedule, but 0.56-0.64 at distances it never trained on. So the copy rows
here repeat prefixes of 32..257 tokens (`copy_min_period`), and the schedule decays
within 6,000 steps (~1.8 h of two CPU cores), so the run ends in one session.
"""

from configs import lm_common


def get_config():
  config = lm_common.get_shipped_config(
      steps=6_000, lr=1e-3,
      hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6, num_kv_heads=2,
      head_dim=64, tie_word_embeddings=True)
  config.batch_size = 2
  config.optim.warmup_steps = 300
  config.copy_fraction = 0.4
  config.copy_min_period = 32
  config.eval_every = 500
  config.checkpoint_every = 100
  return config
