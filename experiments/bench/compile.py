"""Compile time vs depth, with the layers scanned (`lax.scan`) or unrolled.

    nice python3 -m experiments.bench.compile            # 8, 32 and 80 layers (minutes)
    python3 -m experiments.bench.compile --quick         # smoke test: 1 and 2 tiny layers

Random llamas of each depth at one small width (hidden 256, 4 heads, vocab 1024:
`random-llama` narrowed with `dataclasses.replace`) in both layer layouts
(`mdjax.models.layer_loop`). For each strategy, `mdjax.clear_compiled()` then one
`mdjax.generate`: its `stats["compile_s"]` (tracing, lowering and XLA's compile of the
whole generation), the fastest of `--compile_repeats` runs. `speculative` drafts with
a 2-layer llama of the same width, in the same layout. At the shallowest depth,
greedy decoding's milliseconds per token after the first (median over repeats) in
both layouts. Writes `bench_compile.json` and `bench_compile.png` (compile seconds vs
depth; ms per token). The issue's goal: scanned, the deepest model compiles in at
most 1.5x the time of the shallowest (`deep_to_shallow`).
"""

from __future__ import annotations

import dataclasses
import pathlib

from absl import app, flags
import tqdm

import mdjax
from experiments.cli import one_line_errors
from experiments.bench.common import (DRAFT_TOKENS, machine_info, machine_line,
                                      median_after_first_token, plt, random_llama, results_dir,
                                      save_figure, write_results)
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.models.layer_loop import LAYER_LOOPS, with_layer_loop

_DEPTHS = flags.DEFINE_list("depths", ["8", "32", "80"], "Layer counts (the first is also "
                            "where per-token decode time is measured).")
_STRATEGIES = flags.DEFINE_list("strategies", ["greedy", "multi_question", "speculative", "beam"],
                                "Strategies whose compile time is measured.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Hidden size.")
_HEADS = flags.DEFINE_integer("heads", 4, "Attention heads (and key/value heads).")
_VOCAB = flags.DEFINE_integer("vocab", 1024, "Vocabulary size.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens of the per-token decode timing.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions of the decode (median).")
_COMPILE_REPEATS = flags.DEFINE_integer(
    "compile_repeats", 3, "Compiles of each strategy and model; the fastest is reported (a "
    "loaded machine only ever slows a compile down).")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("compile"), "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: 1 and 2 tiny layers, greedy and "
                           "speculative, 8 tokens, one repeat.")

PROMPT = list(range(3, 35))  # 32 tokens
QUESTIONS = [[40, 41, 42], [43, 44], [45, 46, 47, 48]]
DRAFT_LAYERS = 2
COMPILE_NEW_TOKENS = 8  # the compiled program does not depend on it beyond its bucket
OPTIONS = {"greedy": {}, "multi_question": dict(questions=QUESTIONS),
           "speculative": dict(num_draft_tokens=DRAFT_TOKENS), "beam": dict(num_beams=4)}


@dataclasses.dataclass(frozen=True)
class Settings:
  depths: tuple[int, ...]
  strategies: tuple[str, ...]
  hidden: int
  heads: int
  vocab: int
  new_tokens: int
  repeats: int
  compile_repeats: int


# The smoke test compiles greedy last: the decode timing at the shallowest depth then runs
# the program just compiled, not one compiled again after speculative's `clear_compiled`.
QUICK = dict(depths=(1, 2), strategies=("speculative", "greedy"), hidden=64, heads=4, vocab=256,
             new_tokens=8, repeats=1, compile_repeats=1)


