"""The program report: `decode_step` compiled on this CPU for a GPU or TPU target, read
from its optimized HLO (`mdjax.hlo_report`, `mdjax.hlo_products`): kernels launched (a
TPU's ops), host syncs, bytes copied inside loops (the weights' among them), the
compiler's memory analysis and the precision of every float32 product; per pass at each
tokens-per-pass and batch. Then every registered strategy's whole-generation program
(what `mdjax.generate` runs: `mdjax.generate.program`): per step of its token loop,
kernels and host syncs, and the host syncs around that loop (`--strategies`, empty for
none), with each program's memory.

    JAX_PLATFORMS=cpu python3 -m experiments.program_report                # h200, random-llama-1b
    JAX_PLATFORMS=cpu python3 -m experiments.program_report --target=v5e \
        --out_dir=docs/results/programs/v5e                                 # Colab's TPU
    JAX_PLATFORMS=cpu python3 -m experiments.program_report --tokens=1,2 --batches=1 \
        --layer_loops=scan,unrolled --target=h100 --out_dir=docs/results/programs
    JAX_PLATFORMS=cpu python3 -m experiments.program_report --quantize=none,int8,int4 \
        --kv_cache_dtypes=none,int8 --context=8192 --tokens=1 --batches=1,8 \
        --layer_loops=unrolled --strategies= --out_dir=docs/results/programs/quantized

Targets: `mdjax.compile_targets.TARGETS` (h100, h200; v5e, v6e, v5p). Needs jax's CUDA
plugin and libtpu (requirements-compile-targets.txt). The model is a random llama
(`--model`, by default random-llama-1b: Llama-3.2-1B's shape) in bfloat16, laid out
for each `--layer_loops`, with `--context` cache slots; the attention is what the
target's platform gets by default (`mdjax.models.attention.default_attention`). Writes
`program_report.json` and prints a table. Nothing runs: the report is what the GPU's
compiler made of the program, which `experiments.device_check` times on a real device.

The strategies run one prompt of `--prompt_tokens` tokens for `--new_tokens` tokens on
weights that are shapes only: heads shaped like the shipped ones for the model's width
and vocabulary, a draft of SmolLM2-135M's shape (`--draft_layers` of its 30 layers) with
the model's vocabulary (`mdjax.program_report.draft_config`: a draft a user pairs with a 1B
llama, whose passes run the GPU's attention kernel), fixed tree budgets
(`tree_budget="auto"` times passes on real weights).
"""

from __future__ import annotations

import json
import pathlib

import jax
from absl import app, flags

from mdjax import compile_targets, files, platform, strategies
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.hlo_products import LOSSLESS
from mdjax.program_report import (DRAFT_LAYERS, abstract_model, decode_step_report,
                                  generation_counts, strategy_requests)
from experiments.cli import check_argv, one_line_errors

_TARGET = flags.DEFINE_enum("target", "h200", list(compile_targets.TARGETS),
                            "Device to compile for (GPU or TPU).")
_MODEL = flags.DEFINE_enum("model", "random-llama-1b", list(RANDOM_MODELS),
                           "The random llama whose shape is compiled.")
_TOKENS = flags.DEFINE_list("tokens", ["1", "2", "16", "64"], "Tokens per pass.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Rows per pass.")
_LAYER_LOOPS = flags.DEFINE_list("layer_loops", ["scan", "unrolled"], "Layer loops to compile.")
_CONTEXT = flags.DEFINE_integer("context", 1024, "Cache slots per row.")
_SEGMENTS = flags.DEFINE_integer("segments", 4, "Segments per row in the topology.")
_STRATEGIES = flags.DEFINE_list("strategies", list(strategies.registry.STRATEGIES),
                                "Strategies whose whole-generation programs are compiled.")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 64, "Prompt tokens of a request.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "max_new_tokens of a request.")
_DRAFT_LAYERS = flags.DEFINE_integer("draft_layers", DRAFT_LAYERS,
                                     "Layers of the draft (SmolLM2-135M's shape).")
_QUANTIZE = flags.DEFINE_list("quantize", ["none"], "Weights: none (bfloat16), int8, int4.")
_KV_DTYPES = flags.DEFINE_list("kv_cache_dtypes", ["none"], "Caches: none (the weights' "
                               "dtype), bfloat16, int8.")
_OUT_DIR = flags.DEFINE_string("out_dir", "docs/results/programs", "Where the JSON goes.")


def strategy_table(rows: list[dict]) -> str:
  lines = [f"{'strategy':18} {'kernels/step':>12} {'layer passes':>12} {'per layer':>9} "
           f"{'syncs/step':>10} {'syncs around':>12} "
           f"{'steps/check':>11} {'MiB: total':>10} {'temp':>6}  float32 products"]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['strategy']:18} error: {r['error']}")
      continue
    per_layer = r["kernels_per_layer_pass"]
    lines.append(f"{r['strategy']:18} {r['kernels_per_step']:>12} "
                 f"{r['layer_passes_per_step'] or '-':>12} "
                 f"{'-' if per_layer is None else f'{per_layer:.2f}':>9} "
                 f"{r['host_syncs_per_step']:>10} "
                 f"{r['host_syncs_around']:>12} {r['steps_per_check']:>11} "
                 f"{r['memory']['total'] / 2**20:>10.0f} {r['memory']['temp'] / 2**20:>6.1f}  "
                 f"{products_line(r['f32_products'])}")
  return "\n".join(lines)


