"""What the controls cost: compiles of a sweep, the CPU step, the GPU step's kernels.

    nice python3 -m experiments.bench.controls           # SmolLM2, its shipped heads (minutes)
    python3 -m experiments.bench.controls --quick        # smoke test: a tiny random llama

Three measures, in one run (`mdjax.controls`):

1. **A sweep compiles once.** For each strategy of `--strategies` (sample, eagle and mixed
   by default), `--sweep` values of temperature, then of the repetition penalty, one
   `mdjax.generate` each: how many compiled (`stats["compiled"]`) and the seconds
   compiling took. Before sampling values were data, each value was a compile.
2. **The CPU step with every control on** (repetition, presence and frequency penalties,
   no_repeat_ngram_size 3, a bad word of one and one of two tokens, a logit bias,
   min_new_tokens 1, logprobs) against the same request without any, greedy and sample at
   batch 1 and 8: seconds per token after the first (median of paired repeats).
3. **Kernels per GPU step** with each control alone, from the program compiled for an
   H200 on this CPU (`mdjax.program_report`), greedy at the 1B shape cut to 2 layers (the
   smoke test's: 1, one compile in a few CPU seconds less; a control adds the same kernels):
   the difference to no control is what the control adds to every step.

Writes `bench_controls.json` and `bench_controls.png`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from absl import app, flags
import numpy as np
import tqdm

import mdjax
from experiments.bench.common import (machine_info, machine_line, memory_bandwidth, plt,
                                      results_dir, save_figure, write_results)
from experiments.cli import one_line_errors
from mdjax import chat, compile_targets, platform, program_report
from mdjax.checkpoints.registry import RANDOM_MODELS

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "The model (float32).")
_STRATEGIES = flags.DEFINE_list("strategies", ["sample", "eagle", "mixed"],
                                "Strategies whose sweeps are counted.")
_SWEEP = flags.DEFINE_integer("sweep", 10, "Values per sweep.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens of the step timing.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions (median).")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("controls"), "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: random-llama-tiny, sample's sweeps of "
                           "3 values, greedy's step at batch 2 (8 tokens, one repeat), one "
                           "control's kernels at 1 layer.")

PROMPT = "Write a short story about a lighthouse keeper and a storm."
EVERY_CONTROL = dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2,
                     no_repeat_ngram_size=3, bad_words_ids=[[5], [6, 7]], logit_bias={8: 1.0},
                     min_new_tokens=1, logprobs=True)  # min_new_tokens: the 1-token run's too
ALONE = {"repetition_penalty": dict(repetition_penalty=1.2),
         "presence + frequency": dict(presence_penalty=0.3, frequency_penalty=0.2),
         "no_repeat_ngram_size": dict(no_repeat_ngram_size=3),
         "bad_words_ids": dict(bad_words_ids=[[5], [6, 7]]), "logit_bias": dict(logit_bias={8: 1.0}),
         "min_new_tokens": dict(min_new_tokens=4), "logprobs": dict(logprobs=True),
         "top_logprobs=5": dict(top_logprobs=5)}
SAMPLING = dict(temperature=0.7, top_p=0.95)


@dataclasses.dataclass(frozen=True)
class Settings:
  strategies: tuple[str, ...]
  sweep: int
  new_tokens: int
  repeats: int
  step_strategies: tuple[str, ...]
  batches: tuple[int, ...]
  kernel_controls: tuple[str, ...]
  kernel_layers: int  # of the 1B shape whose GPU program is read


def settings() -> Settings:
  if _QUICK.value:
    return Settings(strategies=("sample",), sweep=3, new_tokens=8, repeats=1,
                    step_strategies=("greedy",), batches=(2,),
                    kernel_controls=("repetition_penalty",), kernel_layers=1)
  return Settings(strategies=tuple(_STRATEGIES.value), sweep=_SWEEP.value,
                  new_tokens=_NEW_TOKENS.value, repeats=_REPEATS.value,
                  step_strategies=("greedy", "sample"), batches=(1, 8),
                  kernel_controls=tuple(ALONE), kernel_layers=2)


def strategy_options(model: mdjax.Model, strategy: str) -> dict:
  """What each swept strategy needs beside the sampling values: heads where it drafts
  from them (the shipped EAGLE head of SmolLM2; random ones for a random model)."""
  if strategy not in ("eagle", "mixed"):
    return {}
  if _QUICK.value:
    raise app.UsageError("--quick sweeps sample only")
  heads = mdjax.load_heads(f"{model.name}-eagle")
  return dict(heads=heads) if strategy == "eagle" else dict(
      heads=heads, prompt_lookup_num_tokens=4, tree_budget=16)


def sweep(model, prompt, strategy: str, values: int) -> dict:
  """Compiles and compile seconds of a temperature sweep, then a repetition penalty one."""
  options = strategy_options(model, strategy)
  out = {}
  for name, series in (("temperature", np.linspace(0.3, 1.2, values)),
                       ("repetition_penalty", np.linspace(1.0, 1.5, values))):
    mdjax.clear_compiled()
    compiled, seconds = 0, 0.0
    for value in tqdm.tqdm(series, desc=f"{strategy} {name}", leave=False):
      values_now = dict(SAMPLING, repetition_penalty=1.1) | {name: float(value)}
      result = mdjax.generate(model, [prompt], strategy=strategy, max_new_tokens=16,
                              **options, **values_now)
      compiled += result.stats["compiled"]
      seconds += result.stats["compile_s"]
    out[name] = dict(values=len(series), compiles=compiled, compile_s=seconds)
  return out


def step_seconds(model, prompt, strategy: str, batch: int, new_tokens: int, repeats: int
                 ) -> tuple[float, float]:
  """Seconds per token after the first (median over paired repeats) without any control
  and with every one, the two interleaved (a busy moment slows both)."""
  rows = [prompt] * batch
  options = dict(SAMPLING) if strategy == "sample" else {}
  def run(tokens, controls):
    return mdjax.generate(model, rows, strategy=strategy, max_new_tokens=tokens, eos_token_id=[],
                          **options, **controls).stats["wall_s"]
  per_token = {"off": [], "on": []}
  for rep in range(repeats + 1):  # the first compiles
    for name, controls in (("off", {}), ("on", EVERY_CONTROL)):
      whole, first = run(new_tokens, controls), run(1, controls)
      if rep:
        per_token[name].append((whole - first) / (new_tokens - 1))
  return statistics.median(per_token["off"]), statistics.median(per_token["on"])


def step_costs(model, prompt, s: Settings) -> list[dict]:
  rows = []
  for strategy in s.step_strategies:
    for batch in s.batches:
      off, on = step_seconds(model, prompt, strategy, batch, s.new_tokens, s.repeats)
      rows.append(dict(strategy=strategy, batch=batch, off_ms=1e3 * off, on_ms=1e3 * on,
                       ratio=on / off))
  return rows


def kernels(s: Settings) -> dict:
  """Kernels per greedy step, compiled for an H200, with no control and each alone."""
  config = dataclasses.replace(RANDOM_MODELS["random-llama-1b"], num_layers=s.kernel_layers)
  with platform.building_for(compile_targets.get("h200").platform):
    model = program_report.abstract_model(config, f"random-llama-1b, {s.kernel_layers} layers")
  def count(options):
    return program_report.generation_counts("h200", model, "greedy", [list(range(3, 67))],
                                            options, max_new_tokens=64)["kernels_per_step"]
  base = count({})
  return dict(none=base, added={name: count(ALONE[name]) - base for name in s.kernel_controls})


def plot(results: dict, path) -> None:
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  rows = results["step"]
  labels = [f"{r['strategy']} b{r['batch']}" for r in rows]
  left.bar(np.arange(len(rows)) - 0.2, [r["off_ms"] for r in rows], 0.4, label="no control")
  left.bar(np.arange(len(rows)) + 0.2, [r["on_ms"] for r in rows], 0.4, label="every control")
  left.set_xticks(np.arange(len(rows)), labels)
  left.set_ylabel("ms per token (CPU)")
  left.legend(fontsize=8)
  added = results["kernels"]["added"]
  right.barh(list(added), list(added.values()))
  right.axvline(3, color="black", lw=0.8, ls="--")
  right.set_xlabel(f"kernels added to a GPU step (none: {results['kernels']['none']})")
  save_figure(fig, path, f"controls, {results['model']} ({machine_line(results['machine'])})")


def table(results: dict) -> str:
  lines = ["| strategy | swept | values | compiles | compile s |", "|---|---|---|---|---|"]
  for strategy, swept in results["sweeps"].items():
    for name, cell in swept.items():
      lines.append(f"| {strategy} | {name} | {cell['values']} | {cell['compiles']} | "
                   f"{cell['compile_s']:.1f} |")
  lines += ["", "| strategy | batch | ms/token, no control | every control | ratio |",
            "|---|---|---|---|---|"]
  lines += [f"| {r['strategy']} | {r['batch']} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | "
            f"{r['ratio']:.3f} |" for r in results["step"]]
  lines += ["", f"| control alone | kernels added to a GPU step (none: "
                f"{results['kernels']['none']}) |", "|---|---|"]
  lines += [f"| {name} | {n} |" for name, n in results["kernels"]["added"].items()]
  return "\n".join(lines)


@one_line_errors
def main(argv):
  del argv
  s = settings()
  if _QUICK.value:  # its layers scanned: one traced and compiled per program, not two
    model = mdjax.load("random-llama-tiny", dtype="float32", layer_loop="scan")
    prompt = list(range(3, 40))
  else:
    model = mdjax.load(_MODEL.value, dtype="float32")
    prompt = chat.chat_ids(model, PROMPT)
  start = time.perf_counter()
  results = dict(model=model.name, settings=dataclasses.asdict(s),
                 sweeps={strategy: sweep(model, prompt, strategy, s.sweep)
                         for strategy in s.strategies},
                 step=step_costs(model, prompt, s), kernels=kernels(s))
  results["machine"] = machine_info(memory_bandwidth(64))
  results["seconds"] = time.perf_counter() - start
  write_results(results, _OUT_DIR.value, "bench_controls", plot, table)


if __name__ == "__main__":
  app.run(main)
