"""A draft distilled from its target (the shipped draft's third and later stages).

    python -m experiments.train_lm --config=configs/lm_distill.py \\
        --config.run_dir=runs/draft3 --config.tokenizer=runs/vocab/tokenizer-8192 \\
        --config.init_from=runs/draft2-f32 --config.export_dir=mdjax/assets/code-tiny-draft

`init_from` is the draft's previous stage (exported in float32 up to the sixth; the
seventh started from the shipped bfloat16 draft); the default teacher
`code-tiny` is the shipped target in bfloat16 (the shipped draft's fourth to sixth
stages were distilled from stage 9u's float32 export, its seventh from stage 11's
bfloat16 one, the weights shipped as `code-tiny`). Once the target copies, so must the
draft: the shipped draft's fifth stage adds `--config.copy_fraction=0.2
--config.random_copy_fraction=0.3 --config.copy_min_period=16 --config.optim.lr=2e-3
--config.steps=1500`, which took its argmax agreement with the target from 0.488 to
0.589, and its sixth the same rows at `--config.optim.lr=1e-3 --config.steps=1000`, to
0.619. Its seventh followed the target's eleventh stage with the same rows at
`--config.optim.lr=3e-4 --config.steps=400`, from 0.598 to 0.608 (`code-tiny-draft`'s
card). An eighth, 500 steps at `--config.optim.lr=5e-4` with the default teacher,
reached 0.611 (0.602 by `eval_lm`, stage 7: 0.601) and was not shipped.
"""

from configs import lm_draft


def get_config():
  config = lm_draft.get_config()
  config.steps = 400
  config.optim.update(lr=1e-3, warmup_steps=20)
  config.teacher = "code-tiny"
  config.distill_weight = 0.8  # 0.8 x KL to the target + 0.2 x cross-entropy on the data
  config.copy_fraction = 0.15
  config.eval_every = 50
  config.checkpoint_every = 25
  return config
