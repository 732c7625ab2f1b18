"""A draft distilled from its target (the shipped draft's third and later stages).

    python -m experiments.train_lm --config=configs/lm_distill.py \\
        --config.run_dir=runs/draft3 --config.tokenizer=runs/vocab/tokenizer-8192 \\
        --config.init_from=runs/draft2-f32 --config.export_dir=mdjax/assets/code-tiny-draft

`init_from` is the draft's previous stage; the default teacher `code-tiny` is the shipped
target. Once the target copies, so must the draft: the shipped draft's later stages add
`--config.copy_fraction=0.2 --config.random_copy_fraction=0.3 --config.copy_min_period=16`
(copy rows whose repeat the target predicts, so the KL term teaches copying), which took
its argmax agreement with target stage 9u from 0.488 to 0.619. Each stage's lr, steps,
teacher and agreement are on `code-tiny-draft`'s card; the stages not shipped are in the
history in `CHANGELOG.md`.
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
