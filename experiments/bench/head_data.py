"""Throughput of the heads' data capture (`mdjax.train.head_data.capture`) by batch size, and of
a teacher-forced pass over the same text, in one run (the machine is shared: the
float32 matmul rate measured beside each number says how busy it was).

    python -m experiments.bench.head_data --batches=64,128,256 --seconds=90

Each batch size answers the built-in prompts (chat template, temperature 0.7, top-k
64, EAGLE-3's aux layers) for `--seconds` after its programs are compiled, and
reports answer and all tokens/s and the padding waste; the teacher-forced pass runs
`forward_causal` with the same aux layers over the answered rows. Writes
`out_dir/bench_head_data.json`; the last line printed is the JSON.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import mdjax
from experiments.bench.common import results_dir, write_json
from experiments.cli import one_line_errors
from mdjax.chat import chat_ids
from mdjax.heads.eagle3 import default_target_layers
from mdjax.models.transformer import forward_causal
from mdjax.prompts import eos_ids
from mdjax.sampling import SamplingParams
from mdjax.train.head_data import capture
from mdjax.train.head_data import prompts as head_prompts

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Anything `mdjax.load` takes.")
_BATCHES = flags.DEFINE_list("batches", ["64", "128", "256"], "Batch sizes.")
_SECONDS = flags.DEFINE_float("seconds", 90, "Timed seconds per batch size (after compiling).")
_TF_BATCH = flags.DEFINE_integer("teacher_forced_batch", 16, "Rows per teacher-forced pass.")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("head_data"), "Where the JSON goes.")


def matmul_gflops() -> float:
  """The machine's float32 matmul rate now (GFLOP/s)."""
  a, w = jnp.ones((1024, 576)), jnp.ones((576, 4608))
  product = jax.jit(jnp.matmul)
  product(a, w).block_until_ready()
  start = time.perf_counter()
  for _ in range(10):
    product(a, w).block_until_ready()
  return 10 * 2 * 1024 * 576 * 4608 / (time.perf_counter() - start) / 1e9


def generation(model, prompts: list[list[int]], batch: int, seconds: float) -> tuple[dict, list]:
  """Capture at `batch`, timed from the first finished row (the programs compiled) for
  `seconds`: the tokens its passes fed and the slots they computed, rows in flight
  included; the rows still in flight then are dropped (a data run's final drain
  happens once)."""
  options = capture.CaptureOptions(config=model.config, eos=eos_ids(model, None),
                                   aux_layers=default_target_layers(model.config.num_layers),
                                   sampling=SamplingParams(temperature=0.7, top_k=64),
                                   max_new_tokens=256)
  stats, rows, marks = capture.CaptureStats(), [], {}

  def keep_going() -> bool:
    if "start" in marks and time.perf_counter() - marks["start"][0] >= seconds:
      marks.setdefault("end", (time.perf_counter(), dataclasses.replace(stats)))
      return False
    return True

  items = ((i, prompts[i % len(prompts)]) for i in itertools.count())
  for row in capture.capture(model, items, options, batch=batch, refill_rows=max(1, batch // 8),
                             max_prompt_tokens=256, seed=0, keep_going=keep_going, stats=stats):
    marks.setdefault("start", (time.perf_counter(), dataclasses.replace(stats)))
    rows.append(row)
    if "end" in marks:  # the rows in flight are not waited for
      break
  (t0, s0), (t1, s1) = marks["start"], marks["end"]
  answer, prompt = s1.answer_tokens - s0.answer_tokens, s1.prompt_tokens - s0.prompt_tokens
  slots = s1.refill_slots + s1.decode_slots - s0.refill_slots - s0.decode_slots
  return {"batch": batch, "seconds": t1 - t0, "answer_tokens": answer, "prompt_tokens": prompt,
          "answer_tokens_per_s": answer / (t1 - t0), "tokens_per_s": (answer + prompt) / (t1 - t0),
          "padding_waste": 1 - (answer + prompt) / slots, "rows_finished": len(rows),
          "mean_answer_tokens": float(np.mean([r.answer_length for r in rows])),
          "matmul_gflops": matmul_gflops()}, rows


def teacher_forced(model, rows: list, batch: int) -> dict:
  """`forward_causal` with aux layers over the rows' tokens, `batch` rows of 256 tokens
  (cut or zero-padded) per pass: tokens/s of the real tokens, and of all the token
  slots computed (what packed rows would give)."""
  aux = default_target_layers(model.config.num_layers)
  run = jax.jit(lambda p, t: forward_causal(p, t, config=model.config, aux_layers=aux))
  tokens = np.zeros((batch, 256), np.int32)
  real, passes = 0, 0
  jax.block_until_ready(run(model.params, jnp.asarray(tokens)))
  start = time.perf_counter()
  for first in range(0, len(rows) - batch + 1, batch):
    tokens[:] = 0
    for i, row in enumerate(rows[first:first + batch]):
      n = min(256, len(row.tokens))
      tokens[i, :n] = row.tokens[:n]
      real += n
    jax.block_until_ready(run(model.params, jnp.asarray(tokens)))
    passes += 1
    if time.perf_counter() - start > 60:
      break
  wall = time.perf_counter() - start
  return {"batch": batch, "passes": passes, "seconds": wall, "tokens_per_s": real / wall,
          "token_slots_per_s": passes * batch * 256 / wall, "matmul_gflops": matmul_gflops()}


@one_line_errors
def main(argv):
  del argv
  model = mdjax.load(_MODEL.value)
  prompts = [chat_ids(model, p) for p in head_prompts.builtin_prompts()]
  results, rows = {"model": _MODEL.value, "generation": []}, []
  for batch in map(int, _BATCHES.value):
    result, rows = generation(model, prompts, batch, _SECONDS.value)
    results["generation"].append(result)
    print(json.dumps(result), flush=True)
  results["teacher_forced"] = teacher_forced(model, rows, _TF_BATCH.value)
  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  write_json(out / "bench_head_data.json", results)
  print(json.dumps(results))


if __name__ == "__main__":
  app.run(main)
