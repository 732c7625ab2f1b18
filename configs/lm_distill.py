"""The third stage of the shipped draft: distilled from the shipped target.

    python -m experiments.train_lm --config=configs/lm_distill.py \\
        --config.run_dir=runs/draft3 --config.tokenizer=runs/vocab/tokenizer-8192 \\
        --config.init_from=runs/draft2-f32 --config.export_dir=mdjax/assets/code-tiny-draft

`init_from` is the draft's second stage exported in float32. The shipped draft was
distilled from the target's float32 export (`--config.teacher=runs/target2-f32`); the
default teacher `code-tiny` is the same weights rounded to bfloat16.
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
