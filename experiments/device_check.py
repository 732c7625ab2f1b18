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
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import time
import traceback
from xml.etree import ElementTree

from absl import app, flags
import jax
import numpy as np

import mdjax
from experiments.bench import device as bench_device  # also defines the flags shared with it
from experiments.bench import step_profile
from experiments.bench.common import (LOOKUP, Tree, auto_choice, divergence_gaps, head_strategy,
                                      machine_info, plt, random_heads, random_ids, random_llama,
                                      run_mdjax, save_figure, shipped_configs, summarize, timed,
                                      tokens_per_pass, write_json)
from experiments.cli import one_line_errors
from mdjax import files
from mdjax.models.attention import ATTENTIONS, default_attention
from mdjax.models.layer_loop import LAYER_LOOPS, default_layer_loop
from mdjax.strategies import pass_cost
from mdjax.strategies.base import ModelFn

REPO = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = ("tests", "roofline", "pass_cost", "variants", "branches", "heads", "profile")
COPY_REPEATS = 4  # the copy-heavy prompt: one random chunk this many times
MIX_HEADS = "eagle3"  # the heads the heads section's mix drafts with beside prompt lookup

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """What to measure (from the flags, or with `QUICK` for the CPU smoke test)."""

  sections: tuple[str, ...]
  preset: str
  dtype: str
  seed: int
  test_workers: int
  test_timeout_s: int
  tests_k: str  # empty: every accelerator test
  batches: tuple[int, ...]  # roofline
  prompt_len: int
  new_tokens: int  # every generation's; >= 2 (decode time is measured against 1)
  repeats: int
  bandwidth_gbps: float  # 0: by device kind
  bandwidth_mib: int
  pass_batches: tuple[int, ...]  # pass cost
  contexts: tuple[int, ...]  # variants
  questions: int  # branches
  question_len: int
  context_len: int
  head_batches: tuple[int, ...]  # heads
  head_trees: tuple[Tree, ...]  # each cut to what its strategy takes
  head_new_tokens: int
  profile_new_tokens: int  # profile
  profile_runs: int


QUICK = dict(preset="tiny", tests_k="float32_greedy", test_workers=0, batches=(1, 4),
             prompt_len=16, new_tokens=8, repeats=1, bandwidth_mib=64, pass_batches=(1,),
             contexts=(64,), questions=2, question_len=4,
             context_len=64, head_batches=(2,), head_trees=(Tree(4, 2, 2),), head_new_tokens=8,
             profile_new_tokens=8, profile_runs=1)


def device_kind() -> str:
  """The device kind as a file-name part: "NVIDIA H200" -> "nvidia-h200"."""
  return re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")


def make_model(settings: Settings) -> mdjax.Model:
  """The random llama of the preset, its context long enough for every prompt, layers
  as a list (`bench_device.on_mesh` places it and lays them out)."""
  config = bench_device.PRESETS[settings.preset]
  longest = max(settings.contexts + (pass_cost.PREFIX + pass_cost.WIDTHS[-1],
                                     settings.context_len))
  config = dataclasses.replace(config, max_position_embeddings=max(
      config.max_position_embeddings, 2 * longest))
  return random_llama(config, settings.seed, settings.dtype, f"random-llama-{settings.preset}")


# --- 1. the GPU test subset -------------------------------------------------------------

def test_command(settings: Settings, junit: pathlib.Path) -> list[str]:
  """pytest on the accelerator tests, with the repository's addopts (2 CPU workers by
  file) replaced: `test_workers` workers by test when pytest-xdist is there."""
  command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
             "-m", "accelerator", f"--junitxml={junit}", "tests/test_accelerator.py"]
  if settings.test_workers and importlib.util.find_spec("xdist"):
    command += ["-n", str(settings.test_workers), "--dist", "load"]
  if settings.tests_k:
    command += ["-k", settings.tests_k]
  return command


