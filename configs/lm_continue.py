"""The second stage of the first shipped pair: continue an exported first stage (float32)
with copy rows, at a lower peak learning rate.

    python -m experiments.train_lm --config=configs/lm_continue.py:target \\
        --config.run_dir=runs/target2 --config.tokenizer=runs/vocab/tokenizer-8192 \\
        --config.init_from=runs/target-f32 --config.export_dir=mdjax/assets/code-tiny
    python -m experiments.train_lm --config=configs/lm_continue.py:draft ...   (the draft)

The argument after the colon picks the architecture (the first stage's config). The
shipped draft descends from this stage's draft (`code-tiny-draft`'s card); the shipped
target does not (`configs/lm_target_long.py`).
"""

from configs import lm_draft, lm_target


def get_config(model: str = "target"):
  stages = {"target": (lm_target, 700), "draft": (lm_draft, 350)}
  if model not in stages:
    raise ValueError(f"lm_continue.py:<model> must be one of {', '.join(stages)}, got {model!r}")
  first, steps = stages[model]
  config = first.get_config()
  config.steps = steps
  config.optim.lr = 1e-3
  config.copy_fraction = 0.25  # 25% of the sequences repeat their first half
  return config
