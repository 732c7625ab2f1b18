"""Train (or resume) multi-token-prediction heads over a frozen model, and export them.

    python -m experiments.train_heads --config=configs/heads_medusa.py --config.run_dir=runs/medusa
    python -m experiments.train_heads --config=configs/heads_eagle.py --config.run_dir=runs/eagle \
        --config.max_minutes=30
    python -m experiments.train_heads --config=configs/heads_medusa.py --config.run_dir=runs/m \
        --config.mesh=4,2     # the model on a data 4 x tensor 2 mesh of all 8 devices
    python -m experiments.train_heads --config=configs/heads_medusa.py --config.run_dir=runs/m \
        --config.mesh=4,4 --config.distributed=auto   # on every host (4 x 4 devices)

The model writes its own training text, its hidden states are cached in `run_dir`
(a rerun reuses them), the heads train, and the export lands in `run_dir/export`
(`mdjax.load_heads` reads it). Killed at any point, the same command resumes from the
latest checkpoint and ends with the parameters an uninterrupted run would have. The
final line is the training summary as JSON. Bad input: one `error: ...` line, exit 1.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from experiments.cli import json_main
from mdjax.train import heads

_CONFIG = config_flags.DEFINE_config_file("config", None,
                                          "Heads config, e.g. configs/heads_medusa.py.")
flags.mark_flag_as_required("config")


def run(config) -> dict:
  """Trains to `config.steps` (or `max_minutes`) and exports; returns the summary.
  `heads.train` types the config once (`mdjax.train.config`)."""
  result = heads.train(config)
  return {"export_dir": str(result.export_dir), "family": result.heads.config.family,
          "steps": result.step, "stopped_early": result.stopped_early,
          "train_minutes": result.train_seconds / 60,
          "train_rows": result.data.train.rows, "heldout_rows": result.data.heldout.rows,
          "heldout_top1": result.heldout["heldout_top1"],
          "heldout_accepted_length": result.heldout["heldout_accepted_length"]}


if __name__ == "__main__":
  app.run(json_main(run, _CONFIG))
