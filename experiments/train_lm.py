"""Train (or resume) a causal LM and export it in Hugging Face format.

    python -m experiments.train_lm --config=configs/lm_target.py --config.run_dir=/tmp/target
    python -m experiments.train_lm --config=configs/lm_draft.py --config.run_dir=/tmp/draft \
        --config.tokenizer=/tmp/target/tokenizer
    python -m experiments.train_lm --config=configs/lm_target.py --config.run_dir=/tmp/target \
        --config.export_only=True       # export the latest checkpoint now
    python -m experiments.train_lm --config=configs/lm_target.py --config.run_dir=/tmp/target \
        --config.mesh=2,4               # data 2 x tensor 4: a mesh of all 8 devices
    python -m experiments.train_lm --config=configs/lm_target.py --config.run_dir=/shared/t \
        --config.mesh=4,4 --config.distributed=auto   # on every host (4 x 4 devices)

Killed at any point, the same command resumes from the latest checkpoint in
`run_dir` (on any `--config.mesh` and any number of processes: checkpoints hold the
one-device layout) and ends with the parameters an uninterrupted run would have. The
final line is the training summary as JSON. Bad input: one `error: ...` line, exit 1.
"""

from __future__ import annotations

import pathlib
import shlex
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments.cli import json_main
from mdjax.train import export, lm

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config, e.g. configs/lm_target.py.")
flags.mark_flag_as_required("config")


def run(config) -> dict:
  """Trains to `config.steps` (nothing when `export_only` or already there), then exports.
  `lm.train` types the config once (`mdjax.train.config`); the export reads that."""
  result = lm.train(config, restore_only=config.export_only)
  typed = result.config
  directory = typed.export_dir or pathlib.Path(typed.run_dir) / "export"
  command = shlex.join(["python", "-m", "experiments.train_lm", *sys.argv[1:]])
  return export.export(result, typed, directory, command=command)


if __name__ == "__main__":
  app.run(json_main(run, _CONFIG))
