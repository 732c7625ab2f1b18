"""The GPU program report: `decode_step` compiled on this CPU for a GPU target, read from
its optimized HLO (`mdjax.hlo_report`): kernels launched, host syncs, bytes copied inside
loops, float32 product precision; per pass at each tokens-per-pass and batch. Then every
registered strategy's whole-generation program (what `mdjax.generate` runs:
`mdjax.generate.program`): per step of its token loop, kernels and host syncs, and the
host syncs around that loop (`--strategies`, empty for none).

    JAX_PLATFORMS=cpu python3 -m experiments.program_report                # h200, random-llama-1b
    JAX_PLATFORMS=cpu python3 -m experiments.program_report --tokens=1,2 --batches=1 \
        --layer_loops=scan,unrolled --target=h100 --out_dir=docs/results/programs

Needs jax's CUDA plugin (requirements-compile-targets.txt). The model is a random llama
(`--model`, by default random-llama-1b: Llama-3.2-1B's shape) in bfloat16, laid out
for each `--layer_loops`, with `--context` cache slots; the attention is what the
target's platform gets by default (`mdjax.models.attention.default_attention`). Writes
`program_report.json` and prints a table. Nothing runs: the report is what the GPU's
compiler made of the program, which `experiments.device_check` times on a real device.

The strategies run one prompt of `--prompt_tokens` tokens for `--new_tokens` tokens on
weights that are shapes only: heads shaped like the shipped ones for the model's width
and vocabulary, a draft of random-llama-tiny's shape with the model's vocabulary, fixed
tree budgets (`tree_budget="auto"` times passes on real weights).
"""

from __future__ import annotations

import json
import pathlib

import jax
from absl import app, flags

from mdjax import compile_targets, files, platform, strategies
from mdjax.models.registry import RANDOM_MODELS
from mdjax.program_report import (abstract_model, decode_step_counts, generation_counts,
                                  strategy_requests)
from experiments.cli import check_argv, one_line_errors

_TARGET = flags.DEFINE_enum("target", "h200", list(compile_targets.TARGETS),
                            "Device to compile for.")
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
_OUT_DIR = flags.DEFINE_string("out_dir", "docs/results/programs", "Where the JSON goes.")


def strategy_table(rows: list[dict]) -> str:
  lines = [f"{'strategy':18} {'kernels/step':>12} {'syncs/step':>10} {'syncs around':>12} "
           f"{'steps/check':>11}"]
  for r in rows:
    lines.append(f"{r['strategy']:18} {r['kernels_per_step']:>12} {r['host_syncs_per_step']:>10} "
                 f"{r['host_syncs_around']:>12} {r['steps_per_check']:>11}")
  return "\n".join(lines)


def table(rows: list[dict]) -> str:
  lines = [f"{'loop':9} {'batch':>5} {'tokens':>6} {'kernels':>8} {'per layer':>9} "
           f"{'syncs':>5} {'MiB copied in loops':>20}"]
  for r in rows:
    lines.append(f"{r['layer_loop']:9} {r['batch']:>5} {r['tokens']:>6} {r['kernels']:>8} "
                 f"{r['kernels_per_layer']:>9.1f} {r['host_syncs']:>5} "
                 f"{r['loop_copy_bytes'] / 2**20:>20.1f}")
  return "\n".join(lines)


@one_line_errors
def main(argv):
  check_argv(argv)
  config = RANDOM_MODELS[_MODEL.value]
  rows = []
  for layer_loop in _LAYER_LOOPS.value:
    for batch in map(int, _BATCHES.value):
      for tokens in map(int, _TOKENS.value):
        counts = decode_step_counts(_TARGET.value, config, batch=batch, tokens=tokens,
                                    slots=_CONTEXT.value, segments=_SEGMENTS.value,
                                    layer_loop=layer_loop)
        rows.append(dict(layer_loop=layer_loop, batch=batch, tokens=tokens,
                         kernels_per_layer=counts.kernels / config.num_layers,
                         **counts.to_json()))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
  generation = []
  with platform.building_for(compile_targets.get(_TARGET.value).platform):
    model = abstract_model(config, _MODEL.value)
    requests = strategy_requests(model, _PROMPT_TOKENS.value)
    for name in _STRATEGIES.value:
      generation.append(generation_counts(_TARGET.value, model, name, *requests[name],
                                          _NEW_TOKENS.value))
      print(strategy_table(generation[-1:]).splitlines()[-1], flush=True)
  out = pathlib.Path(_OUT_DIR.value) / "program_report.json"
  files.write_text(out, json.dumps(dict(target=_TARGET.value, model=_MODEL.value,
                                        context=_CONTEXT.value, jax=jax.__version__,
                                        decode_step=rows, generation=generation,
                                        prompt_tokens=_PROMPT_TOKENS.value,
                                        new_tokens=_NEW_TOKENS.value), indent=1) + "\n")
  print(table(rows))
  print(strategy_table(generation))
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
