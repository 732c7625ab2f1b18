"""MultiDecode: N questions over one shared context vs the ways to do it without.

For each grid point (N questions, context length, new tokens per answer), on random
prompts with the same weights everywhere:

  (a) shared     mdjax `multi_question`: the context prefilled once, N branches
                 decoded in one pass per token over one cache
  (b) sequential mdjax greedy, one question at a time, the context prefilled each time
  (c) batched    mdjax greedy on N rows of context + question (the context duplicated
                 per row: what batching does)
  (d) hf         transformers `generate` on the same N duplicated rows (PyTorch)

Reported per point: wall seconds (median of interleaved repeats), generated tokens per
second, KV-cache bytes each allocates, the speedups of (a) over (b), (c), (d), and
whether (a), (b), (c) produced the same tokens. Also the step time of (a) and (c) vs
N at a fixed number of generated tokens: (wall(new) - wall(1)) / (new - 1). Both grow
with N (every pass feeds N tokens through the MLP); (a)'s must not grow faster than
(c)'s, i.e. a branch's attention must not read the other branches' tokens.

    python -m experiments.bench.branches [--ns=1,2,4,8,16,32] [--contexts=256,1024] \
        [--new_tokens=16,128] [--model=random-llama] [--quick]

Writes `bench_branches.json` and `bench_branches.png` to `--out_dir`.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import statistics
import tempfile
import time

from absl import app, flags
import numpy as np
import tqdm
import transformers

import mdjax
from experiments.cli import one_line_errors
from experiments.bench.common import (PROBE_MIB, load_pair, machine_info,
                                      machine_line, memory_bandwidth, plt, random_ids, results_dir,
                                      save_figure, set_torch_threads, torch_oracle, write_json,
                                      write_results)


_MODEL = flags.DEFINE_string("model", "random-llama", "Anything `mdjax.load` takes: a random, "
                             "shipped or GGUF model name (smollm2-135m-instruct), a directory.")
_NS = flags.DEFINE_list("ns", ["1", "2", "4", "8", "16", "32"], "Numbers of questions.")
_CONTEXTS = flags.DEFINE_list("contexts", ["256", "1024"], "Context lengths (tokens).")
_NEW_TOKENS = flags.DEFINE_list("new_tokens", ["16", "128"], "New tokens per answer.")
_QUESTION_LEN = flags.DEFINE_integer("question_len", 16, "Tokens per question.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (median).")
_SKIP_SLOW = flags.DEFINE_integer(
    "skip_sequential_above", 16, "Run (b) sequential only for N up to this (it is N calls).")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("branches"), "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: tiny model, N 1-2, short runs.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  model: str
  ns: tuple[int, ...]
  contexts: tuple[int, ...]
  new_tokens: tuple[int, ...]
  question_len: int
  repeats: int
  skip_sequential_above: int
  bandwidth_mib: int = PROBE_MIB  # the array of the bandwidth probe (`common.memory_bandwidth`)


QUICK = dict(model="random-llama-tiny", ns=(1, 2), contexts=(32,), new_tokens=(4,), question_len=4,
             repeats=1, bandwidth_mib=64)


def kv_bytes(model: mdjax.Model, slots: int) -> int:
  """K and V bytes of `slots` cache slots in the model's weight dtype."""
  c = model.config
  itemsize = model.params["embed"].dtype.itemsize
  return 2 * c.num_layers * slots * c.num_kv_heads * c.head_dim * itemsize


def greedy(model, prompts, new_tokens: int, strategy: str = "greedy", **options) -> dict:
  out = mdjax.generate(model, prompts, strategy=strategy, max_new_tokens=new_tokens,
                       eos_token_id=[], **options)
  return dict(seconds=out.stats["wall_s"], sequences=out.sequences,
              kv_bytes=out.stats["kv_cache_bytes"])


def sequential(model, context, questions, new_tokens: int) -> dict:
  runs = [greedy(model, [context + q], new_tokens) for q in questions]
  return dict(seconds=sum(r["seconds"] for r in runs),
              sequences=[r["sequences"][0] for r in runs])


def hf(reference, rows: np.ndarray, new_tokens: int) -> dict:
  torch = torch_oracle()
  ids = torch.from_numpy(rows.astype(np.int64))
  start = time.perf_counter()
  out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
  return dict(seconds=time.perf_counter() - start,
              sequences=out[:, ids.shape[1]:].tolist())


