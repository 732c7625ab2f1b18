"""What fits one TPU v5e chip (Colab's v5e-1: 16 GiB of HBM, of which XLA lets a program
use 15.75 GiB): Llama-3-shaped models in bfloat16, int8 and int4 weights, each with a
bfloat16 or int8 KV cache, at a context; per model, weights and cache: whether one row
of the cache fits, and the most rows that do. Read from the compiler's memory analysis
of one `decode_step` pass (one token a row, the layers scanned: the TPU's default)
compiled on this CPU for the v5e target (`mdjax.program_report.compile_decode_step`);
nothing runs and no TPU is needed. A program that does not fit fails to compile
(RESOURCE_EXHAUSTED, with what it needed and what the chip has).

    JAX_PLATFORMS=cpu python3 -m experiments.tpu_fit                     # 4096 slots a row
    JAX_PLATFORMS=cpu python3 -m experiments.tpu_fit --models=llama-3.1-8b --contexts=8192
    JAX_PLATFORMS=cpu python3 -m experiments.tpu_fit --quick --out_dir=/tmp/tpu_fit

The most rows are found with few compiles: rows 1 and 2, a line through their totals
(total = a + b * rows) predicting the most rows within the usable memory, then a compile
at the prediction that fits and one a row above that does not (when the line misses,
a line through the most rows that fit and the fewest refused, by what the refusal
says they needed, predicts again; bisection after two misses, or when a row more
needs no more: then the cap is tried first); rows are capped at `--max_rows`. Writes
`tpu_fit.json` in `--out_dir` after every compile (atomically: a run stopped early
keeps what it measured); results already in that file for other models, weights,
caches or contexts are kept, so that runs add up. Needs libtpu (requirements-compile-targets.txt).
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from mdjax import compile_targets, files, platform, program_report
from mdjax.cache import KVCache
from mdjax.models.config import ModelConfig, RopeScaling
from mdjax.models.quantized import quantize_params
from mdjax.models.random_init import init_params
from experiments.cli import check_argv, one_line_errors
from experiments.fit_search import largest_rows, refusal

GIB = 2**30
TARGET = "v5e"


def llama3(*, vocab=128256, hidden, intermediate, layers, heads, kv_heads=8, head_dim,
           tied, rope_factor) -> ModelConfig:
  return ModelConfig(family="llama", vocab_size=vocab, hidden_size=hidden,
                     intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=500000.0,
                     rope_scaling=RopeScaling(rope_type="llama3", factor=rope_factor),
                     rms_norm_eps=1e-5, max_position_embeddings=131072,
                     tie_word_embeddings=tied)


MODELS = {
    "llama-3.2-1b": llama3(hidden=2048, intermediate=8192, layers=16, heads=32, head_dim=64,
                           tied=True, rope_factor=32.0),
    "llama-3.2-3b": llama3(hidden=3072, intermediate=8192, layers=28, heads=24, head_dim=128,
                           tied=True, rope_factor=32.0),
    "llama-3.1-8b": llama3(hidden=4096, intermediate=14336, layers=32, heads=32, head_dim=128,
                           tied=False, rope_factor=8.0),
    # --quick's: the shape of random-llama-tiny
    "tiny": ModelConfig(family="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        max_position_embeddings=512),
}
WEIGHTS = {"bf16": None, "int8": "int8", "int4": "int4"}  # quantize=
CACHES = {"bf16": "bfloat16", "int8": "int8"}  # kv_dtype=

_MODELS = flags.DEFINE_list("models", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"],
                            f"Model shapes: {', '.join(MODELS)}.")
_FORMATS = flags.DEFINE_list("formats", ["bf16/bf16", "int8/bf16", "int8/int8", "int4/int8"],
                             "weights/cache: weights bf16, int8 or int4; cache bf16 or int8.")
_CONTEXTS = flags.DEFINE_list("contexts", ["4096"], "Cache slots per row.")
_MAX_ROWS = flags.DEFINE_integer("max_rows", 1024, "The most rows tried.")
_USABLE_GIB = flags.DEFINE_float("usable_gib", 15.75, "What the first prediction aims under "
                                 "(GiB); the compiler's own figure from its first refusal "
                                 "replaces it.")
_SEGMENTS = flags.DEFINE_integer("segments", 4, "Segments per row in the topology.")
_OUT_DIR = flags.DEFINE_string("out_dir", "docs/results/programs/tpu_fit",
                               "Where tpu_fit.json goes.")
_QUICK = flags.DEFINE_boolean("quick", False, "The tiny shape at 128 slots, rows 1 and 2 (a "
                              "smoke test): overrides --models, --contexts and --max_rows.")

def cache_bytes(config, rows: int, slots: int, kv_dtype: str) -> int:
  """What a TPU holds for a cache of `rows` rows of `slots` slots (K, V, int8's scales,
  positions, segments)."""
  with platform.building_for("tpu"):
    cache = jax.eval_shape(lambda: KVCache.create(config, rows, slots, kv_dtype))
  return program_report.held_bytes(cache)


def weight_bytes(config, quantize: str | None) -> int:
  """What a TPU holds for the weights (bfloat16, or quantized by `quantize`)."""
  def weights():
    params = init_params(config, 0, jnp.bfloat16)
    return params if quantize is None else quantize_params(params, quantize)

  with platform.building_for("tpu"):
    return program_report.held_bytes(jax.eval_shape(weights))


def libtpu_version() -> str | None:
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


class Run:
  """The results, kept in `--out_dir`/tpu_fit.json, and the usable memory as the
  compiler last told it."""

  def __init__(self, out: pathlib.Path):
    self.out = out
    self.usable = _USABLE_GIB.value * GIB
    self.usable_from = "--usable_gib"
    self.results = {}
    if out.exists():  # other models', formats' or contexts' results stay
      old = json.loads(out.read_text())
      self.results = {key(r): r for r in old.get("results", [])}
      if old.get("usable_from") == "compiler":
        self.usable, self.usable_from = old["usable_bytes"], "compiler"

  def write(self):
    target = compile_targets.get(TARGET)
    files.write_text(self.out, json.dumps(dict(
        target=TARGET, memory_bytes=target.memory_bytes, usable_bytes=self.usable,
        usable_from=self.usable_from, tokens=1, segments=_SEGMENTS.value, layer_loop="scan",
        jax=jax.__version__, libtpu=libtpu_version(),
        models={name: model_fields(MODELS[name]) for name in
                sorted({r["model"] for r in self.results.values()})},
        results=sorted(self.results.values(), key=order)), indent=1) + "\n")

  def measure(self, result: dict, config, rows: int) -> dict:
    """One compile at `rows` rows, recorded among `result`'s points."""
    start = time.perf_counter()
    try:
      compiled, _ = program_report.compile_decode_step(
          TARGET, config, batch=rows, tokens=1, slots=result["context"],
          segments=_SEGMENTS.value, layer_loop="scan", quantize=WEIGHTS[result["weights"]],
          kv_dtype=CACHES[result["cache"]])
      point = dict(rows=rows, fits=True, **program_report.memory(compiled))
    except Exception as e:  # noqa: BLE001 - a refusal is a measurement; anything else is not
      point = refusal(str(e))
      if point is None:
        raise
      point = dict(rows=rows, fits=False, **point)
      if point["available"]:
        self.usable, self.usable_from = point["available"], "compiler"
    point["compile_s"] = round(time.perf_counter() - start, 1)
    result["points"].append(point)
    result["compiles"] = len(result["points"])
    result["compile_s"] = round(sum(p["compile_s"] for p in result["points"]), 1)
    self.write()
    print(f"  {result['model']} {result['weights']}/{result['cache']} "
          f"{result['context']}: {rows} rows "
          f"{'fit' if point['fits'] else 'do not fit'} in "
          f"{gib(point.get('total') or point.get('needed'))} GiB ({point['compile_s']} s)",
          flush=True)
    return point

  def fit(self, name: str, weights: str, cache: str, context: int, max_rows: int) -> dict:
    config = MODELS[name]
    result = dict(model=name, weights=weights, cache=cache, context=context,
                  weight_bytes=weight_bytes(config, WEIGHTS[weights]),
                  cache_bytes_per_row=(cache_bytes(config, 2, context, CACHES[cache]) -
                                       cache_bytes(config, 1, context, CACHES[cache])),
                  max_rows_tried=max_rows, points=[])
    self.results[key(result)] = result
    rows = largest_rows(lambda n: self.measure(result, config, n), usable=lambda: self.usable,
                        max_rows=max_rows)
    points = {p["rows"]: p for p in result["points"]}
    one = points[1]
    result.update(fits_one_row=one["fits"], bytes_one_row=one.get("total") or one.get("needed"),
                  max_rows=rows, capped=rows == max_rows)
    if rows:  # the line through the two largest row counts that fit: bytes fixed and a row
      fitting = sorted(r for r, p in points.items() if p["fits"])
      if len(fitting) > 1:
        r1, r2 = fitting[-2:]
        slope = (points[r2]["total"] - points[r1]["total"]) / (r2 - r1)
        result["line"] = dict(fixed=round(points[r2]["total"] - slope * r2),
                              per_row=round(slope))
      result["bytes_max_rows"] = points[rows]["total"]
    self.write()
    return result


