"""The GPU program report: `decode_step` compiled on this CPU for a GPU target, read from
its optimized HLO (`mdjax.hlo_report`): kernels launched, host syncs, bytes copied inside
loops, float32 product precision; per pass at each tokens-per-pass and batch.

    JAX_PLATFORMS=cpu python3 -m experiments.program_report                # h200, random-llama-1b
    JAX_PLATFORMS=cpu python3 -m experiments.program_report --tokens=1,2 --batches=1 \
        --layer_loops=scan,unrolled --target=h100 --out_dir=docs/results/programs

Needs jax's CUDA plugin (requirements-compile-targets.txt). The model is a random llama
(`--model`, by default random-llama-1b: Llama-3.2-1B's shape) in bfloat16, laid out
for each `--layer_loops`, with `--context` cache slots; the attention is what the
target's platform gets by default (`mdjax.models.attention.default_attention`). Writes
`program_report.json` and prints a table. Nothing runs: the report is what the GPU's
compiler made of the program, which `experiments.device_check` times on a real device.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
from absl import app, flags

from mdjax import compile_targets, files, hlo_report, platform
from mdjax.cache import KVCache
from mdjax.models.attention import default_attention
from mdjax.models.layer_loop import with_layer_loop
from mdjax.models.random_init import init_params
from mdjax.models.registry import RANDOM_MODELS
from mdjax.step import decode_step
from mdjax.topology import Topology
from experiments.cli import check_argv, one_line_errors

_TARGET = flags.DEFINE_enum("target", "h200", list(compile_targets.TARGETS), "Device to compile for.")
_MODEL = flags.DEFINE_enum("model", "random-llama-1b", list(RANDOM_MODELS),
                           "The random llama whose shape is compiled.")
_TOKENS = flags.DEFINE_list("tokens", ["1", "2", "16", "64"], "Tokens per pass.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Rows per pass.")
_LAYER_LOOPS = flags.DEFINE_list("layer_loops", ["scan", "unrolled"], "Layer loops to compile.")
_CONTEXT = flags.DEFINE_integer("context", 1024, "Cache slots per row.")
_SEGMENTS = flags.DEFINE_integer("segments", 4, "Segments per row in the topology.")
_OUT_DIR = flags.DEFINE_string("out_dir", "docs/results/programs", "Where the JSON goes.")


def decode_step_counts(target: str, config, *, batch: int, tokens: int, slots: int,
                       segments: int, layer_loop: str) -> hlo_report.Counts:
  """The counts of one `decode_step` pass compiled for `target`."""
  with platform.building_for(compile_targets.get(target).platform):
    params = jax.eval_shape(lambda: with_layer_loop(init_params(config, 0, jnp.bfloat16),
                                                    layer_loop))
    cache = jax.eval_shape(lambda: KVCache.create(config, batch, slots, jnp.bfloat16))
    attention = default_attention()
  ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
  topology = Topology(parent=jax.ShapeDtypeStruct((batch, segments), jnp.int32),
                      fork=jax.ShapeDtypeStruct((batch, segments), jnp.int32))
  compiled = compile_targets.compile_for(decode_step, target, params, cache, ids, ids, ids,
                                         topology, config=config, attention=attention)
  return hlo_report.read(compiled.as_text())


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
  out = pathlib.Path(_OUT_DIR.value) / "program_report.json"
  files.write_text(out, json.dumps(dict(target=_TARGET.value, model=_MODEL.value,
                                        context=_CONTEXT.value, jax=jax.__version__,
                                        decode_step=rows), indent=1) + "\n")
  print(table(rows))
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
