r"""What one target pass costs on the device that runs it: t(n), the seconds of one
`decode_step` feeding n tokens to each of B rows over a cached prefix, for n in
`WIDTHS` = 1, 2, 4, ..., 64. `tree_budget="auto"` (`mdjax.strategies.tree_choice`)
sizes its tree by it::

    t(n) / t(1)       n =  1    2    4    8    16   32   64
    2-core CPU, float32    1  1.57 1.45 1.61 2.13 3.53 5.89    SmolLM2-135M, batch 1:
                                                               trees must stay small
    2-core CPU, bfloat16   1  0.91 1.02 1.10 1.50 1.80 3.11    (`numerics.linear`)
    H200, bfloat16         1  1.39 1.40 1.40 1.44 1.49 1.57    a random 1B llama, batch 1
                                                               (docs/device): past the
                                                               first extra token, wide
                                                               trees are nearly free

Between the measured widths t is linear in n; past 64 it goes on along the last
segment. A pass of n tokens can always run as a wider one with padding, so each width
costs at most what any wider one costs (the suffix minimum): a noisy width, or a device
where 2 tokens cost less than 1 (bfloat16 on XLA:CPU, see `mdjax.models.numerics.linear`),
cannot make a smaller tree look dearer than a larger one.

Measured once per (architecture, attention, device kind and count, dtype, batch
bucket: the request's rows rounded up to a power of two) and cached on disk, as
`files.cache_dir()/pass_cost/<digest of the key>/profile.json`::

    {"key": {...}, "widths": [1, 2, 4, 8, 16, 32, 64], "seconds": [t(1), ..., t(64)]}

written atomically (`files.atomic_directory`) under a lock, so processes racing for
one entry measure it once. A file that does not parse, was written for another key,
or holds a time that is not a positive finite number is said so on stderr and
measured again, never trusted. Under `jax.distributed` every process runs the
measuring programs (they span the mesh) and takes process 0's times and cache.

`$MDJAX_PASS_COST` pins the profile instead, for every model: seven comma-separated
ratios t(n) / t(1) at `WIDTHS` ("1,1,1,1,1,1,1": a flat, GPU-like device), to
reproduce a choice made elsewhere; the test suite pins a flat one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from mdjax import cache as cache_ops
from mdjax import distributed, files
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError
from mdjax.models.attention import ATTENTION_BLOCK
from mdjax.models.quantized import is_quantized
from mdjax.strategies.base import ModelFn
from mdjax.topology import Topology

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # tokens fed per row
PREFIX = 256  # cached tokens every measured pass attends to (fewer when the context is short)
MEASURE_S = 0.2  # seconds of timed passes per width and round
ROUNDS = 5  # timed rounds of every width: the fastest of each is kept (the least disturbed)
MAX_REPEATS = 100
PIN_VARIABLE = "MDJAX_PASS_COST"
VERSION = 3  # bump when measuring changes, so older cached profiles are not reused


@dataclasses.dataclass(frozen=True)
class PassCost:
  """t(n) at `batch` rows: `seconds[i]` per pass of `WIDTHS[i]` tokens per row;
  `source` is "measured", "cached" or "pinned" (then the seconds are ratios)."""

  seconds: tuple[float, ...]
  batch: int
  source: str

  def __post_init__(self):
    if len(self.seconds) != len(WIDTHS) or not all(
        isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0
        for s in self.seconds):
      raise MdjaxError(f"a pass-cost profile needs {len(WIDTHS)} positive finite times (at "
                       f"n = {', '.join(map(str, WIDTHS))}), got {self.seconds!r}")

  def __call__(self, n: float) -> float:
    """t(n): linear between the measured widths (each at most any wider one), along
    the last segment past them."""
    padded = np.minimum.accumulate(np.asarray(self.seconds)[::-1])[::-1]
    if n <= WIDTHS[-1]:
      return float(np.interp(n, WIDTHS, padded))
    slope = (padded[-1] - padded[-2]) / (WIDTHS[-1] - WIDTHS[-2])
    return float(padded[-1] + slope * (n - WIDTHS[-1]))

  def stats(self) -> dict:
    """What `out.stats` shows of it."""
    return {"pass_cost_widths": list(WIDTHS), "pass_cost_s": list(self.seconds),
            "pass_cost_batch": self.batch, "pass_cost_source": self.source}


def batch_bucket(rows: int) -> int:
  """The batch a request of `rows` rows is measured at: the next power of two."""
  return 1 << max(rows - 1, 0).bit_length()


def pass_cost(model: ModelFn, params, rows: int) -> PassCost:
  """t(n) of `model` (with `params`, placed as they will run) at `rows` rows: pinned by
  `$MDJAX_PASS_COST`, else cached, else measured now and cached."""
  batch = batch_bucket(rows)
  pinned = os.environ.get(PIN_VARIABLE)
  if pinned is not None:
    return PassCost(seconds=_pinned(pinned), batch=batch, source="pinned")
  key = _key(model, params, batch)
  entry = cache_entry(model, params, rows)
  main = distributed.is_main_process()
  lock = (files.exclusive_lock(files.cache_dir() / "locks" / f"pass_cost-{entry.name}.lock")
          if main else contextlib.nullcontext())
  with lock:
    cached = _read(entry / "profile.json", key) if main else None
    if distributed.agreed(cached is not None):
      seconds, source = cached or (1.0,) * len(WIDTHS), "cached"
    else:
      seconds, source = measure(model, params, batch), "measured"
      if main:
        with files.atomic_directory(entry) as staging:
          (staging / "profile.json").write_text(json.dumps(
              {"key": key, "widths": list(WIDTHS), "seconds": list(seconds)}, indent=1) + "\n")
  seconds = distributed.from_main(np.asarray(seconds, np.float64))
  return PassCost(seconds=tuple(seconds.tolist()), batch=batch, source=source)


def cache_entry(model: ModelFn, params, rows: int) -> pathlib.Path:
  """The directory caching t(n) of `model` at `rows` rows (its `profile.json`)."""
  key = json.dumps(_key(model, params, batch_bucket(rows)), sort_keys=True)
  return files.cache_dir() / "pass_cost" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _pinned(text: str) -> tuple[float, ...]:
  try:
    ratios = tuple(float(x) for x in text.split(","))
  except ValueError:
    ratios = ()
  if len(ratios) != len(WIDTHS) or not all(math.isfinite(r) and r > 0 for r in ratios):
    raise MdjaxError(f"${PIN_VARIABLE} must be {len(WIDTHS)} comma-separated positive ratios "
                     f"t(n)/t(1) at n = {', '.join(map(str, WIDTHS))}, got {text!r}")
  return ratios


def _key(model: ModelFn, params, batch: int) -> dict:
  """What a profile depends on: the architecture (not the weights' values), the
  attention, the devices the weights lie on, their dtype (and bits, quantized), the batch."""
  embed = params["embed"]
  bits = f", {embed.bits}-bit" if is_quantized(embed) else ""
  device = jax.devices()[0]
  return {"version": VERSION,
          "config": hashlib.sha256(repr(model.config).encode()).hexdigest()[:16],
          "attention": model.attention, "platform": device.platform,
          "device_kind": device.device_kind, "devices": len(jax.tree.leaves(embed)[0].sharding.device_set),
          "dtype": str(embed.dtype) + bits, "batch": batch, "prefix": _prefix(model)}


def _prefix(model: ModelFn) -> int:
  return max(0, min(PREFIX, model.config.max_position_embeddings - WIDTHS[-1]))


def _read(path, key: dict) -> tuple[float, ...] | None:
  """The cached seconds at `path`, or None: missing, or untrustworthy (then said so)."""
  if not path.is_file():
    return None
  try:
    data = json.loads(path.read_text())
    if data["key"] != key or tuple(data["widths"]) != WIDTHS:
      raise ValueError("written for another key")
    return PassCost(seconds=tuple(data["seconds"]), batch=key["batch"], source="cached").seconds
  except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and MdjaxError are ValueErrors
    print(f"mdjax: the pass-cost cache {str(path)!r} is corrupt ({type(e).__name__}: {e}); "
          "measuring again", file=sys.stderr)
    return None


def measure(model: ModelFn, params, batch: int, widths: tuple[int, ...] = WIDTHS,
            rounds: int = ROUNDS) -> tuple[float, ...]:
  """t(n) measured now, not cached: seconds per pass at every width of `widths` (a profile:
  `WIDTHS`; a smoke test asks for fewer), each pass run inside one compiled loop (no
  dispatch between passes): each width's program compiled and timed over one pass, then
  `rounds` rounds, each timing every width in turn over as many passes as take about
  `MEASURE_S` (as many on every process); each width's fastest round kept. Interleaved,
  a spell of load on the machine slows every width alike, not one."""
  runs, repeats = [], []
  bar = tqdm(total=len(widths) * (1 + rounds), desc=f"mdjax: measuring t(n) at batch {batch}",
             unit="timing", delay=1.0, disable=not distributed.is_main_process(), file=sys.stderr)
  for width in widths:
    run = jax.jit(functools.partial(_passes, model=model, batch=batch, width=width,
                                    prefix=_prefix(model)))
    _timed(run, params, 1)  # compiles
    once = _timed(run, params, 1)
    runs.append(run)
    repeats.append(int(distributed.from_main(np.asarray(
        min(MAX_REPEATS, max(2, math.ceil(MEASURE_S / max(once, 1e-6)))), np.int64))))
    bar.update()
  best = [math.inf] * len(widths)
  for _ in range(rounds):
    for i, (run, count) in enumerate(zip(runs, repeats)):
      best[i] = min(best[i], _timed(run, params, count) / count)
      bar.update()
  bar.close()
  return tuple(best)


def _timed(run, params, repeats: int) -> float:
  start = time.perf_counter()
  jax.block_until_ready(run(params, jnp.asarray(repeats, jnp.int32)))
  return time.perf_counter() - start


def _passes(params, repeats, *, model: ModelFn, batch: int, width: int, prefix: int):
  """`repeats` passes of `width` tokens per row (one causal chain) after `prefix` cached
  tokens, each rolled back; returns the largest logit seen, so no pass is dead code."""
  slots = -(-(prefix + WIDTHS[-1]) // ATTENTION_BLOCK) * ATTENTION_BLOCK
  slot = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
  dtype = params["embed"].dtype
  cache = KVCache.for_params(model.config, params, batch, slots, dtype).replace(
      pos=slot, seg=jnp.where(slot < prefix, 0, -1), length=jnp.full((batch,), prefix, jnp.int32))
  tokens = jnp.zeros((batch, width), jnp.int32)
  positions = jnp.broadcast_to(prefix + jnp.arange(width, dtype=jnp.int32), (batch, width))

  def one(_, carry):
    cache, top = carry
    logits, _, cache = model(params, cache, tokens, positions, jnp.zeros_like(tokens),
                             Topology.causal(batch))  # [B, width, V]
    return cache_ops.rollback(cache, cache.length - width), jnp.maximum(top, logits.max())

  _, top = jax.lax.fori_loop(0, repeats, one, (cache, jnp.float32(-jnp.inf)))
  return top
