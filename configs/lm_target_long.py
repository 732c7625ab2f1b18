"""A target meant to copy: code-tiny's shape with tied embeddings, trained from scratch
for many small steps, 40% of them on copy rows.

    python -m experiments.train_lm --config=configs/lm_target_long.py \\
        --config.run_dir=runs/target-long --config.tokenizer=mdjax/assets/code-tiny

Why this shape of run. Copying needs an induction circuit (a previous-token head feeding
a head that attends to the token after an earlier occurrence of the current one).
Induction forms abruptly, after a plateau whose length in tokens grows with
sqrt(batch x context) (Aoyama et al. 2025, "Predicting the emergence of induction heads",
~5e5 x sqrt(B C) tokens on natural text). On a CPU the cost is in tokens, so
the run takes small steps: 2 x 512 tokens. On repeated random blocks of a vocabulary of
8192, a tied 2-layer probe's loss fell below uniform within 400 steps (8.56 vs ln 8192 =
9.01), an untied one's did not (9.02).

Which copy rows. Rows that repeat their first half (one distance, 257 tokens) start
copying; rows that repeat a prefix of 32..257 tokens (`copy_min_period=32`) did not:
- an earlier run of this shape with a quarter first-half rows (16,000-step schedule)
  separated copy from plain accuracy from step ~2,000 (0.297 vs 0.255) and reached
  0.76 at step 6,000, though only 0.56-0.64 at distances it never trained on;
- a run of this config with `copy_min_period=32` for its first 2,500 steps (then
  resumed with the default 0): copy accuracy 0.241 vs plain 0.244 at step 2,500; with
  first-half rows it copied within 500 steps (0.347 vs 0.283 at step 3,000) and ended
  at 0.703 (plain 0.374, held-out loss 4.104) at step 6,000, still without a greedy
  copy of a whole function (`eval_lm`: 0 of 16).
A fixed distance seems to be the first rung (a head that looks back a fixed number of
positions), from which content-based copying grows, though slowly: none of the runs
continued from this one copies blocks of random ids well (`random_copy_accuracy`: 0.000
before random-id rows, 0.23 after 3,500 steps with them, 0.37 after 7,500) or 32 code
tokens in a row (`heldout_greedy_copy`: 0). Continued *untied*
(`--config.model.tie_word_embeddings=False` with `init_from` a tied export), the same
rows made the copy strong: random-id copy 0.855, 5 of 64 held-out repeats right 32
tokens in a row, after 5,500 more steps (stage 9u). Continued at a peak lr of 1e-4
(stage 11, shipped before stage 17): 0.884 and 8 of 64; see `CHANGELOG.md` and the card.
The same again from stage 11 (stage 12) gained 0.009 of loss but copied no better
(6 of 64; `eval_lm`: 3 of 16 against stage 11's 4).
Stage 13 traded random-id rows for framed copy rows (a comment between the original
and its repeat, as in `eval_lm`'s prompt): the best held-out loss of this shape
(3.508) but fewer greedy copies (`eval_lm`: 2 of 16). Stage 14 kept stage 11's rows
and made its plain rows framed ones: the best copier (copy accuracy 0.941, `eval_lm`: 5
of 16) at a worse loss (3.715), not shipped because the shipped draft agrees with it on
only 0.594 of tokens. Stage 15 drew its random rows from small alphabets
(`random_copy_min_alphabet=4`): it learnt the longer match such rows need but copied
whole-vocabulary blocks worse (0.798) and held-out functions worse (`eval_lm`: 1 of 16).
Stage 16 put a few common ids among the random ones (`random_copy_common_share=0.3`):
the same trade, no better copy (`eval_lm`: 4 of 16). Stage 17
showed each random block twice and then a fresh one (`random_copy_shown_twice=True`),
so that every predictable position is a first repeat, as a copy of code is: random-id
copy 0.999 within 1,000 steps, the best held-out loss of this shape (3.491) and the
best greedy copy (`eval_lm`: 5 of 16, 68.7% of the tokens before the first miss).
Stage 18, shipped as `code-tiny`, continued stage 17 with common ids among the random
ones shown twice (`random_copy_common_share=0.3`): the longer match on random blocks
(0.99 after a recurring id, stage 17: 0.77), held-out loss 3.483, and `eval_lm`: 5 of
16, 31 of the first 64 functions (stage 17: 29). Stage 19 added phrases of 2..4 ids to
those blocks (`random_copy_phrase_rate=0.2`): on random blocks it learnt matches of 4
ids and more (0.86, stage 18: 0.50), on code hardly (0.845 against 0.835 where a copy
must match 4 tokens or more), so `eval_lm` moved little (6 of 16, 33 of 64, but fewer
tokens before the first miss) and it was not shipped. Stage 20 made stage 18's copy rows
code chunks shown twice each (`copy_shown_twice=True`, 50% of the rows): held-out loss
3.382, the best of this shape, but fewer exact copies (50 of 131 held-out functions
against stage 18's 58), so it was not shipped either, nor stage 21 (stage 20 continued
with stage 18's rows: the trainer's best greedy copy, 18 of 64, but 50 of 131 functions),
nor stage 22 (stage 21 with 20% framed copy rows: 55 of 131, loss 3.446). The options
of stages 13, 14, 15, 19 and 22 have since been retired from the trainer
(`docs/shipped_models.md`, *The rows that teach copying*).

6,000 steps are ~1.8 h of two CPU cores, so the run fits in one working session of the
project's machines, whose run directories do not survive the session (a killed run
resumes bit for bit from its latest checkpoint).
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
  config.eval_every = 500
  config.checkpoint_every = 100
  return config