def junit_summary(junit: pathlib.Path) -> dict:
  """Counts and every failing or erroring test with its message, from a junit XML."""
  root = ElementTree.parse(junit).getroot()
  suite = root if root.tag == "testsuite" else root.find("testsuite")
  failing = []
  for case in suite.iter("testcase"):
    for problem in list(case.findall("failure")) + list(case.findall("error")):
      failing.append(dict(test=f"{case.get('classname')}::{case.get('name')}", kind=problem.tag,
                          message=(problem.get("message") or "")[:2000]))
  counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
  return dict(counts, passed=counts["tests"] - counts["failures"] - counts["errors"]
              - counts["skipped"], failing=failing)


def run_tests(settings: Settings, out_dir: pathlib.Path) -> dict:
  junit = out_dir / f".device_check_tests.{os.getpid()}.xml"
  command = test_command(settings, junit)
  try:
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          timeout=settings.test_timeout_s,
                          env=dict(os.environ, JAX_PLATFORMS=""))  # the device, not
    #                                          the suite's default of the CPU (conftest)
  except subprocess.TimeoutExpired as timeout:  # its output so far says which tests ran
    output = b"".join(x if isinstance(x, bytes) else x.encode()
                      for x in (timeout.stdout, timeout.stderr) if x)
    raise RuntimeError(f"the tests ran past {settings.test_timeout_s}s; the output's end: "
                       f"{output.decode(errors='replace')[-3000:]}") from None
  try:
    summary = junit_summary(junit)
  finally:
    junit.unlink(missing_ok=True)
  return dict(summary, returncode=proc.returncode, command=" ".join(command[1:]),
              output_tail=(proc.stdout + proc.stderr)[-4000:])


# --- 2. roofline by batch ---------------------------------------------------------------

def run_roofline(settings: Settings, placed) -> dict:
  """`bench_device`'s greedy cells at every batch, on its own settings and device info."""
  model = placed(default_layer_loop())
  bench = bench_device.Settings(
      model="", preset=settings.preset, draft="", dtype=settings.dtype,
      layer_loop=default_layer_loop(), batches=settings.batches, meshes=((1, 1),), questions=0,
      prompt_len=settings.prompt_len, new_tokens=settings.new_tokens, repeats=settings.repeats,
      bandwidth_gbps=settings.bandwidth_gbps, bandwidth_mib=settings.bandwidth_mib,
      seed=settings.seed)
  device = bench_device.device_info(bench)
  rng = np.random.default_rng(settings.seed)
  rows = {b: random_ids(rng, model.config.vocab_size, 1, b, settings.prompt_len)
          for b in settings.batches}  # [1, B, L]
  results = timed({b: functools.partial(run_mdjax, model, r, settings.new_tokens, "greedy")
                   for b, r in rows.items()}, settings.repeats, "roofline")
  return dict(device=device, batches={
      str(b): bench_device.greedy_cell(model, results[b], b, bench, device, 1)
      for b in settings.batches})


# --- 3. the pass cost t(n) --------------------------------------------------------------

def run_pass_cost(settings: Settings, placed) -> dict:
  """t(n) per batch, as `auto` measures it, with generate's attention on this device."""
  model = placed(default_layer_loop())
  target = ModelFn(config=model.config, attention=default_attention())
  batches = {}
  for batch in settings.pass_batches:
    seconds = pass_cost.measure(target, model.params, batch)
    batches[str(batch)] = {str(n): dict(ms=t * 1e3, ratio_to_first=t / seconds[0],
                                        ms_per_token=t * 1e3 / n)
                           for n, t in zip(pass_cost.WIDTHS, seconds)}
  return dict(prefix=pass_cost.PREFIX, attention=target.attention, batches=batches)


# --- 4. layer loop and attention variants -----------------------------------------------

def variant_cells() -> list[tuple[str, str]]:
  """(layer loop, attention): both loops with block-sparse attention, then the other
  attentions with the platform's loop."""
  loop = default_layer_loop()
  return ([(other, "block_sparse") for other in LAYER_LOOPS]
          + [(loop, attention) for attention in ATTENTIONS if attention != "block_sparse"])