def llama(settings: Settings, layers: int, loop: str, seed: int = 0) -> mdjax.Model:
  """A random llama `layers` deep at the settings' width, laid out for `loop`."""
  config = dataclasses.replace(
      RANDOM_MODELS["random-llama"], vocab_size=settings.vocab, hidden_size=settings.hidden,
      intermediate_size=3 * settings.hidden, num_layers=layers, num_heads=settings.heads,
      num_kv_heads=settings.heads, head_dim=settings.hidden // settings.heads)
  model = random_llama(config, seed, "float32", f"random-llama-{layers}L-{loop}")
  return dataclasses.replace(model, params=with_layer_loop(model.params, loop))


def compile_seconds(model: mdjax.Model, draft: mdjax.Model, strategy: str,
                    repeats: int) -> list[float]:
  """Seconds `generate` spent compiling `strategy` on `model` from empty caches, each
  of `repeats` times."""
  options = dict(OPTIONS[strategy], **({"draft": draft} if strategy == "speculative" else {}))
  seconds = []
  for _ in range(repeats):
    mdjax.clear_compiled()
    seconds.append(mdjax.generate(model, [PROMPT], strategy=strategy,
                                  max_new_tokens=COMPILE_NEW_TOKENS, eos_token_id=[],
                                  **options).stats["compile_s"])
  return seconds


def ms_per_token(model: mdjax.Model, settings: Settings) -> float:
  """Greedy's milliseconds per token after the first (compiled first, then timed)."""
  def wall(tokens):
    return mdjax.generate(model, [PROMPT], max_new_tokens=tokens,
                          eos_token_id=[]).stats["wall_s"]
  wall(settings.new_tokens), wall(1)  # compile, warm up
  whole, first = [], []
  for _ in range(settings.repeats):
    whole.append(wall(settings.new_tokens))
    first.append(wall(1))
  return median_after_first_token(whole, first) / (settings.new_tokens - 1) * 1e3


def run(settings: Settings) -> dict:
  runs = {s: {loop: {} for loop in LAYER_LOOPS} for s in settings.strategies}
  decode = {}
  cells = [(d, loop) for d in settings.depths for loop in LAYER_LOOPS]
  for depth, loop in tqdm.tqdm(cells, desc="depths x loops"):
    model = llama(settings, depth, loop)
    draft = llama(settings, DRAFT_LAYERS, loop, seed=1)
    for strategy in settings.strategies:
      runs[strategy][loop][str(depth)] = compile_seconds(model, draft, strategy,
                                                         settings.compile_repeats)
    if depth == settings.depths[0]:
      decode[loop] = dict(layers=depth, ms_per_token=ms_per_token(model, settings))
  compile_s = {s: {loop: {d: min(seconds) for d, seconds in by_depth.items()}
                   for loop, by_depth in by_loop.items()} for s, by_loop in runs.items()}
  shallow, deep = str(settings.depths[0]), str(settings.depths[-1])
  ratios = {s: {loop: compile_s[s][loop][deep] / compile_s[s][loop][shallow]
                for loop in LAYER_LOOPS} for s in settings.strategies}
  return dict(settings=dataclasses.asdict(settings), machine=machine_info({}),
              compile_s=compile_s, compile_s_runs=runs, deep_to_shallow=ratios, decode=decode,
              decode_scan_over_unrolled=decode["scan"]["ms_per_token"]
              / decode["unrolled"]["ms_per_token"])


def plot(results: dict, path) -> None:
  fig, (compiles, tokens) = plt.subplots(1, 2, figsize=(12, 4.5),
                                         gridspec_kw=dict(width_ratios=[2, 1]))
  depths = results["settings"]["depths"]
  colors = dict(zip(results["settings"]["strategies"], plt.rcParams["axes.prop_cycle"].by_key()
                    ["color"]))
  for strategy, by_loop in results["compile_s"].items():
    for loop, style in (("scan", "o-"), ("unrolled", "s--")):
      compiles.plot(depths, [by_loop[loop][str(d)] for d in depths], style,
                    color=colors[strategy], label=f"{strategy}, {loop}")
  compiles.set_xlabel("layers")
  compiles.set_ylabel("compile seconds (generate's compile_s, fastest run)")
  compiles.set_yscale("log")
  compiles.set_xticks(depths)
  compiles.legend(fontsize=7, ncol=2)
  loops = list(results["decode"])
  tokens.bar(loops, [results["decode"][loop]["ms_per_token"] for loop in loops],
             color=["tab:blue", "tab:orange"])
  tokens.set_ylabel(f"greedy ms per token, {depths[0]} layers")
  s = results["settings"]
  save_figure(fig, path, f"Compile time vs depth, scan vs unrolled layers (hidden {s['hidden']}, "
                         f"{s['heads']} heads, vocab {s['vocab']})\n"
                         f"{machine_line(results['machine'])}")


def table(results: dict) -> str:
  depths = [str(d) for d in results["settings"]["depths"]]
  lines = [f"{'strategy':<16}{'loop':<10}" + "".join(f"{d + ' layers':>12}" for d in depths)
           + f"{'deep/shallow':>14}"]
  for strategy, by_loop in results["compile_s"].items():
    for loop, seconds in by_loop.items():
      lines.append(f"{strategy:<16}{loop:<10}" + "".join(f"{seconds[d]:>11.2f}s" for d in depths)
                   + f"{results['deep_to_shallow'][strategy][loop]:>13.2f}x")
  for loop, cell in results["decode"].items():
    lines.append(f"greedy decode, {cell['layers']} layers, {loop}: "
                 f"{cell['ms_per_token']:.2f} ms per token")
  lines.append(f"scan / unrolled per token: {results['decode_scan_over_unrolled']:.2f}x")
  return "\n".join(lines)


def main(argv):
  del argv
  settings = Settings(depths=tuple(int(d) for d in _DEPTHS.value),
                      strategies=tuple(_STRATEGIES.value), hidden=_HIDDEN.value,
                      heads=_HEADS.value, vocab=_VOCAB.value, new_tokens=_NEW_TOKENS.value,
                      repeats=_REPEATS.value, compile_repeats=_COMPILE_REPEATS.value)
  if _QUICK.value:
    settings = dataclasses.replace(settings, **QUICK)
  unknown = sorted(set(settings.strategies) - set(OPTIONS))
  if unknown:
    raise app.UsageError(f"unknown strategy {unknown[0]!r}; valid: {', '.join(OPTIONS)}")
  write_results(run(settings), pathlib.Path(_OUT_DIR.value), "bench_compile", plot, table)


if __name__ == "__main__":
  app.run(one_line_errors(main))
