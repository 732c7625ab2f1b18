"""Training metrics: one JSON object per line, and the loss-curve plot drawn from them.

Records carry a `step`; a resumed run first drops the records past the checkpoint it
restarts from, so the file never holds two histories. Under `jax.distributed` only
process 0 writes the file; every process keeps the records in memory, so what a
trainer decides from them (e.g. whether an evaluation is already logged) is the same
on every process.
"""

from __future__ import annotations

import json
import os
import pathlib

from mdjax import distributed
from mdjax.errors import require


class MetricsLog:
  """Append-only JSONL at `path`, read once when opened (before process 0 writes more)."""

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    self._records = ([json.loads(line) for line in self.path.read_text().splitlines()
                      if line.strip()] if self.path.is_file() else [])

  def records(self) -> list[dict]:
    return list(self._records)

  def truncate_after(self, step: int) -> None:
    """Keeps only the records of steps `<= step` (the restored checkpoint's)."""
    self._records = [r for r in self._records if r["step"] <= step]
    if distributed.is_main_process():
      partial = self.path.with_name(f".{self.path.name}.partial")
      partial.write_text("".join(json.dumps(r) + "\n" for r in self._records))
      os.replace(partial, self.path)

  def write(self, record: dict) -> None:
    self._records.append(record)
    if distributed.is_main_process():
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")


ACCURACIES = (("heldout_accuracy", "held-out top-1"),
              ("heldout_copy_accuracy", "copy rows' repeated half, top-1"),
              ("heldout_greedy_copy", "copy rows copied greedily (32 tokens)"),
              ("random_copy_accuracy", "random ids' repeat, top-1 (induction)"))


def plot_losses(records: list[dict], path: str | os.PathLike, title: str) -> None:
  """Left: train loss (every logged step), held-out loss and held-out copy loss (every
  evaluation) against step. Right: the evaluations' accuracies (`ACCURACIES`)."""
  require("matplotlib", "a training plot").use("Agg")
  import matplotlib.pyplot as plt

  train = [(r["step"], r["loss"]) for r in records if "loss" in r]
  heldout = [(r["step"], r["heldout_loss"]) for r in records if "heldout_loss" in r]
  copying = [(r["step"], r["heldout_copy_loss"]) for r in records if "heldout_copy_loss" in r]
  fig, (ax, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  if train:
    ax.plot(*zip(*train), label="train", linewidth=1)
  if heldout:
    ax.plot(*zip(*heldout), "o-", label="held-out", linewidth=1.5)
  if copying:
    ax.plot(*zip(*copying), "s--", label="held-out, repeated half of copy rows", linewidth=1.5)
  ax.set(xlabel="step", ylabel="loss (nats / token)", title=title)
  for key, label in ACCURACIES:
    points = [(r["step"], r[key]) for r in records if key in r]
    if points:
      right.plot(*zip(*points), "o-", label=label, linewidth=1.5, markersize=3)
  right.set(xlabel="step", ylabel="accuracy", ylim=(0, 1), title="held-out evaluations")
  for axis in (ax, right):
    axis.grid(alpha=0.3)
    if axis.has_data():
      axis.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