def run_variants(settings: Settings, placed) -> dict:
  """Per context and variant: generate's compile seconds (its first call), decode ms
  per token (paired with the one-token cut), and whether its tokens equal the first
  variant's."""
  rng = np.random.default_rng(settings.seed)
  n, vocab = settings.new_tokens, placed(default_layer_loop()).config.vocab_size
  out = {}  # context -> variant -> cell
  for context in settings.contexts:
    prompt = random_ids(rng, vocab, 1, 1, context - n)  # [1, 1, L]
    cells, first = {}, None
    for loop, attention in variant_cells():
      compile_s = mdjax.generate(placed(loop), prompt[0], max_new_tokens=n, eos_token_id=[],
                                 attention=attention).stats["compile_s"]
      run = functools.partial(run_mdjax, placed(loop), prompt, n, "greedy", attention=attention)
      result = timed({"run": run}, settings.repeats, f"{loop} {attention} {context}")["run"]
      first = result["sequences"] if first is None else first
      cells[f"{loop}/{attention}"] = dict(
          compile_s=compile_s, ms_per_token=result["seconds"] / n * 1e3,
          decode_ms_per_token=result["decode_seconds"] / (n - 1) * 1e3,
          same_tokens_as_first=result["sequences"] == first)
    out[str(context)] = cells
  return dict(contexts=out)


# --- 5. branches and prompt lookup ------------------------------------------------------