def key(result: dict) -> str:
  return f"{result['model']} {result['weights']}/{result['cache']} {result['context']}"


def order(result: dict):
  names, formats = list(MODELS), ["bf16/bf16", "int8/bf16", "int8/int8", "int4/int8"]
  fmt = f"{result['weights']}/{result['cache']}"
  return (result["context"], names.index(result["model"]) if result["model"] in names else 99,
          formats.index(fmt) if fmt in formats else 99, fmt)


def model_fields(config: ModelConfig) -> dict:
  names = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
           "num_kv_heads", "head_dim", "tie_word_embeddings")
  return dict({n: getattr(config, n) for n in names}, num_params=config.num_params)


def gib(n) -> str:
  return "?" if n is None else f"{n / GIB:.2f}"


def table(results: list[dict]) -> str:
  lines = ["| model | weights | KV cache | context | weights GiB | KV MiB/row | GiB at 1 row "
           "| most rows | GiB there | compiles | s |",
           "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
  for r in sorted(results, key=order):
    if "max_rows" not in r:
      continue
    most = ((f">= {r['max_rows']}" if r["capped"] else str(r["max_rows"])) if r["max_rows"]
            else "0")
    one = gib(r["bytes_one_row"]) + ("" if r["fits_one_row"] else " (no fit)")
    lines.append(f"| {r['model']} | {r['weights']} | {r['cache']} | {r['context']} | "
                 f"{gib(r.get('weight_bytes'))} | {r['cache_bytes_per_row'] / 2**20:.0f} | "
                 f"{one} | {most} | {gib(r.get('bytes_max_rows'))} | {r['compiles']} | "
                 f"{r['compile_s']:.0f} |")
  return "\n".join(lines)


@one_line_errors
def main(argv):
  check_argv(argv)
  models, contexts, max_rows = _MODELS.value, list(map(int, _CONTEXTS.value)), _MAX_ROWS.value
  if _QUICK.value:
    models, contexts, max_rows = ["tiny"], [128], 2
  formats = [tuple(f.split("/")) for f in _FORMATS.value]
  for name in models:
    if name not in MODELS:
      raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
  for weights, cache in formats:
    if weights not in WEIGHTS or cache not in CACHES:
      raise ValueError(f"unknown format {weights}/{cache}: weights {', '.join(WEIGHTS)}; "
                       f"caches {', '.join(CACHES)}")
  run = Run(pathlib.Path(_OUT_DIR.value) / "tpu_fit.json")
  start = time.perf_counter()
  for context in contexts:
    for name in models:
      for weights, cache in formats:
        run.fit(name, weights, cache, context, max_rows)
        print(table([run.results[f"{name} {weights}/{cache} {context}"]]).splitlines()[-1],
              flush=True)
  print(table(list(run.results.values())))
  print(f"usable: {gib(run.usable)} GiB (from {run.usable_from}); "
        f"{time.perf_counter() - start:.0f} s; wrote {run.out}")


if __name__ == "__main__":
  app.run(main)
