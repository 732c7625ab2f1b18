"""Head strategies vs mdjax greedy and prompt lookup, per task kind, with `tree_budget="auto"`
beside a sweep of fixed trees.

    python3 -m experiments.bench.heads                 # smollm2-135m-instruct, its shipped heads
    python3 -m experiments.bench.heads --questions=mine.jsonl --batches=1 --per_kind=1
    python3 -m experiments.bench.heads --quick         # smoke test: a random model, random heads

The prompts are held out from every head's training: `experiments/bench/data/head_questions.jsonl`
(two questions for each of 13 task kinds, written for this benchmark in plain language, not
from `mdjax.train.head_data.prompts`' templates nor the self-instruct seeds), or a user's file of
JSON lines `{"category": ..., "prompt": ...}` (`--questions`), each prompt one user turn of
the model's chat template. At T = 0, each row generating `--new_tokens` tokens with no early
stop, at every batch size of `--batches`:

* the contenders: mdjax greedy (the baseline), `prompt_lookup` (`common.LOOKUP`), and the
  head strategies, each with the tree `auto` picks: `medusa` (Medusa heads), `eagle` (EAGLE-1
  heads) and `eagle3` (EAGLE-3 heads, decoded by the strategy the registry names for them,
  `eagle`). A heads flag set to '' or naming heads
  that do not load (or do not fit the model, or are of another family) leaves that strategy
  out, with a printed note;
* the sweep: every head strategy again with each fixed tree, `medusa@M` for the budgets M
  of `--budgets`, `eagle@DxKxM` and `eagle3@DxKxM` for the (depth, top-k, budget) shapes
  of `--eagle_trees`;
* every contender's tokens compared with greedy's (all are lossless at T = 0): a mismatch
  is listed under `mismatches` in the JSON and printed under the table, with the gap
  between greedy's top-2 logits where each row parted (`divergence_gaps`): in bfloat16
  two batch shapes round their sums apart, so rows may part at a near-tie.

At batch 1 each prompt runs alone, so its numbers are per task kind (and overall, summed);
at a larger batch the prompts run in groups of that many rows in file order, mixing kinds
as a server's batch would, so only overall numbers exist there. Each contender is warmed
up (compiled) once per slice of prompts, then timed `--repeats` times, interleaved, by
median (`common.timed`); speedups are greedy's seconds over the contender's in the same
run. Tokens per target pass count the prefill as a pass (greedy's is 1). With every default
the run takes hours on a 2-core CPU (twenty contenders, each compiled per prompt-length
bucket and batch size): `--per_kind=1`, `--repeats=1` and shorter sweeps cut it down.

Writes `bench_heads.json` and `bench_heads.png` into `--out_dir` and prints a table. The
JSON holds, per batch (`batches["1"]`): `kinds` (batch 1 only: per task kind, per
contender, a cell as `common.summarize` plus `tokens_per_pass`, `acceptance_at` and
`identical_to_greedy`), `overall` (the same, over every prompt), `sweep` (per head strategy,
its fixed-tree contenders and their budgets) and `auto` (per head strategy: the tree it
chose, from `out.stats`, its measured speedup and tokens per pass, the best fixed tree's,
and whether auto is within 5% of the best fixed tree and at most 5% slower than greedy,
issue 40's goal). The PNG: speedup and tokens per pass per task kind at batch 1, speedup vs
tree budget with auto's choice marked, and the overall speedup at every batch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import pathlib

from absl import app, flags
import numpy as np

import mdjax
from experiments.cli import one_line_errors
from experiments.bench.common import (LOOKUP, PROBE_MIB, QUESTIONS, RATE_STATS,
                                      SUMMED_STATS, Prompt, Tree, auto_choice, bars,
                                      divergence_gaps, groups_of, head_strategy, machine_info,
                                      machine_line, memory_bandwidth, mismatch_line, plt,
                                      random_heads, random_ids, read_questions, results_dir,
                                      run_mdjax, save_figure, selected, summarize,
                                      takes_tree_shape, timed, tokens_per_pass, write_results)
from mdjax import chat
from mdjax.errors import MdjaxError, check_count

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Model (name, directory, .gguf).")
_MEDUSA = flags.DEFINE_string("medusa", "smollm2-135m-instruct-medusa",
                              "Medusa heads ('' to leave medusa out).")
_EAGLE = flags.DEFINE_string("eagle", "smollm2-135m-instruct-eagle",
                             "EAGLE-1 heads ('' to leave eagle out).")
_EAGLE3 = flags.DEFINE_string("eagle3", "smollm2-135m-instruct-eagle3",
                              "EAGLE-3 heads ('' to leave eagle3 out).")
HEADS = {"medusa": _MEDUSA, "eagle": _EAGLE, "eagle3": _EAGLE3}  # family -> its heads flag
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Weights of the model and its heads (default: the platform's, "
                           "float32 on CPU).")
_QUESTIONS = flags.DEFINE_string("questions", str(QUESTIONS),
                                 'JSON lines {"category": ..., "prompt": ...}.')
_PER_KIND = flags.DEFINE_integer("per_kind", 0, "Prompts of each task kind (0: all).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
_BUDGETS = flags.DEFINE_list("budgets", ["2", "4", "8", "16", "32"],
                             "Fixed Medusa tree budgets (nodes) swept at every batch size.")
_EAGLE_TREES = flags.DEFINE_list("eagle_trees", ["2x2x2", "3x2x4", "3x3x8", "4x4x16", "5x4x32"],
                                 "Fixed EAGLE trees DEPTHxTOP_KxBUDGET swept at every batch size.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "Generated tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions of every contender (median).")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("heads"), "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False,
                           "Smoke test: random-llama-tiny, random heads of the three families, "
                           "1 random prompt of each of 2 kinds, 8 tokens, 1 repeat.")

MIXED = "mixed"  # the one slice of a batch > 1: its groups mix the kinds
TOLERANCE = 0.95  # issue 40's goal: auto within 5% of the best fixed tree and of greedy
QUICK_PROMPT_LEN = 24
LINESTYLES = ("-", "--", ":", "-.")  # of the batch sizes, in turn, in the budget plot


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  batches: tuple[int, ...]
  budgets: tuple[int, ...]
  eagle_trees: tuple[str, ...]
  per_kind: int
  kinds: int  # the first `kinds` task kinds of the questions (0: all)
  new_tokens: int
  repeats: int
  bandwidth_mib: int = PROBE_MIB  # the array of the bandwidth probe (`common.memory_bandwidth`)


# The smoke test's fixed trees are the ones `auto` picks for its random heads at batch 1
# under the test suite's pinned pass cost (MDJAX_PASS_COST, tests/conftest.py): a Medusa
# tree of 63 nodes, an EAGLE tree of depth 1 and top-8. A fixed contender then runs the
# program its auto contender compiled (batch 1 and, for Medusa, batch 2): four compiles
# fewer of its sixteen. Where auto picks otherwise, each compiles its own: slower, as valid.
QUICK = dict(batches=(1, 2), budgets=(63,), eagle_trees=("1x8x8",), per_kind=1, kinds=2,
             new_tokens=8, repeats=1, bandwidth_mib=64)


@dataclasses.dataclass(frozen=True)
class HeadLine:
  """A head strategy as the benchmark names it: `name` (its heads' family; its auto
  contender; its fixed trees are `name@label`), the `strategy` that decodes its `heads`
  (`common.head_strategy`) and its `trees`."""

  name: str
  strategy: str
  heads: mdjax.Heads
  trees: tuple[Tree, ...]

  def contenders(self) -> dict[str, tuple[str, dict]]:
    """Contender name -> (strategy, options): auto first, then the fixed trees."""
    runs = {self.name: (self.strategy, dict(heads=self.heads))}
    for tree in self.trees:
      runs[f"{self.name}@{tree.label}"] = (self.strategy, dict(heads=self.heads, **tree.options()))
    return runs


def load_line(family: str, heads_name: str, model: mdjax.Model,
              settings: Settings) -> HeadLine | None:
  """The head strategy of `family` on `heads_name`, or None (with a printed note) when
  the flag is '' or the heads do not load, do not fit `model` or are not of `family`."""
  if not heads_name:
    print(f"note: {family} left out (no heads given)")
    return None
  try:
    heads = mdjax.load_heads(heads_name, dtype=model.params["embed"].dtype)
    heads.check_model(model.config)
  except MdjaxError as e:
    print(f"note: {family} left out: {e}")
    return None
  if heads.config.family != family:
    print(f"note: {family} left out: {heads_name!r} are {heads.config.family} heads, not {family}")
    return None
  return head_line(family, heads, settings)


def head_line(family: str, heads: mdjax.Heads, settings: Settings) -> HeadLine:
  """`heads` of `family` on the strategy that decodes them, with the swept trees it
  takes: EAGLE's shapes (`--eagle_trees`) where it takes a shape, else Medusa's budgets."""
  strategy = head_strategy(family)
  trees = (tuple(Tree.parse(text) for text in settings.eagle_trees)
           if takes_tree_shape(strategy) else tuple(Tree(budget) for budget in settings.budgets))
  return HeadLine(family, strategy, heads, trees)


def setup(settings: Settings) -> tuple[mdjax.Model, list[HeadLine], list[Prompt], dict]:
  """The model, its head strategies, the prompts and what they were (for the JSON)."""
  questions = selected(read_questions(_QUESTIONS.value), settings.kinds, settings.per_kind)
  if _QUICK.value:  # random-llama-tiny has no tokenizer: random prompts, labelled by kind
    # its layers scanned: one traced and compiled per program, not two (scan gives the
    # unrolled loop's tokens for every strategy, tests/test_layer_loop.py)
    model = mdjax.load("random-llama-tiny", layer_loop="scan")
    rng = np.random.default_rng(0)
    prompts = [Prompt(kind, random_ids(rng, model.config.vocab_size, QUICK_PROMPT_LEN).tolist())
               for kind, _ in questions]
    lines = [head_line(family, random_heads(model, family), settings) for family in HEADS]
    return model, lines, prompts, dict(questions="random ids")
  model = mdjax.load(_MODEL.value, dtype=_DTYPE.value)
  lines = [load_line(family, flag.value, model, settings) for family, flag in HEADS.items()]
  prompts = [Prompt(kind, chat.chat_ids(model, text)) for kind, text in questions]
  return model, [line for line in lines if line], prompts, dict(questions=_QUESTIONS.value)


def slices(prompts: list[Prompt], batch: int) -> dict[str, list[list[list[int]]]]:
  """The groups each timed call runs: at batch 1 one slice per task kind (each prompt
  a group of its own); at a larger batch one slice, `MIXED`, of every prompt."""
  if batch > 1:
    return {MIXED: groups_of([p.ids for p in prompts], batch)}
  kinds: dict[str, list] = {}
  for prompt in prompts:
    kinds.setdefault(prompt.kind, []).append([prompt.ids])
  return kinds


def head_cell(result: dict, greedy: dict, steps: int, groups: int) -> dict:
  """`summarize`, plus tokens per target pass of a row (the prefill counts as one:
  greedy's is 1), the acceptance per depth of the tree strategies, and whether the
  tokens are greedy's."""
  cell = summarize(result, greedy, steps, groups)
  stats = result["stats"]
  cell["tokens_per_pass"] = tokens_per_pass(result, steps, groups)
  if "accepted_at" in stats:
    cell["acceptance_at"] = (np.asarray(stats["accepted_at"])
                             / np.maximum(stats["drafted_at"], 1)).tolist()
  cell["identical_to_greedy"] = cell["tokens"]["matching_tokens"] == cell["tokens"]["total_tokens"]
  return cell


def merged(parts: list[tuple[dict, int]]) -> dict:
  """(result, groups) of several slices as one result over all their groups: seconds
  and pass counts summed, rates averaged over the groups, the sequences in turn."""
  results, weights = [r for r, _ in parts], [g for _, g in parts]
  stats = results[0]["stats"]
  summed = {k: np.sum([r["stats"][k] for r in results], axis=0).tolist()
            for k in SUMMED_STATS if k in stats}
  rates = {k: np.average([r["stats"][k] for r in results], axis=0, weights=weights).tolist()
           for k in RATE_STATS if k in stats}
  seconds = {k: sum(r[k] for r in results)
             for k in ("seconds", "first_token_seconds", "decode_seconds")}
  return dict(seconds, stats=summed | rates, sequences=[s for r in results for s in r["sequences"]])


def cells_of(results: dict, groups: int, new_tokens: int) -> dict:
  """Every contender's cell beside greedy's."""
  return {name: head_cell(result, results["greedy"], new_tokens * groups, groups)
          for name, result in results.items()}


def auto_verdict(overall: dict, line: HeadLine, choice: dict) -> dict:
  """Auto's choice and measured speed beside the best fixed tree's and greedy's."""
  auto = overall[line.name]
  verdict = dict(choice=choice, speedup_vs_greedy=auto["speedup_vs_greedy"],
                 tokens_per_pass=auto["tokens_per_pass"],
                 at_most_5pct_slower_than_greedy=auto["speedup_vs_greedy"] >= TOLERANCE)
  fixed = [f"{line.name}@{tree.label}" for tree in line.trees]
  if fixed:
    best = max(fixed, key=lambda name: overall[name]["speedup_vs_greedy"])
    ratio = auto["speedup_vs_greedy"] / overall[best]["speedup_vs_greedy"]
    verdict.update(best_fixed=best, best_fixed_speedup=overall[best]["speedup_vs_greedy"],
                   auto_over_best_fixed=ratio, within_5pct_of_best_fixed=ratio >= TOLERANCE,
                   goal_met=ratio >= TOLERANCE and verdict["at_most_5pct_slower_than_greedy"])
  return verdict


def bench_batch(model: mdjax.Model, lines: list[HeadLine], prompts: list[Prompt], batch: int,
                settings: Settings) -> dict:
  """Every contender on every slice of the prompts at `batch` rows (`slices`)."""
  runs = {"greedy": ("greedy", {}), "prompt_lookup": ("prompt_lookup", LOOKUP)}
  for line in lines:
    runs |= line.contenders()
  parts = slices(prompts, batch)
  kinds, collected = {}, {name: [] for name in runs}
  for kind, groups in parts.items():
    contenders = {name: functools.partial(run_mdjax, model, groups, settings.new_tokens, strategy,
                                          **options)
                  for name, (strategy, options) in runs.items()}
    results = timed(contenders, settings.repeats, f"batch {batch}, {kind}")
    kinds[kind] = cells_of(results, len(groups), settings.new_tokens)
    for name, c in kinds[kind].items():
      if not c["identical_to_greedy"]:
        c["divergence_gaps"] = divergence_gaps(model, [r for g in groups for r in g],
                                               results["greedy"]["sequences"],
                                               results[name]["sequences"])
    for name, result in results.items():
      collected[name].append((result, len(groups)))
  groups = sum(len(g) for g in parts.values())
  overall = cells_of({name: merged(p) for name, p in collected.items()}, groups,
                     settings.new_tokens)
  for name, c in overall.items():
    if not c["identical_to_greedy"]:
      c["divergence_gaps"] = [g for k in kinds.values() for g in k[name].get("divergence_gaps", [])]
  first_rows = next(iter(parts.values()))[0]
  choices = {line.name: auto_choice(model, first_rows, line.strategy, settings.new_tokens,
                                     heads=line.heads)
             for line in lines}
  cell = dict(overall=overall,
              sweep={line.name: {f"{line.name}@{t.label}": t.budget for t in line.trees}
                     for line in lines},
              auto={line.name: auto_verdict(overall, line, choices[line.name]) for line in lines})
  return cell if batch > 1 else dict(kinds=kinds, **cell)


def mismatches(batches: dict) -> list[str]:
  """"batch B, <kind or overall>, <contender>: m/n tokens" for every contender whose
  tokens are not greedy's."""
  found = []
  for batch, cell in batches.items():
    for part, cells in {**cell.get("kinds", {}), "overall": cell["overall"]}.items():
      for name, c in cells.items():
        if not c["identical_to_greedy"]:
          found.append(mismatch_line(f"batch {batch}, {part}, {name}", c))
  return found


def run(settings: Settings) -> dict:
  model, lines, prompts, source = setup(settings)
  batches = {str(batch): bench_batch(model, lines, prompts, batch, settings)
             for batch in settings.batches}
  bandwidth = memory_bandwidth(settings.bandwidth_mib)
  return dict(machine=machine_info(bandwidth), settings=dataclasses.asdict(settings),
              model=model.description, **source,
              kinds={kind: sum(p.kind == kind for p in prompts)
                     for kind in dict.fromkeys(p.kind for p in prompts)},
              heads={line.name: line.heads.name or "random" for line in lines},
              batches=batches, mismatches=mismatches(batches))


def headline(results: dict) -> list[str]:
  """The contenders compared per kind: the baselines but greedy, and auto's."""
  return [name for name in next(iter(results["batches"].values()))["overall"]
          if name == "prompt_lookup" or name in results["heads"]]


def table(results: dict) -> str:
  lines = []
  for batch, cell in results["batches"].items():
    lines.append(f"batch {batch}, overall     ms/tok  vs greedy  tokens/pass  same tokens")
    for name, c in cell["overall"].items():
      same = f"{c['tokens']['matching_tokens']}/{c['tokens']['total_tokens']}"
      flag = "" if c["identical_to_greedy"] else "  MISMATCH"
      lines.append(f"  {name:<20} {c['ms_per_token']:7.2f}  {c['speedup_vs_greedy']:8.2f}x  "
                   f"{c['tokens_per_pass']:11.2f}  {same}{flag}")
    if "kinds" in cell:
      lines += kind_table(cell["kinds"], headline(results), batch)
    lines += [auto_line(batch, name, verdict) for name, verdict in cell["auto"].items()]
  if results["mismatches"]:
    lines += ["TOKEN MISMATCH vs greedy (a lossless mode must equal it):"]
    lines += [f"  {m}" for m in results["mismatches"]]
  return "\n".join(lines)


def kind_table(kinds: dict, names: list[str], batch: str) -> list[str]:
  """Per task kind: each contender's speedup vs greedy (tokens per pass)."""
  lines = [f"batch {batch}, per kind: speedup vs greedy (tokens per pass)",
           f"  {'kind':<20}" + "".join(f"{n:>16}" for n in names)]
  for kind, cells in kinds.items():
    row = [f"{cells[n]['speedup_vs_greedy']:8.2f}x ({cells[n]['tokens_per_pass']:4.2f})"
           for n in names]
    lines.append(f"  {kind:<20}" + "".join(row))
  return lines


def auto_line(batch: str, name: str, verdict: dict) -> str:
  """Auto's choice and issue 40's goal for one head strategy, in words."""
  c = verdict["choice"]
  tree = ("plain decoding" if c.get("tree_choice") != "tree" else
          f"budget {c['tree_budget']} (depth {c['tree_depth']}, top-k {c['tree_top_k']})")
  line = (f"batch {batch}, {name} auto: {tree}, {verdict['speedup_vs_greedy']:.2f}x greedy "
          f"[{'ok' if verdict['at_most_5pct_slower_than_greedy'] else 'FAILS'} >= 0.95x]")
  if "best_fixed" in verdict:
    line += (f"; best fixed {verdict['best_fixed']} {verdict['best_fixed_speedup']:.2f}x, auto "
             f"{verdict['auto_over_best_fixed']:.0%} of it "
             f"[{'ok' if verdict['within_5pct_of_best_fixed'] else 'FAILS'} >= 95%]")
  return line


def plot_budgets(ax, results: dict) -> None:
  """Speedup vs tree budget per head strategy and batch, auto's choice a star."""
  widest, star = 1, "auto's choice"
  for (batch, cell), style in zip(results["batches"].items(), itertools.cycle(LINESTYLES)):
    for i, (name, sweep) in enumerate(cell["sweep"].items()):
      color = f"C{i}"
      ax.plot(list(sweep.values()), [cell["overall"][n]["speedup_vs_greedy"] for n in sweep],
              "o" + style, color=color, label=f"{name}, batch {batch}")
      auto = cell["auto"][name]
      budget = auto["choice"].get("tree_budget", 0)
      ax.plot([budget], [auto["speedup_vs_greedy"]], "*", color=color, markersize=16,
              markeredgecolor="black", label=star)
      star = None  # one legend entry for every star
      widest = max(widest, budget, *sweep.values())
  ax.axhline(1.0, color="black", lw=0.8)
  ax.set_xscale("symlog", base=2, linthresh=1)
  ax.set_xlim(-0.5, widest * 1.5)  # room for a star at 0 (plain decoding)
  ax.set_xlabel("tree budget (nodes verified per pass; 0 = plain decoding)")
  ax.set_ylabel("speedup vs mdjax greedy")
  ax.set_title("fixed trees (lines) and auto's choice (stars)", fontsize=10)
  ax.legend(fontsize=7)


def plot(results: dict, path: pathlib.Path) -> None:
  """Top: speedup and tokens per pass per task kind at batch 1. Bottom: speedup vs tree
  budget with auto marked, and the overall speedup at every batch."""
  fig, ((speed, passes), (budgets, overall)) = plt.subplots(2, 2, figsize=(15, 10))
  names = headline(results)
  kinds = results["batches"].get("1", {}).get("kinds", {})
  for ax, key, label in ((speed, "speedup_vs_greedy", "speedup vs mdjax greedy"),
                         (passes, "tokens_per_pass", "tokens per target pass")):
    bars(ax, list(kinds), {n: [cells[n][key] for cells in kinds.values()] for n in names}, label)
    ax.set_title("per task kind, batch 1 (auto trees); greedy = 1", fontsize=10)
  plot_budgets(budgets, results)
  batches = list(results["batches"])
  bars(overall, names, {f"batch {b}": [results["batches"][b]["overall"][n]["speedup_vs_greedy"]
                                       for n in names] for b in batches},
       "speedup vs mdjax greedy")
  overall.set_title("overall, every batch (auto trees)", fontsize=10)
  heads = ", ".join(f"{k}: {v}" for k, v in results["heads"].items())
  save_figure(fig, path, f"{results['model']}; {heads}\n{machine_line(results['machine'])}")


def main(argv):
  del argv
  settings = Settings(batches=tuple(int(b) for b in _BATCHES.value),
                      budgets=tuple(int(b) for b in _BUDGETS.value),
                      eagle_trees=tuple(_EAGLE_TREES.value), per_kind=_PER_KIND.value, kinds=0,
                      new_tokens=_NEW_TOKENS.value, repeats=_REPEATS.value)
  if _QUICK.value:
    settings = dataclasses.replace(settings, **QUICK)
  for batch in settings.batches:
    check_count("batch size", batch, 1)
  check_count("new_tokens", settings.new_tokens, 2)  # the decode after the first token is timed
  check_count("repeats", settings.repeats, 1)
  write_results(run(settings), _OUT_DIR.value, "bench_heads", plot, table)


if __name__ == "__main__":
  app.run(one_line_errors(main))