def run_branches(settings: Settings, placed) -> dict:
  """multi_question vs sequential vs batching (seconds, decode seconds, passes, tokens
  equal to sequential's); prompt lookup vs greedy on a copy-heavy prompt."""
  model = placed(default_layer_loop())
  rng = np.random.default_rng(settings.seed)
  vocab, n = model.config.vocab_size, settings.new_tokens
  context = random_ids(rng, vocab, settings.context_len).tolist()
  questions = random_ids(rng, vocab, settings.questions, settings.question_len).tolist()
  rows = [context + q for q in questions]
  results = timed({
      "multi_question": lambda: run_mdjax(model, np.asarray([[context]]), n, "multi_question",
                                          questions=questions),
      "sequential": lambda: run_mdjax(model, np.asarray(rows)[:, None], n, "greedy"),
      "batching": lambda: run_mdjax(model, np.asarray([rows]), n, "greedy"),
  }, settings.repeats, "branches")
  sequential = results["sequential"]
  branches = {name: dict(seconds=r["seconds"], decode_seconds=r["decode_seconds"],
                         target_passes=r["stats"]["target_passes"],
                         multi_question_speedup=r["seconds"] / results["multi_question"]["seconds"],
                         same_tokens_as_sequential=r["sequences"] == sequential["sequences"])
              for name, r in results.items()}
  chunk = random_ids(rng, vocab, settings.prompt_len // COPY_REPEATS)
  copy = np.tile(chunk, COPY_REPEATS)[None, None]  # [1, 1, prompt_len]
  lookup = timed({
      "greedy": lambda: run_mdjax(model, copy, n, "greedy"),
      "prompt_lookup": lambda: run_mdjax(model, copy, n, "prompt_lookup", **LOOKUP),
  }, settings.repeats, "prompt lookup")
  cell = summarize(lookup["prompt_lookup"], lookup["greedy"], n, 1)
  cell["tokens_per_pass"] = tokens_per_pass(lookup["prompt_lookup"], n, 1)
  return dict(questions=settings.questions, context_len=settings.context_len,
              branches=branches, prompt_lookup=cell)


# --- 6. head strategies: auto's tree and exactness ---------------------------------------

def run_heads(settings: Settings, placed) -> dict:
  """Per batch and family: auto's choice (as `out.stats` says it) and every tree beside
  greedy: speed, passes, tokens equal to greedy's (greedy's top-2 gaps where rows part)."""
  model = placed(default_layer_loop())
  n, vocab = settings.head_new_tokens, model.config.vocab_size
  shipped = shipped_configs()
  heads = {family: random_heads(model, family, settings.seed) for family in shipped}
  rng = np.random.default_rng(settings.seed)
  out = {}
  for batch in settings.head_batches:
    rows = random_ids(rng, vocab, 1, batch, settings.prompt_len)  # [1, B, L]
    contenders = {"greedy": functools.partial(run_mdjax, model, rows, n, "greedy")}
    for family, h in heads.items():
      strategy = head_strategy(family)
      trees = {"auto": {}} | {tree.label: tree.options() for tree in
                              (t.for_strategy(strategy) for t in settings.head_trees)}
      for label, options in trees.items():
        contenders[f"{family}@{label}"] = functools.partial(
            run_mdjax, model, rows, n, strategy, heads=h, **options)
    results = timed(contenders, settings.repeats, f"heads batch {batch}")
    greedy = results.pop("greedy")
    cells = {}
    for name, result in results.items():
      cell = summarize(result, greedy, n, 1)
      cell["tokens_per_pass"] = tokens_per_pass(result, n, 1)
      if cell["tokens"]["matching_tokens"] < cell["tokens"]["total_tokens"]:
        cell["divergence_gaps"] = divergence_gaps(model, rows[0].tolist(), greedy["sequences"],
                                                  result["sequences"])
      family, label = name.split("@")
      if label == "auto":
        cell["choice"] = auto_choice(model, rows[0], head_strategy(family), n,
                                     heads=heads[family])
      cells[name] = cell
    mixed = MIX_HEADS if MIX_HEADS in heads else next(iter(heads))
    out[str(batch)] = dict(greedy_ms_per_token=greedy["seconds"] / n * 1e3, contenders=cells,
                           mix=run_mix(model, heads[mixed], batch, settings, rng) | {
                               "heads": mixed})
  return dict(new_tokens=n, prompt_len=settings.prompt_len,
              heads={family: dict(mimics=shipped[family][0], num_heads=h.config.num_heads,
                                  draft_vocab_size=h.config.draft_vocab_size,
                                  target_layers=list(h.config.target_layers))
                     for family, h in heads.items()}, batches=out)


def copy_rows(rng: np.random.Generator, vocab: int, batch: int, length: int) -> np.ndarray:
  """[1, batch, length] prompts that copy: per row, a random chunk `COPY_REPEATS` times."""
  chunks = random_ids(rng, vocab, batch, length // COPY_REPEATS)  # [batch, length / repeats]
  return np.tile(chunks, COPY_REPEATS)[None]


def run_mix(model: mdjax.Model, heads: mdjax.Heads, batch: int, settings: Settings,
            rng: np.random.Generator) -> dict:
  """The mix (prompt lookup + `heads`, `tree_budget="auto"`) against greedy on copy-heavy
  prompts: `summarize`'s cell, tokens per pass, tokens drafted and accepted per source,
  auto's choice, and its predicted step cost beside the measured one (in t(1))."""
  n = settings.head_new_tokens
  rows = copy_rows(rng, model.config.vocab_size, batch, settings.prompt_len)
  results = timed({"greedy": functools.partial(run_mdjax, model, rows, n, "greedy"),
                   "mixed": functools.partial(run_mdjax, model, rows, n, "mixed", heads=heads,
                                              **LOOKUP)},
                  settings.repeats, f"mix batch {batch}")
  mix, greedy = results["mixed"], results["greedy"]
  cell = summarize(mix, greedy, n, 1)
  cell["tokens_per_pass"] = tokens_per_pass(mix, n, 1)
  cell["sources"] = {k: v for k, v in mix["stats"].items() if k.startswith(("drafted_",
                                                                             "accepted_"))}
  choice = mix["choices"][0] if mix["choices"] else {}
  cell["choice"] = choice
  if "expected_speedup" in choice:  # plain decoding chosen: predicted 1
    passes = mix["stats"]["target_passes"] + 1  # the prefill counted as one
    cell["step_cost"] = dict(
        predicted=choice["expected_tokens_per_pass"] / choice["expected_speedup"],
        measured=(mix["seconds"] / passes) / (greedy["seconds"] / n))
  return cell


# --- running, writing, drawing -----------------------------------------------------------

# --- 7. one greedy step, kernel by kernel -------------------------------------------------

def run_profile(settings: Settings, placed) -> dict:
  """`step_profile.profile_greedy` at batch 1 over a prompt of `prompt_len` tokens."""
  model = placed(default_layer_loop())
  prompt = random_ids(np.random.default_rng(settings.seed), model.config.vocab_size, 1,
                      settings.prompt_len)
  bandwidth = settings.bandwidth_gbps or (bench_device.datasheet_bandwidth(
      jax.devices()[0].device_kind) or 0.0)
  return step_profile.profile_greedy(model, prompt, settings.profile_new_tokens,
                                     settings.profile_runs, bandwidth)


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


SECTION_RUNS = dict(roofline=run_roofline, pass_cost=run_pass_cost, variants=run_variants,
                    branches=run_branches, heads=run_heads, profile=run_profile)


def panel_error(ax, section: dict | None, title: str) -> bool:
  """Writes why a section has no numbers into its panel; True when it has none."""
  if section is not None and "error" not in section:
    return False
  ax.text(0.5, 0.5, "not run" if section is None else section["error"][:120], ha="center",
          va="center", wrap=True, fontsize=8)
  ax.set_title(title, fontsize=9)
  ax.set_axis_off()
  return True


def plot_roofline(ax, section) -> None:
  if panel_error(ax, section, "roofline"):
    return
  batches = list(section["batches"])
  ax.plot([int(b) for b in batches],
          [section["batches"][b]["roofline_fraction"] for b in batches], "o-")
  ax.set_xscale("log", base=2)
  ax.set_xticks([int(b) for b in batches], batches)
  ax.axhline(1, color="black", lw=0.8)
  ax.set_xlabel("batch")
  ax.set_ylabel("roofline time / measured decode step")
  ax.set_title("greedy: fraction of the HBM roofline", fontsize=9)


def plot_pass_cost(ax, section) -> None:
  if panel_error(ax, section, "pass cost"):
    return
  for batch, cells in section["batches"].items():
    ax.plot([int(n) for n in cells], [cell["ratio_to_first"] for cell in cells.values()], "o-",
            label=f"batch {batch} (t(1) = {cells['1']['ms']:.2f} ms)")
  ax.set_xscale("log", base=2)
  ax.legend(fontsize=7)
  ax.set_xlabel(f"tokens per row per pass (after {section['prefix']} cached)")
  ax.set_ylabel("t(n) / t(1)")
  ax.set_title("the target's pass cost", fontsize=9)


def plot_variants(ax, section) -> None:
  if panel_error(ax, section, "variants"):
    return
  section = section["contexts"]
  names = list(next(iter(section.values())))
  width = 0.8 / len(section)
  for i, (context, cells) in enumerate(section.items()):
    ax.bar(np.arange(len(names)) + i * width, [cells[v]["decode_ms_per_token"] for v in names],
           width, label=f"context {context}")
  ax.set_xticks(np.arange(len(names)) + width * (len(section) - 1) / 2,
                [v + "\n" + ", ".join(f"{c[v]['compile_s']:.1f}s" for c in section.values())
                 for v in names], fontsize=7)
  ax.set_ylabel("greedy decode ms per token")
  ax.set_title("layer loop / attention (under each: compile s per context)", fontsize=9)
  ax.legend(fontsize=7)


def plot_branches(ax, section) -> None:
  if panel_error(ax, section, "branches"):
    return
  names = list(section["branches"]) + ["prompt_lookup"]
  base = section["branches"]["sequential"]["seconds"]
  speedups = [base / section["branches"][m]["seconds"] for m in section["branches"]]
  speedups.append(section["prompt_lookup"]["speedup_vs_greedy"])
  ax.bar(names, speedups, color=["tab:blue", "tab:gray", "tab:orange", "tab:green"])
  ax.axhline(1, color="black", lw=0.8)
  ax.set_ylabel("speedup (branches: vs sequential;\nprompt lookup: vs greedy)")
  ax.set_title(f"{section['questions']} questions over {section['context_len']} tokens; "
               "copy-heavy prompt", fontsize=9)


def plot_heads(ax, section) -> None:
  """Each head contender's speed over greedy's per batch; auto's bars hatched."""
  if panel_error(ax, section, "head strategies (random heads)"):
    return
  batches = list(section["batches"])
  names = list(section["batches"][batches[0]]["contenders"]) + ["mix@auto (copy)"]
  width = 0.8 / len(batches)
  for i, batch in enumerate(batches):
    cells = section["batches"][batch]["contenders"] | {
        "mix@auto (copy)": section["batches"][batch]["mix"]}
    bars = ax.bar(np.arange(len(names)) + i * width,
                  [cells[n]["speedup_vs_greedy"] for n in names], width, label=f"batch {batch}")
    for bar, name in zip(bars, names):
      bar.set_hatch("//" if "@auto" in name else "")
  ax.axhline(1, color="gray", lw=0.8)
  ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=45, ha="right",
                fontsize=7)
  ax.set_ylabel("speed vs greedy (random heads: ~no acceptance)")
  ax.set_title("head strategies: auto (hatched) and fixed trees")
  ax.legend(fontsize=8)


def plot_profile(ax, section) -> None:
  if panel_error(ax, section, "profile"):
    return
  top = section["top"][:12][::-1]
  ax.barh(range(len(top)), [100 * k["share"] for k in top])
  ax.set_yticks(range(len(top)), [f"{k['kernel'][:28]} x{k['runs_per_generation'] / section['new_tokens']:.3g}"
                                  for k in top], fontsize=6)
  for y, k in enumerate(top):
    if k["gbps"]:
      ax.text(100 * k["share"], y, f" {k['gbps']:,.0f} GB/s", va="center", fontsize=6)
  ax.set_xlabel("% of kernel time (x: runs per step)")
  ax.set_title(f"greedy, batch 1: {section['kernel_ms_per_step']:.3f} ms of kernels per step "
               f"in {section['wall_ms_per_step']:.3f} ms", fontsize=9)


def plot(results: dict, path: pathlib.Path) -> None:
  fig, axes = plt.subplots(3, 2, figsize=(13, 13))
  sections = results["sections"]
  for ax, (name, draw) in zip(axes.flat, (("roofline", plot_roofline),
                                          ("pass_cost", plot_pass_cost),
                                          ("variants", plot_variants),
                                          ("branches", plot_branches),
                                          ("heads", plot_heads),
                                          ("profile", plot_profile))):
    draw(ax, sections.get(name))
  tests = sections.get("tests")
  tested = ("tests not run" if tests is None else tests.get("error") or
            f"accelerator tests: {tests['passed']} passed, {tests['failures']} failed, "
            f"{tests['errors']} errors")
  model = results["model"]
  save_figure(fig, path, f"device check on {results['device']['device_kind']}: {model['name']} "
              f"({model['num_params'] / 1e6:.3g}M parameters, {model['dtype']})\n{tested}")


def write_outputs(results: dict, out_dir: pathlib.Path, stem: str) -> None:
  """The JSON, then the plot (each atomically); a plot that fails is recorded in the
  JSON rather than ending the run."""
  write_json(out_dir / f"{stem}.json", results)
  results.pop("plot_error", None)
  try:
    with files.atomic_file(out_dir / f"{stem}.png") as partial:
      plot(results, partial)
  except Exception:  # recorded; the numbers are in the JSON
    results["plot_error"] = traceback.format_exc()
    write_json(out_dir / f"{stem}.json", results)


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
      pass_batches=tuple(int(b) for b in _PASS_BATCHES.value), contexts=tuple(int(c) for c in _CONTEXTS.value),
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
