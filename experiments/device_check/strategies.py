"""The strategies against greedy on this device, speed and exactness:

- `branches`: `--questions` questions over one context of `--context_len` tokens,
  `multi_question` vs sequential greedy vs batching (the context duplicated per
  question); and prompt lookup vs greedy on a copy-heavy prompt (a random chunk
  repeated): tokens per pass and whether the tokens equal greedy's;
- `heads`: the head strategies (`medusa`, `eagle` with EAGLE and EAGLE-3 heads, random
  but shaped like the shipped ones) at each batch of `--head_batches`, the tree
  `tree_budget="auto"` picks and the fixed trees of `--head_trees`, each against greedy;
  and beside them the mix (prompt lookup and the EAGLE-3-shaped heads in one tree) on
  copy-heavy prompts, with the step cost `auto` predicted against the one measured.
"""

from __future__ import annotations

import functools

import numpy as np

import mdjax
from experiments.bench.common import (LOOKUP, auto_choice, divergence_gaps, head_strategy,
                                      random_heads, random_ids, run_mdjax, shipped_configs,
                                      summarize, timed, tokens_per_pass)
from experiments.device_check import Settings
from mdjax.models.layer_loop import default_layer_loop

COPY_REPEATS = 4  # the copy-heavy prompt: one random chunk this many times
MIX_HEADS = "eagle3"  # the heads the heads section's mix drafts with beside prompt lookup


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