def table(rows: list[dict]) -> str:
  lines = [f"{'loop':9} {'weights':>7} {'cache':>5} {'MiB':>6} {'read':>6} {'batch':>5} "
           f"{'tokens':>6} {'kernels':>8} {'scalar':>6} {'per layer':>9} {'syncs':>5} "
           f"{'MiB copied':>10} {'in loops':>8} {'of weights':>10} {'on chip':>8} "
           f"{'MiB: args':>9} {'out':>6} {'temp':>6} {'code':>5}  float32 products"]
  for r in rows:
    m = {k: v / 2**20 for k, v in r["memory"].items()}
    lines.append(f"{r['layer_loop']:9} {r['quantize']:>7} {r['kv_cache_dtype']:>5} "
                 f"{r['weight_bytes'] / 2**20:>6.0f} {r['weight_bytes_read'] / 2**20:>6.0f} "
                 f"{r['batch']:>5} {r['tokens']:>6} {r['kernels']:>8} "
                 f"{r['scalar_kernels']:>6} {r['kernels_per_layer']:>9.1f} {r['host_syncs']:>5} "
                 f"{r['copy_bytes'] / 2**20:>10.1f} {r['loop_copy_bytes'] / 2**20:>8.1f} "
                 f"{r['weight_copy_bytes'] / 2**20:>10.1f} "
                 f"{r['loop_copy_bytes_on_chip'] / 2**20:>8.1f} {m['argument']:>9.0f} "
                 f"{m['output']:>6.1f} {m['temp']:>6.1f} {m['generated_code']:>5.1f}  "
                 f"{products_line(r['f32_products'])}")
  return "\n".join(lines)


def products_line(summary: dict) -> str:
  """"12 float32, 97 exact" (an arithmetic that loses precision marked with !)."""
  return ", ".join(f"{n} {a}{'' if a in LOSSLESS else '!'}" for a, n in sorted(summary.items())
                   ) or "none"


def lossy(rows: list[dict]) -> str:
  """The float32 products that lose precision, by jax operation, over all rows (passes
  and strategies)."""
  seen = {}
  for r in rows:
    for p in r.get("f32_products_listed", []):
      if p["loses_precision"]:
        seen[(p["op_name"], p["precision"], p["arithmetic"])] = p["operands"]
  if not seen:
    return "float32 products losing precision: none"
  return "float32 products losing precision:\n" + "\n".join(
      f"  {arithmetic:8} ({precision}, {' x '.join(operands)}) {op}"
      for (op, precision, arithmetic), operands in sorted(seen.items()))


def write(rows: list[dict], generation: list[dict]) -> pathlib.Path:
  """The report so far as `--out_dir`/program_report.json (rewritten after each row, so
  that a long run stopped early keeps what it compiled)."""
  out = pathlib.Path(_OUT_DIR.value) / "program_report.json"
  target = compile_targets.get(_TARGET.value)
  files.write_text(out, json.dumps(dict(target=_TARGET.value, platform=target.platform,
                                        memory_bytes=target.memory_bytes, model=_MODEL.value,
                                        context=_CONTEXT.value, jax=jax.__version__,
                                        decode_step=rows, generation=generation,
                                        prompt_tokens=_PROMPT_TOKENS.value,
                                        new_tokens=_NEW_TOKENS.value,
                                        draft_layers=_DRAFT_LAYERS.value), indent=1) + "\n")
  return out


@one_line_errors
def main(argv):
  check_argv(argv)
  config = RANDOM_MODELS[_MODEL.value]
  rows, generation = [], []
  shapes = [(loop, batch, tokens, quantize, kv) for loop in _LAYER_LOOPS.value
            for batch in map(int, _BATCHES.value) for tokens in map(int, _TOKENS.value)
            for quantize in _QUANTIZE.value for kv in _KV_DTYPES.value]
  for layer_loop, batch, tokens, quantize, kv in shapes:
    report = decode_step_report(_TARGET.value, config, batch=batch, tokens=tokens,
                                slots=_CONTEXT.value, segments=_SEGMENTS.value,
                                layer_loop=layer_loop,
                                quantize=None if quantize == "none" else quantize,
                                kv_dtype=None if kv == "none" else kv)
    rows.append(dict(layer_loop=layer_loop, batch=batch, tokens=tokens, quantize=quantize,
                     kv_cache_dtype=kv, **report))
    write(rows, generation)
    print(table(rows[-1:]).splitlines()[-1], flush=True)
  with platform.building_for(compile_targets.get(_TARGET.value).platform):
    model = abstract_model(config, _MODEL.value)
    requests = strategy_requests(model, _PROMPT_TOKENS.value, _DRAFT_LAYERS.value)
    for name in _STRATEGIES.value:
      try:
        generation.append(generation_counts(_TARGET.value, model, name, *requests[name],
                                            _NEW_TOKENS.value))
      except Exception as e:  # noqa: BLE001 - a strategy that cannot build its program on
        #   weights that are shapes only is a row of the report, not the end of it
        generation.append(dict(strategy=name, error=f"{type(e).__name__}: {e}"))
      write(rows, generation)
      print(strategy_table(generation[-1:]).splitlines()[-1], flush=True)
  out = write(rows, generation)
  print(table(rows))
  print(strategy_table(generation))
  print(lossy(rows + generation))
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