def bench_point(model, reference, n: int, context_len: int, new_tokens: int,
                settings: Settings) -> dict:
  rng = np.random.default_rng(n * 1000 + context_len)
  vocab = model.config.vocab_size
  context = random_ids(rng, vocab, context_len).tolist()
  questions = [random_ids(rng, vocab, settings.question_len).tolist() for _ in range(n)]
  rows = np.asarray([context + q for q in questions])
  contenders = {
      "shared": lambda: greedy(model, [context], new_tokens, "multi_question", questions=questions),
      "shared_1": lambda: greedy(model, [context], 1, "multi_question", questions=questions),
      "batched": lambda: greedy(model, rows, new_tokens),
      "batched_1": lambda: greedy(model, rows, 1),
      "hf": lambda: hf(reference, rows, new_tokens)}
  if n <= settings.skip_sequential_above:
    contenders["sequential"] = lambda: sequential(model, context, questions, new_tokens)
  results = {name: run() for name, run in contenders.items()}  # compile / warm up
  times = {name: [] for name in contenders}
  names = list(contenders)
  for rep in range(settings.repeats):
    for name in names[rep % len(names):] + names[:rep % len(names)]:
      times[name].append(contenders[name]()["seconds"])
  wall = {name: statistics.median(t) for name, t in times.items()}
  tokens = n * new_tokens
  cell = dict(
      wall_s=wall, tokens_per_s={k: tokens / v for k, v in wall.items() if not k.endswith("_1")},
      speedup={k: wall[k] / wall["shared"] for k in ("batched", "hf", "sequential") if k in wall},
      step_ms={k: (wall[k] - wall[f"{k}_1"]) / max(1, new_tokens - 1) * 1e3
               for k in ("shared", "batched")},
      kv_bytes=dict(shared=results["shared"]["kv_bytes"], batched=results["batched"]["kv_bytes"],
                    shared_needed=kv_bytes(model, context_len + n * (settings.question_len
                                                                    + new_tokens))),
      same_tokens={k: results[k]["sequences"] == results["shared"]["sequences"]
                   for k in ("batched", "sequential", "hf") if k in results})
  return cell


def run(settings: Settings, partial: pathlib.Path | None = None) -> dict:
  """Every grid point; after each one the results so far go to `partial` (if given),
  so a long run that is stopped keeps what it measured."""
  with tempfile.TemporaryDirectory() as scratch:
    model, reference = load_pair(settings.model, 0, pathlib.Path(scratch))
  bandwidth = memory_bandwidth(settings.bandwidth_mib)
  results = dict(machine=machine_info(bandwidth), settings=dataclasses.asdict(settings),
                 model=model.description, points=[])
  grid = list(itertools.product(settings.contexts, settings.new_tokens, settings.ns))
  for context_len, new_tokens, n in tqdm.tqdm(grid, desc="grid"):
    cell = bench_point(model, reference, n, context_len, new_tokens, settings)
    results["points"].append(dict(n=n, context=context_len, new_tokens=new_tokens, **cell))
    if partial is not None:
      write_json(partial, results)
  return results


def table(results: dict) -> str:
  lines = ["    N  ctx  new  shared s  vs batched  vs hf  vs sequential  step ms sh/bat  "
           "KV shared/batched"]
  for p in results["points"]:
    s = p["speedup"]
    seq = f"{s['sequential']:.2f}x" if "sequential" in s else "-"
    lines.append(f"{p['n']:>5} {p['context']:>4} {p['new_tokens']:>4}  {p['wall_s']['shared']:8.3f}"
                 f"  {s['batched']:9.2f}x  {s['hf']:5.2f}x  {seq:>13}  {p['step_ms']['shared']:6.2f}/"
                 f"{p['step_ms']['batched']:<6.2f}  "
                 f"{p['kv_bytes']['shared'] / 2**20:.1f}/{p['kv_bytes']['batched'] / 2**20:.1f} MiB")
  return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
  """Left: speedup of the shared cache vs N over each alternative, one line style per
  (context, new tokens). Right: step time vs N of the shared cache (red) beside
  batching's (blue): a pass of N branches should cost what N rows cost, not more."""
  fig, (speed, steps) = plt.subplots(1, 2, figsize=(13, 5))
  settings = results["settings"]
  colors = {"batched": "tab:blue", "hf": "tab:orange", "sequential": "tab:green"}
  styles = ["o-", "s--", "^:", "d-."]
  for (i, (ctx, new)) in enumerate(itertools.product(settings["contexts"], settings["new_tokens"])):
    points = [p for p in results["points"] if p["context"] == ctx and p["new_tokens"] == new]
    for name, color in colors.items():
      xs = [p["n"] for p in points if name in p["speedup"]]
      ys = [p["speedup"][name] for p in points if name in p["speedup"]]
      speed.plot(xs, ys, styles[i % len(styles)], color=color,
                 label=f"vs {name}, ctx {ctx}, new {new}")
    for name in ("shared", "batched"):
      steps.plot([p["n"] for p in points], [p["step_ms"][name] for p in points],
                 styles[i % len(styles)], color=colors.get(name, "tab:red"),
                 label=f"{name}, ctx {ctx}, new {new}")
  speed.axhline(1.0, color="black", lw=0.8)
  for ax in (speed, steps):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N questions")
    ax.legend(fontsize=7)
  speed.set_ylabel("speedup of the shared cache (x)")
  speed.set_yscale("log")
  steps.set_ylabel("ms per decode step of all N branches / rows")
  save_figure(fig, path, f"multi_question over one shared cache, {results['model']}\n"
                         f"{machine_line(results['machine'])}")


def main(argv):
  del argv
  transformers.logging.set_verbosity_error()
  settings = Settings(model=_MODEL.value, ns=tuple(int(n) for n in _NS.value),
                      contexts=tuple(int(c) for c in _CONTEXTS.value),
                      new_tokens=tuple(int(t) for t in _NEW_TOKENS.value),
                      question_len=_QUESTION_LEN.value, repeats=_REPEATS.value,
                      skip_sequential_above=_SKIP_SLOW.value)
  if _QUICK.value:
    settings = dataclasses.replace(settings, **QUICK)
  set_torch_threads(0, _QUICK.value)  # before any work
  out_dir = pathlib.Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  results = run(settings, partial=out_dir / "bench_branches.json")
  write_results(results, out_dir, "bench_branches", plot, table)


if __name__ == "__main__":
  app.run(one_line_errors(main))
