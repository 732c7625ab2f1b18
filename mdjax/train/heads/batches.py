"""Batches of a heads run: units of one split of the cache (`features.Features`),
drawn by (seed, step) alone, so a resumed run reads the batches an uninterrupted one did.

A unit is a window of tokens from a source position (medusa's: `HeadFamily.window`),
or a whole row (heads that attend to the whole prefix: eagle, mtp, eagle3).
"""

from __future__ import annotations

import numpy as np

from mdjax.errors import MdjaxError
from mdjax.train.heads.features import Features

ROW_WIDTH_STEP = 64  # whole-row batches: widths 64, 128, ...: few compiled steps


class Reader:
  """Batches of one split. A unit is a (row, first position) pair: a window of `window`
  tokens per source position p (x[p..p + window - 1], h[p..p + window - 2]: medusa's,
  `HeadFamily.window`), or whole rows (`window` None: heads that attend to the whole
  prefix). Whole rows are kept in length order and a batch is `size` neighbours in it,
  cropped to its longest row (rounded up to `ROW_WIDTH_STEP`): rows of 60 to 500
  tokens padded to the longest of the data set would spend most of a step on padding.
  A batch (numpy, the step's input)::

      tokens  int32 [B, n]         x[p], x[p + 1], ...
      ok      bool  [B, n]         may token j be a target (inside the row, past the
                                   prompt when `mask_prompt`, not padding)?
      hidden  [B, n - 1, D]        h[p], h[p + 1], ...
      greedy  int32 [B, n - 1]     the target's greedy guesses of x[p + 1], x[p + 2], ...
      teacher [B, n - 1, D]        (where the split has them) the final-norm states at
                                   p, p + 1, ...: lm_head of them, the target's law
  """

  def __init__(self, features: Features, window: int | None, mask_prompt: bool):
    self.features, self.mask_prompt = features, mask_prompt
    if window is not None:
      self.rows, self.starts = window_sources(features, mask_prompt)
      self.width = window
    else:
      self.rows = np.argsort(features.lengths, kind="stable")
      self.starts = np.zeros(features.rows, np.int64)
      self.width = None
    if not len(self.rows):
      raise MdjaxError("the data has no position to train on: every row is too short "
                       "(or all prompt, with mask_prompt)")

  def __len__(self) -> int:
    return len(self.rows)

  def batch(self, seed: int, step: int, size: int,
            rows: slice = slice(None)) -> dict[str, np.ndarray]:
    """Batch `step`: `size` units drawn by (seed, step) alone; or only its `rows` (a
    process's part of it: `devices.shard_batch`; its width is the whole batch's)."""
    rng = np.random.default_rng([seed, step])
    if self.width is None:  # neighbours in length order
      picked = (rng.integers(0, len(self)) + np.arange(size)) % len(self)
    else:
      picked = rng.integers(0, len(self), size)
    width = self.batch_width(picked)
    return self.read(picked[rows], np.ones(len(picked[rows]), bool), width)

  def batch_width(self, picked: np.ndarray) -> int:
    """n: the window, or the longest picked row rounded up to `ROW_WIDTH_STEP`."""
    if self.width is not None:
      return self.width
    longest = int(self.features.lengths[self.rows[picked]].max())
    return min(-(-longest // ROW_WIDTH_STEP) * ROW_WIDTH_STEP, self.features.tokens.shape[1])

  def chunks(self, size: int):
    """Every unit once, `size` at a time; the last chunk is padded with dead units."""
    for start in range(0, len(self), size):
      picked = np.arange(start, start + size)
      live = picked < len(self)
      picked = np.where(live, picked, start)
      yield self.read(picked, live, self.batch_width(picked))

  def read(self, picked: np.ndarray, live: np.ndarray, width: int) -> dict[str, np.ndarray]:
    f = self.features
    rows = self.rows[picked][:, None]  # [B, 1]
    index = self.starts[picked][:, None] + np.arange(width)  # [B, n]
    ok = (index < f.lengths[rows]) & live[:, None]
    if self.mask_prompt:
      ok &= index >= f.prompt_lengths[rows]
    index = np.minimum(index, f.tokens.shape[1] - 1)
    batch = {"tokens": f.tokens[rows, index], "ok": ok, "hidden": f.hidden[rows, index[:, :-1]],
             "greedy": f.greedy[rows, index[:, :-1]]}
    if f.teacher is not None:
      batch["teacher"] = f.teacher[rows, index[:, :-1]]
    return batch


def window_sources(features: Features, mask_prompt: bool) -> tuple[np.ndarray, np.ndarray]:
  """(rows, positions) of every position p whose head-1 target x[p + 2] exists (and is
  past the prompt, with `mask_prompt`): where windows start (medusa's)."""
  first = np.maximum(features.prompt_lengths - 2, 0) if mask_prompt else np.zeros_like(
      features.lengths)
  counts = np.maximum(features.lengths - 2 - first, 0)
  rows = np.repeat(np.arange(features.rows), counts)
  offsets = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
  return rows, first[rows] + offsets
