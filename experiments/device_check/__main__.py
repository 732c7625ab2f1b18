"""The accelerator check: one script, ready before a GPU is at hand, that runs on it in a
few minutes and writes `device_check_<device kind>.json` and `.png` to `--out_dir`
(default `docs/device/`). How to run it on a bare GPU machine: `docs/device/README.md`.

Sections (`--sections`; each is timed, a failure is recorded with its traceback and the
next one runs; the JSON and the plot are rewritten after every section, atomically, so a
run stopped by a time limit keeps what it measured):

1. `tests`: `pytest -m accelerator` (`tests/test_accelerator.py`) in a subprocess on
   this device: float32 logits and greedy vs transformers, every lossless strategy ==
   greedy and multi_question == sequential in float32 and bfloat16. Counts, and each
   failing test with its message, from pytest's junit XML.
2. `roofline`: `experiments.bench.device`'s greedy cells on one device: per-token time
   and the HBM roofline fraction at each batch of `--batches`.
3. `pass_cost`: the target's pass cost t(n) at each batch of `--pass_batches`, measured
   as `tree_budget="auto"` measures it (`mdjax.strategies.pass_cost.measure`: n tokens
   per row over 256 cached, passes run in one compiled loop, generate's attention on
   this device), and t(n) / t(1): what a draft tree of n tokens costs beside one
   greedy step.
4. `variants`: compile time and decode ms per token of greedy at batch 1 over a prompt of
   each of `--contexts` tokens: the layers scanned vs unrolled (block-sparse attention),
   and the attention block_sparse vs fused vs dense (the platform's layer loop).
5. `branches`: `--questions` questions over one context of `--context_len` tokens:
   `multi_question` vs sequential greedy (one question at a time) vs batching (the
   context duplicated per question); and prompt lookup vs greedy on a copy-heavy prompt
   (a random chunk repeated): tokens per pass and whether the tokens equal greedy's.
6. `heads`: the head strategies on this device (`medusa`, `eagle` with EAGLE and EAGLE-3
   heads), at each batch of `--head_batches`: the tree `tree_budget="auto"` picks (the
   t(n) it measured here, `mdjax.strategies.pass_cost`) and the fixed trees of
   `--head_trees`, each timed against greedy, with whether its tokens equal greedy's
   (and greedy's top-2 gap where a row parts). The heads are random, shaped like the
   shipped SmolLM2 heads of their family (heads, layers, draft vocabulary) and carrying
   their held-out acceptance profile, so `auto` sizes trees as it would for those heads;
   their drafts are rarely accepted, so the speeds measure a step's cost, not a speedup.
   Beside them, at each batch, the mix (`strategy="mixed"`: prompt lookup and the
   EAGLE-3-shaped heads in one tree, `tree_budget="auto"`) on copy-heavy prompts (a
   random chunk repeated, where lookup is accepted), against greedy on the same
   prompts: its tokens, per-source acceptance, and the step cost `auto` predicted
   (expected tokens per pass over expected speedup, in target passes t(1)) against
   the one measured (seconds per mix pass over greedy's seconds per token).
7. `profile`: greedy at batch 1 for `--profile_new_tokens` under `jax.profiler`, kernel
   by kernel (`experiments.bench.step_profile`): each kernel's microseconds per run, the
   bytes it moves and the GB/s it reaches, and the kernel time per step against the wall
   time per step (the rest: the device waiting for launches or the host).

The model: a random llama of `--preset` (`experiments.bench.device.PRESETS`; "1b" on GPU/TPU, "tiny"
on CPU) in `--dtype` (bfloat16 on GPU/TPU), its context stretched to the longest of
`--contexts`. Random weights: the acceptance of prompt lookup measures the machinery, not
a real model's speedup. Flags shared with `experiments.bench.device` (`--preset`, `--dtype`,
`--batches`, `--prompt_len`, `--new_tokens`, `--repeats`, `--questions`, `--seed`,
`--bandwidth_gbps`, `--bandwidth_mib`, `--out_dir`, `--quick`) mean the same here; its
other flags are not used.

    python3 -m experiments.device_check                       # on the GPU: ~5 minutes
    python3 -m experiments.device_check --quick --out_dir=/tmp/check   # CPU smoke test
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import time
import traceback

from absl import app, flags
import jax

from experiments.bench import device as bench_device  # also defines the flags shared with it
from experiments.bench.common import Tree, machine_info
from experiments.cli import one_line_errors
from experiments.device_check import QUICK, Settings, make_model
from experiments.device_check.accelerator_tests import run_tests
from experiments.device_check.costs import run_pass_cost, run_profile, run_roofline
from experiments.device_check.report import write_outputs
from experiments.device_check.strategies import run_branches, run_heads
from experiments.device_check.variants import run_variants
from mdjax.models.layer_loop import default_layer_loop
from mdjax.strategies import pass_cost

SECTIONS = ("tests", "roofline", "pass_cost", "variants", "branches", "heads", "profile")
SECTION_RUNS = dict(roofline=run_roofline, pass_cost=run_pass_cost, variants=run_variants,
                    branches=run_branches, heads=run_heads, profile=run_profile)

FLAGS = flags.FLAGS
FLAGS.set_default("out_dir", "docs/device")
FLAGS.set_default("new_tokens", 16)  # 16 and 1 token share one compiled program (bucket 16)
FLAGS.set_default("repeats", 3)
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), "Which sections to run, in order.")
_TEST_WORKERS = flags.DEFINE_integer("test_workers", 6, "pytest-xdist workers of the tests "
                                     "section (0: none; ignored without pytest-xdist).")
_TEST_TIMEOUT = flags.DEFINE_integer("test_timeout_s", 180, "Time limit of the tests section.")
_TESTS_K = flags.DEFINE_string("tests_k", "", "A pytest -k expression narrowing the tests.")
_PASS_BATCHES = flags.DEFINE_list("pass_batches", ["1", "8"], "Batch sizes of the pass-cost "
                                  "section.")
_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "8192"], "Prompt lengths of the "
                              "layer-loop and attention variants.")
_CONTEXT_LEN = flags.DEFINE_integer("context_len", 1024, "Shared context of the branches.")
_QUESTION_LEN = flags.DEFINE_integer("question_len", 16, "Tokens per question.")
_HEAD_BATCHES = flags.DEFINE_list("head_batches", ["1", "8"], "Batch sizes of the heads section.")
_HEAD_TREES = flags.DEFINE_list("head_trees", ["2x2x4", "6x8x64"], "Fixed trees of the "
                                "heads section beside auto, DEPTHxTOP_KxBUDGET (Medusa: the "
                                "budget alone).")
_PROFILE_NEW_TOKENS = flags.DEFINE_integer("profile_new_tokens", 64, "Tokens per generation "
                                          "in the profile section.")
_PROFILE_RUNS = flags.DEFINE_integer("profile_runs", 3, "Generations traced by the profile section.")
_HEAD_NEW_TOKENS = flags.DEFINE_integer("head_new_tokens", 16, "Tokens per row in the heads "
                                        "section.")


def device_kind() -> str:
  """The device kind as a file-name part: "NVIDIA H200" -> "nvidia-h200"."""
  return re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")


def run_section(name: str, settings: Settings, placed, out_dir: pathlib.Path) -> dict:
  """One section's results with its seconds, or its error and traceback; `placed(loop)`:
  the model on one device, laid out for `loop` (made on first use)."""
  start = time.perf_counter()
  try:
    if name == "tests":
      result = run_tests(settings, out_dir)
    else:
      result = SECTION_RUNS[name](settings, placed)
  except Exception as error:  # recorded; the next section runs
    result = dict(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
  result["seconds"] = time.perf_counter() - start
  return result


def run(settings: Settings, out_dir: pathlib.Path) -> dict:
  """Every section in turn, the outputs rewritten after each."""
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = f"device_check_{device_kind()}"
  config = bench_device.PRESETS[settings.preset]
  results = dict(machine=machine_info({}), settings=dataclasses.asdict(settings),
                 device=dict(platform=jax.default_backend(),
                             device_kind=jax.devices()[0].device_kind,
                             device_count=len(jax.devices())),
                 model=dict(name=f"random-llama-{settings.preset}", num_params=config.num_params,
                            dtype=settings.dtype, layer_loop=default_layer_loop()),
                 sections={})
  raw = functools.cache(lambda: make_model(settings))
  placed = functools.cache(lambda loop: bench_device.on_mesh(raw(), (1, 1), loop))
  for name in settings.sections:
    print(f"device_check: {name} ...", flush=True)
    results["sections"][name] = run_section(name, settings, placed, out_dir)
    print(f"device_check: {name} done in {results['sections'][name]['seconds']:.1f}s"
          + (f" -- {results['sections'][name]['error']}" if "error" in results["sections"][name]
             else ""), flush=True)
    write_outputs(results, out_dir, stem)
  print(f"wrote {out_dir / (stem + '.json')} and {out_dir / (stem + '.png')}")
  return results


def settings_from_flags() -> Settings:
  unknown = sorted(set(_SECTIONS.value) - set(SECTIONS))
  if unknown:
    raise app.UsageError(f"unknown section {unknown[0]!r}; valid: {', '.join(SECTIONS)}")
  accelerator = bench_device.accelerator()
  settings = Settings(
      sections=tuple(_SECTIONS.value), preset=FLAGS.preset or ("1b" if accelerator else "tiny"),
      dtype=FLAGS.dtype or ("bfloat16" if accelerator else "float32"), seed=FLAGS.seed,
      test_workers=_TEST_WORKERS.value, test_timeout_s=_TEST_TIMEOUT.value,
      tests_k=_TESTS_K.value, batches=tuple(int(b) for b in FLAGS.batches),
      prompt_len=FLAGS.prompt_len, new_tokens=FLAGS.new_tokens, repeats=FLAGS.repeats,
      bandwidth_gbps=FLAGS.bandwidth_gbps, bandwidth_mib=FLAGS.bandwidth_mib,
      pass_batches=tuple(int(b) for b in _PASS_BATCHES.value), pass_widths=pass_cost.WIDTHS,
      pass_rounds=pass_cost.ROUNDS, contexts=tuple(int(c) for c in _CONTEXTS.value),
      questions=FLAGS.questions, question_len=_QUESTION_LEN.value,
      context_len=_CONTEXT_LEN.value, head_batches=tuple(int(b) for b in _HEAD_BATCHES.value),
      head_trees=tuple(Tree.parse(text) for text in _HEAD_TREES.value),
      head_new_tokens=_HEAD_NEW_TOKENS.value, profile_new_tokens=_PROFILE_NEW_TOKENS.value,
      profile_runs=_PROFILE_RUNS.value)
  settings = dataclasses.replace(settings, **QUICK) if FLAGS.quick else settings
  if settings.new_tokens < 2:
    raise app.UsageError("--new_tokens must be >= 2 (decode time is measured against 1)")
  return settings


def main(argv):
  del argv
  # The test subprocess's workers share the device with this process: neither may take
  # three quarters of its memory up front (JAX's default), read when the backend starts.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  run(settings_from_flags(), pathlib.Path(FLAGS.out_dir))


if __name__ == "__main__":
  app.run(one_line_errors(main))
