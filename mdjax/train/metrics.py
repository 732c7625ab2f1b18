"""Training metrics: one JSON object per line, and the plot of the losses and accuracies
drawn from them (both trainers').

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

from mdjax import distributed, files
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
      files.write_text(self.path, "".join(json.dumps(r) + "\n" for r in self._records))

  def write(self, record: dict) -> None:
    self._records.append(record)
    if distributed.is_main_process():
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")


LOSSES = (("loss", "-", "train"), ("heldout_loss", "o-", "held-out"),
          ("heldout_copy_loss", "s--", "held-out, repeated half of copy rows"))
ACCURACIES = (("heldout_accuracy", "held-out top-1"),
              ("heldout_copy_accuracy", "copy rows' repeated half, top-1"),
              ("heldout_greedy_copy", "copy rows copied greedily (32 tokens)"),
              ("random_copy_accuracy", "random ids' repeat, top-1 (induction)"))
TOPK = "heldout_topk"  # per head: its cumulative top-1..top-k accuracies (the heads trainer's)


def plot_losses(records: list[dict], path: str | os.PathLike, title: str, *,
                loss_label: str = "loss (nats / token)", accuracy_label: str = "accuracy",
                accuracy_title: str = "held-out evaluations") -> None:
  """Left: the `LOSSES` the records hold against step (train: every logged step;
  held-out: every evaluation). Right: the evaluations' accuracies: the `ACCURACIES`
  they hold, and for each head of a `TOPK` list its top-1 (solid) and top-5 (dashed).
  Written atomically (a reader never sees half a picture)."""
  require("matplotlib", "a training plot").use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  for key, style, label in LOSSES:
    points = [(r["step"], r[key]) for r in records if key in r]
    if points:
      left.plot(*zip(*points), style, label=label, linewidth=1.2, markersize=3)
  left.set(xlabel="step", ylabel=loss_label, title=title)
  for key, label in ACCURACIES:
    points = [(r["step"], r[key]) for r in records if key in r]
    if points:
      right.plot(*zip(*points), "o-", label=label, linewidth=1.5, markersize=3)
  evaluations = [r for r in records if TOPK in r]
  steps = [r["step"] for r in evaluations]
  for head in range(len(evaluations[0][TOPK]) if evaluations else 0):
    line, = right.plot(steps, [r[TOPK][head][0] for r in evaluations], "o-",
                       label=f"head {head + 1} top-1", markersize=3)
    right.plot(steps, [r[TOPK][head][4] for r in evaluations], "s--",
               color=line.get_color(), label=f"head {head + 1} top-5", markersize=3)
  right.set(xlabel="step", ylabel=accuracy_label, ylim=(0, 1), title=accuracy_title)
  for axis in (left, right):
    axis.grid(alpha=0.3)
    if axis.has_data():
      axis.legend(fontsize=8)
  fig.tight_layout()
  with files.atomic_file(path) as partial:
    fig.savefig(partial, dpi=110)
  plt.close(fig)
