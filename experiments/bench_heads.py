"""Multi-token-prediction heads vs mdjax greedy and prompt lookup, on the held-out prompts.

    python3 -m experiments.bench_heads            # smollm2-135m-instruct with its shipped heads
    python3 -m experiments.bench_heads --quick    # smoke test: a random model, untrained heads

For each batch size (rows of held-out chat prompts, never trained on): greedy, prompt
lookup, `medusa` on the heads' calibrated tree, `blockwise` (the heads' top-1 chain)
and `eagle`; every lossless contender's tokens are compared with greedy's. At batch 1
`medusa` also runs at several tree budgets (tokens per target pass vs budget), and
`eagle` with a smaller tree (`eagle_8`: depth 3, top-3, 8 nodes). Writes
`bench_heads.json` and `bench_heads.png`: tokens per pass vs tree budget (measured,
and the trainer's prediction from the held-out top-k accuracies), acceptance per depth,
speed vs greedy per batch size.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from absl import app, flags
import numpy as np

import mdjax
from experiments.cli import one_line_errors
from experiments.benchlib import (machine_info, machine_line, memory_bandwidth, plt, run_mdjax,
                                  save_figure, summarize, timed, write_results)
from mdjax import chat
from mdjax.heads import HeadsConfig, init_heads
from mdjax.heads import tree as head_trees

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Model (name, directory, .gguf).")
_MEDUSA = flags.DEFINE_string("medusa", "smollm2-135m-instruct-medusa", "Medusa heads.")
_EAGLE = flags.DEFINE_string("eagle", "smollm2-135m-instruct-eagle",
                             "EAGLE heads ('' to leave eagle out).")
_BATCHES = flags.DEFINE_list("batches", ["1", "4", "8"], "Batch sizes.")
_BUDGETS = flags.DEFINE_list("budgets", ["4", "8", "16", "32", "64"],
                             "Medusa tree budgets (nodes) swept at batch 1.")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Held-out prompts (each batch size runs them all).")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "Generated tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions of every contender (median).")
_OUT_DIR = flags.DEFINE_string("out_dir", "results/bench_heads", "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False,
                           "Smoke test: random-llama-tiny, untrained heads, 2 prompts, 8 tokens.")

LOOKUP = dict(prompt_lookup_num_tokens=4, max_ngram_size=3)
EAGLE_TREE = dict(tree_depth=4, tree_top_k=4, tree_budget=16)
EAGLE_SMALL_TREE = dict(tree_depth=3, tree_top_k=3, tree_budget=8)  # batch 1 only


@dataclasses.dataclass(frozen=True)
class Settings:
  batches: tuple[int, ...]
  budgets: tuple[int, ...]
  prompts: int
  new_tokens: int
  repeats: int


QUICK = dict(batches=(1, 2), budgets=(2, 4), prompts=2, new_tokens=8, repeats=1)


def heldout_prompts(model: mdjax.Model, heads: mdjax.Heads, count: int) -> list[list[int]]:
  """The first `count` held-out prompts saved with the heads, as chat-template ids."""
  texts = json.loads((pathlib.Path(heads.path) / "heldout_prompts.json").read_text())
  return [chat.chat_ids(model, text) for text in texts[:count]]


def quick_setup() -> tuple[mdjax.Model, mdjax.Heads, mdjax.Heads, list[list[int]]]:
  """A random model, untrained heads of both families and random prompts."""
  model = mdjax.load("random-llama-tiny")
  c = model.config
  heads = {family: init_heads(HeadsConfig(family=family, base_model="random-llama-tiny",
                                          base_family=c.family, hidden_size=c.hidden_size,
                                          vocab_size=c.vocab_size,
                                          num_heads=3 if family == "medusa" else 1), c)
           for family in ("medusa", "eagle")}
  prompts = np.random.default_rng(0).integers(3, c.vocab_size, (2, 24)).tolist()
  return model, heads["medusa"], heads["eagle"], prompts


def groups_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
  """The prompts in groups of `batch` rows (the last group filled from the start)."""
  rows = prompts + prompts[:(-len(prompts)) % batch]
  return [rows[i:i + batch] for i in range(0, len(rows), batch)]


def head_cell(result: dict, greedy: dict, steps: int, groups: int) -> dict:
  """`summarize`, plus tokens per target pass of a row (the prefill counts as one:
  greedy's is 1) and the acceptance per depth of the tree strategies."""
  cell = summarize(result, greedy, steps, groups)
  stats = result["stats"]
  cell["tokens_per_pass"] = steps / (stats["target_passes"] + groups)
  if "accepted_at" in stats:
    cell["acceptance_at"] = (np.asarray(stats["accepted_at"])
                             / np.maximum(stats["drafted_at"], 1)).tolist()
  return cell


def bench_batch(model, medusa, eagle, prompts, batch: int, settings: Settings) -> dict:
  groups = groups_of(prompts, batch)
  n = settings.new_tokens
  contenders = {"greedy": lambda: run_mdjax(model, groups, n, "greedy"),
                "prompt_lookup": lambda: run_mdjax(model, groups, n, "prompt_lookup", **LOOKUP),
                "medusa": lambda: run_mdjax(model, groups, n, "medusa", heads=medusa),
                "blockwise": lambda: run_mdjax(model, groups, n, "blockwise", heads=medusa)}
  if eagle is not None:
    contenders["eagle"] = lambda: run_mdjax(model, groups, n, "eagle", heads=eagle, **EAGLE_TREE)
  if batch == 1:
    if eagle is not None:
      contenders["eagle_8"] = lambda: run_mdjax(model, groups, n, "eagle", heads=eagle,
                                                **EAGLE_SMALL_TREE)
    for budget in settings.budgets:
      contenders[f"medusa_{budget}"] = (
          lambda budget=budget: run_mdjax(model, groups, n, "medusa", heads=medusa,
                                          tree_budget=budget))
  results = timed(contenders, settings.repeats, f"batch {batch}")
  steps = n * len(groups)
  return {name: head_cell(result, results["greedy"], steps, len(groups))
          for name, result in results.items()}


def predicted(medusa: mdjax.Heads, budgets: tuple[int, ...]) -> dict:
  """The trainer's prediction of tokens per pass: Medusa's expected accepted length of
  the tree built from the held-out top-k accuracies at each budget, and the chain's."""
  accuracy = medusa.config.top_accuracy
  if not accuracy:
    return {}
  chain = tuple((0,) * d for d in range(1, len(accuracy) + 1))
  return dict(tree={str(b): head_trees.expected_length(head_trees.build_tree(accuracy, b), accuracy)
                    for b in budgets},
              chain=head_trees.expected_length(chain, accuracy))


def run(settings: Settings) -> dict:
  if _QUICK.value:
    model, medusa, eagle, prompts = quick_setup()
  else:
    model = mdjax.load(_MODEL.value)
    medusa = mdjax.load_heads(_MEDUSA.value)
    eagle = mdjax.load_heads(_EAGLE.value) if _EAGLE.value else None
    prompts = heldout_prompts(model, medusa, settings.prompts)
  results = dict(machine=machine_info(memory_bandwidth(256)), settings=dataclasses.asdict(settings),
                 model=model.description, medusa=medusa.name or "untrained",
                 eagle=None if eagle is None else eagle.name or "untrained",
                 predicted=predicted(medusa, settings.budgets), batches={})
  for batch in settings.batches:
    results["batches"][str(batch)] = bench_batch(model, medusa, eagle, prompts, batch, settings)
  return results


def table(results: dict) -> str:
  lines = ["batch  contender        ms/tok  vs greedy  tokens/pass  same tokens"]
  for batch, cells in results["batches"].items():
    for name, c in cells.items():
      same = f"{c['tokens']['matching_tokens']}/{c['tokens']['total_tokens']}"
      lines.append(f"{batch:>5}  {name:<15} {c['ms_per_token']:7.2f}  "
                   f"{c['speedup_vs_greedy']:8.2f}x  {c['tokens_per_pass']:11.2f}  {same}")
  return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
  """Left: medusa's tokens per pass vs tree budget (batch 1), measured and predicted.
  Middle: acceptance per depth. Right: speedup vs greedy per contender and batch."""
  fig, (budget_ax, depth_ax, speed) = plt.subplots(1, 3, figsize=(16, 5))
  first = next(iter(results["batches"].values()))
  budgets = results["settings"]["budgets"]
  budget_ax.plot(budgets, [first[f"medusa_{b}"]["tokens_per_pass"] for b in budgets], "o-",
                 label="measured")
  if results["predicted"]:
    budget_ax.plot(budgets, [results["predicted"]["tree"][str(b)] for b in budgets], "x--",
                   label="predicted from held-out top-k accuracy")
  budget_ax.set_xscale("log", base=2)
  budget_ax.set_xlabel("tree budget (nodes verified per pass)")
  budget_ax.set_ylabel("tokens per target pass")
  budget_ax.set_title("medusa, batch 1", fontsize=10)
  budget_ax.legend(fontsize=8)
  for name in ("medusa", "blockwise", "eagle"):
    cell = first.get(name)
    if cell and "acceptance_at" in cell:
      rates = cell["acceptance_at"]
      depth_ax.plot(range(1, len(rates) + 1), rates, "o-", label=name)
  depth_ax.set_xlabel("depth")
  depth_ax.set_ylabel("accepted / drafted at that depth")
  depth_ax.set_title("acceptance per depth, batch 1", fontsize=10)
  depth_ax.legend(fontsize=8)
  names = [n for n in first if n != "greedy" and not n.startswith("medusa_")]
  width = 0.8 / len(results["batches"])
  for i, (batch, cells) in enumerate(results["batches"].items()):
    x = np.arange(len(names)) + i * width
    speed.bar(x, [cells.get(n, {}).get("speedup_vs_greedy", 0.0) for n in names], width,
              label=f"batch {batch}")
  speed.axhline(1.0, color="black", lw=0.8)
  speed.set_xticks(np.arange(len(names)) + width * (len(results["batches"]) - 1) / 2, names,
                   rotation=30, ha="right", fontsize=8)
  speed.set_ylabel("speedup per token vs mdjax greedy")
  speed.legend(fontsize=8)
  save_figure(fig, path, f"{results['model']}; heads {results['medusa']}, {results['eagle']}\n"
                         f"{machine_line(results['machine'])}")


def main(argv):
  del argv
  settings = Settings(batches=tuple(int(b) for b in _BATCHES.value),
                      budgets=tuple(int(b) for b in _BUDGETS.value), prompts=_PROMPTS.value,
                      new_tokens=_NEW_TOKENS.value, repeats=_REPEATS.value)
  if _QUICK.value:
    settings = dataclasses.replace(settings, **QUICK)
  write_results(run(settings), _OUT_DIR.value, "bench_heads", plot, table)


if __name__ == "__main__":
  app.run(one_line_errors(main))
