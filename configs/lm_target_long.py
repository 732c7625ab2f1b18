"""A target meant to copy: code-tiny's shape with tied embeddings, trained from scratch
for many small steps, a quarter of them on copy rows.

    python -m experiments.train_lm --config=configs/lm_target_long.py \\
        --config.run_dir=runs/target-long --config.tokenizer=runs/vocab/tokenizer-8192

Why this shape of run. Copying needs an induction circuit (a previous-token head feeding
a head that attends to the token after an earlier occurrence of the current one).
Induction forms abruptly, after a plateau whose length in tokens grows with
sqrt(batch x context) (Aoyama et al. 2025, "Predicting the emergence of induction heads",
~5e5 x sqrt(B C) tokens on natural text). On a CPU the cost is in tokens, so
the run takes small steps: 2 x 512 tokens gives a predicted ~16M tokens, against ~32M
at code-tiny's 8 x 512. Two 2-layer probes on this machine showed the rest of the
recipe: on repeated random blocks of a vocabulary of 8192, a tied model's loss fell
below uniform within 400 steps (8.56 vs ln 8192 = 9.01), an untied one's did not
(9.02); with a vocabulary of 64 the plateau ended after ~850 steps of 16 x 128 tokens.
The held-out copy accuracy (`lm.evaluate_copying`, in metrics.jsonl at every
evaluation) shows when the circuit forms: in this run it left the plain accuracy
from step ~2,000 and reached 0.69 at step 5,000 (plain 0.37; code-tiny: 0.35 and 0.33).

16,000 steps are ~4 h of two CPU cores: the run is resumed across sessions (a
killed run resumes bit for bit from its latest checkpoint).
"""

from configs import lm_common


def get_config():
  config = lm_common.get_shipped_config(
      steps=16_000, lr=1e-3,
      hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6, num_kv_heads=2,
      head_dim=64, tie_word_embeddings=True)
  config.batch_size = 2
  config.optim.warmup_steps = 300
  config.copy_fraction = 0.25
  config.eval_every = 500
  config.checkpoint_every = 100
  return config
