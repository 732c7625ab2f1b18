"""The search behind experiments.tpu_fit, free of flags so that tests import it: what a
compiler's RESOURCE_EXHAUSTED refusal says, and the most rows that fit with few compiles."""

from __future__ import annotations

import re

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def refusal(message: str) -> dict | None:
  """What a RESOURCE_EXHAUSTED compile error says the program needed and the chip has
  (bytes, to XLA's two decimals; None where the message gives no figures), or None for
  any other error."""
  if "RESOURCE_EXHAUSTED" not in message:
    return None
  sizes = [float(n) * UNITS[unit] for n, unit in
           re.findall(r"\((\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\)", message)]
  return dict(needed=round(sizes[0]) if sizes else None,
              available=round(sizes[1]) if len(sizes) > 1 else None,
              message=" ".join(message.split())[:300])


def largest_rows(measure, *, usable, max_rows: int, misses: int = 2) -> int:
  """The most rows (up to `max_rows`; 0 when one does not fit) for which
  `measure(rows)` fits: it returns a dict with `fits` and `total` (bytes) when it fits,
  else perhaps `needed` (bytes). Rows 1 and 2, then a line through the totals of the
  two largest row counts that fit (or of the largest and the fewest refused, by what
  they needed) predicts the most within `usable()` (bytes: what is usable now, as
  refusals tell it), then a row above it is tried; after `misses` predictions that did
  not fit, or without a rising line, bisection. Assumes that what fits at n rows fits
  at fewer."""
  seen = {}

  def fits(rows):
    if rows not in seen:
      seen[rows] = measure(rows)
    return seen[rows]["fits"]

  if not fits(1):
    return 0
  lo, hi = 1, max_rows + 1  # the most rows known to fit; the fewest known not to
  missed = 0
  while hi - lo > 1:
    rows = 2
    if lo > 1:
      fitting = sorted((r, p["total"]) for r, p in seen.items() if p["fits"])
      refused = sorted((r, p["needed"]) for r, p in seen.items()
                       if not p["fits"] and p.get("needed"))
      # between the most rows that fit and the fewest refused (what that needed), or
      # beyond the two most that fit
      (r1, t1), (r2, t2) = [fitting[-1], refused[0]] if refused else fitting[-2:]
      slope = (t2 - t1) / (r2 - r1)
      guess = r2 + int((usable() - t2) // slope) if slope > 0 else None
      if guess is None or missed >= misses:  # halve (or, no refusal yet, try the cap)
        guess = (lo + hi) // 2 if hi <= max_rows else max_rows
      rows = min(max(guess, lo + 1), hi - 1)  # at or below the line's lo: lo + 1
    if fits(rows):
      lo = rows
    else:
      hi, missed = rows, missed + (rows > 2)
  return lo
