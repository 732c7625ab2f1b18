"""mdjax's quantized products against qwix's (Google's JAX quantization library, which
MaxText and vLLM's TPU backend quantize through), on SmolLM2's own matrices, on this CPU:
the measurement behind mdjax keeping its own `QuantizedWeight` and products.

    python3 -m experiments.bench.qwix_products          # SmolLM2's layer 0 (~1 min)
    python3 -m experiments.bench.qwix_products --quick --out_dir=/tmp/qwix   # smoke test

For each matrix of layer 0 (x [M, D] @ w [D, F]) and each batch of rows M, one jitted
product per contender:

    float32        x @ w
    mdjax int8     `quantized.product`: x as two int8 terms per row, int32 sums
    qwix int8      `qwix.dot_general(x, qwix.quantize(w, int8, per column))`: weight-only,
                   so qwix dequantizes w in the product's input (its rule: XLA fuses that
                   on a GPU or TPU)
    qwix w8a8      x quantized by qwix too (int8 per row): an integer product, and x
                   rounded to 8 bits
    mdjax int4     `quantize="int4"`'s form: groups of 64 with offsets, fit by least squares
    qwix int4      `qwix.quantize(w, int4, per column, tiles of 64 inputs, "minmax")`: an
                   int4 zero point per group

Each gets its time (median of interleaved repeats, ms), its error against the product
with its own dequantized weight (`x @ dequantize(q)`: how far the computation is from
its weights' value) and against the float32 product (`x @ w`: what quantizing costs),
both relative to the largest output, and its weights' bytes (4-bit values two a byte).

Writes `qwix_products.json` and `qwix_products.png` to `--out_dir`. qwix is in
requirements-dev.txt (or `python3 -m pip install --no-deps qwix==0.1.8`).
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import mdjax
from experiments.bench.common import (bars, interleaved, machine_info, machine_line,
                                      memory_bandwidth, plt, results_dir, save_figure,
                                      write_results)
from experiments.bench.qwix_forms import contenders, import_qwix, packed_bytes, relative
from experiments.cli import check_argv, one_line_errors

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Model whose layer 0 is read.")
_ROWS = flags.DEFINE_list("rows", ["1", "8"], "Rows M of x.")
_REPEATS = flags.DEFINE_integer("repeats", 30, "Timed repeats (median).")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("quantized/qwix"), "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: random-llama-tiny, 3 repeats.")

# the matrices of a layer (mdjax's fused names), each `[D, F]`
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


def bench_matrix(w: jax.Array, rows: list[int], repeats: int, label: str) -> dict:
  """Per contender: its bytes, and per row count its ms and errors (module)."""
  forms = {name: (weights, jax.jit(product), dequantize)
           for name, (weights, product, dequantize) in contenders(w).items()}
  found = {name: dict(bytes=packed_bytes(weights), rows={})
           for name, (weights, _, _) in forms.items()}
  rng = np.random.default_rng(0)
  for m in rows:
    x = jnp.asarray(rng.standard_normal((m, w.shape[0])), jnp.float32)
    exact = x @ w
    calls, errors = {}, {}
    for name, (weights, run, dequantize) in forms.items():
      out = run(x, weights)
      errors[name] = dict(vs_own_value=relative(out, x @ dequantize(weights)),
                          vs_float32=relative(out, exact))

      def call(run=run, weights=weights, x=x):
        start = time.perf_counter()
        jax.block_until_ready(run(x, weights))
        return time.perf_counter() - start
      calls[name] = call
    _, samples = interleaved(calls, repeats, f"{label} M={m}")
    for name, seconds in samples.items():
      found[name]["rows"][str(m)] = dict(ms=1e3 * statistics.median(seconds), **errors[name])
  return found


def plot(results: dict, path) -> None:
  rows = results["rows"]
  fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
  for ax, m in zip(axes[0], rows):
    names = list(results["matrices"])
    series = {c: [results["matrices"][n][c]["rows"][str(m)]["ms"]
                  / results["matrices"][n]["float32"]["rows"][str(m)]["ms"] for n in names]
              for c in results["contenders"] if c != "float32"}
    bars(ax, [f"{n} {tuple(results['shapes'][n])}" for n in names], series,
         "time / float32's")
    ax.set_title(f"M = {m}", fontsize=9)
  save_figure(fig, path, f"one product, {results['model']} layer 0: mdjax and qwix "
                         f"({machine_line(results['machine'])})")


def table(results: dict) -> str:
  lines = ["| matrix | M | contender | ms | vs float32 | error vs own value | error vs float32 "
           "| MB packed |", "|---|--:|---|--:|--:|--:|--:|--:|"]
  for n, by in results["matrices"].items():
    for m in results["rows"]:
      base = by["float32"]["rows"][str(m)]["ms"]
      for c, cell in by.items():
        r = cell["rows"][str(m)]
        lines.append(f"| {n} | {m} | {c} | {r['ms']:.3f} | {r['ms'] / base:.2f}x | "
                     f"{r['vs_own_value']:.1e} | {r['vs_float32']:.1e} | "
                     f"{cell['bytes'] / 1e6:.2f} |")
  return "\n".join(lines)


@one_line_errors
def main(argv):
  check_argv(argv)
  import_qwix()
  quick = _QUICK.value
  name = "random-llama-tiny" if quick else _MODEL.value
  rows = [1, 8] if quick else [int(r) for r in _ROWS.value]
  repeats = 3 if quick else _REPEATS.value
  layer = mdjax.load(name, dtype="float32", layer_loop="unrolled").params["layers"][0]
  start = time.perf_counter()
  matrices = {n: bench_matrix(jnp.asarray(layer[n], jnp.float32), rows, repeats, n)
              for n in MATRICES}
  results = dict(model=name, rows=rows, contenders=list(next(iter(matrices.values()))),
                 shapes={n: list(layer[n].shape) for n in MATRICES}, matrices=matrices,
                 machine=machine_info(memory_bandwidth(64)),
                 command="python3 -m experiments.bench.qwix_products " + " ".join(sys.argv[1:]),
                 date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 seconds=time.perf_counter() - start)
  write_results(results, _OUT_DIR.value, "qwix_products", plot, table)


if __name__ == "__main__":
  app.run(main)
