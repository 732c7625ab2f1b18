"""How often prompt lookup's proposals are right, per task kind: the prior `mixed` starts
from (`mix_choice.LOOKUP_ACCURACY`, `LOOKUP_FURTHER`), measured on greedy answers.

    python3 -m experiments.bench.lookup_prior      # smollm2-135m-instruct, bfloat16
    python3 -m experiments.bench.lookup_prior --quick

At every position of a greedy answer (the prompt and the answer so far as the history,
as `mixed`'s lookup source sees it), `lookup.lookup_matches` proposes `--matches`
continuations of `--num_tokens` tokens; each is scored against the answer's next
tokens::

    matched          positions where some n-gram (n <= --max_ngram_size) matched
    first[d]         P(token d of the first match is right | tokens 1 .. d-1 were)
    further          P(the first token of match m >= 2 is right | no match before it
                     had its first token right) / P(match 1's is): what a trie of all
                     the matches gains from the later ones

and the same over the prompt's own positions (the prompt as its own answer): could a
request's prior be read from its prompt before it generates anything?

Writes `lookup_prior.json` and `lookup_prior.png` into `--out_dir`.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from absl import app, flags
from tqdm.auto import tqdm

import mdjax
from experiments.bench import common
from mdjax import chat
from mdjax.strategies.lookup import lookup_matches

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Model name or path.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Weights' dtype.")
_PROMPTS_PER_KIND = flags.DEFINE_integer("prompts_per_kind", 2, "Questions of each kind.")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Greedy tokens per answer.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 8, "Tokens per proposal (mixed's default).")
_NGRAM = flags.DEFINE_integer("max_ngram_size", 2, "Longest n-gram matched (mixed's default).")
_MATCHES = flags.DEFINE_integer("matches", 3, "Proposals per position (mixed's default).")
_QUICK = flags.DEFINE_bool("quick", False, "A random model, random prompts of 2 kinds, 16 tokens.")
_OUT = flags.DEFINE_string("out_dir", common.results_dir("lookup_prior"), "Output folder.")


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def proposals(history, length, max_ngram: int, num_tokens: int, matches: int):
  """[1, M, L] proposals and [1, M] their real tokens after `history[:length]`."""
  return lookup_matches(history, length, max_ngram, num_tokens, matches)


def scored(text: list[int], start: int, width: int) -> dict:
  """Counts over positions start .. len(text) - 1: `offered[m, d]` (match m proposed a
  token d with tokens 1 .. d-1 right, and no match before it had its first token right)
  and `right[m, d]` (and token d right too)."""
  m, l = _MATCHES.value, _NUM_TOKENS.value
  offered, right, matched = np.zeros((m, l), int), np.zeros((m, l), int), 0
  history = np.zeros((1, width), np.int32)
  history[0, :len(text)] = text
  for i in range(start, len(text)):
    tokens, counts = map(np.asarray, proposals(jnp.asarray(history), jnp.asarray([i]),
                                               _NGRAM.value, l, m))
    matched += bool(counts[0, 0])
    truth = text[i:i + l]
    for match in range(int((counts[0] > 0).sum())):
      for d in range(min(counts[0, match], len(truth))):
        offered[match, d] += 1
        if tokens[0, match, d] != truth[d]:
          break
        right[match, d] += 1
      if tokens[0, match, 0] == truth[0]:
        break  # the trie needs later matches only where no earlier one was right
  return dict(positions=len(text) - start, matched=matched, offered=offered.tolist(),
              right=right.tolist())


def rates(counts: dict) -> dict:
  """`matched`, `first[d]` and `further` (module docstring) from `scored` counts."""
  offered, right = np.asarray(counts["offered"]), np.asarray(counts["right"])
  share = lambda a, b: float(a / b) if b else None
  first = [share(right[0, d], offered[0, d]) for d in range(offered.shape[1])]
  others = share(right[1:, 0].sum(), offered[1:, 0].sum())
  return dict(matched=share(counts["matched"], counts["positions"]), first=first,
              further=share(others, first[0]) if others is not None and first[0] else None)


def summed(cells: list[dict]) -> dict:
  return {key: (np.sum([c[key] for c in cells], axis=0).tolist()) for key in cells[0]}


def plot(results: dict, path) -> None:
  """Per kind: how often the answer's history matched, and how often the first match's
  first token was right, in the answer and in the prompt."""
  cells = {**results["kinds"], "overall": results["overall"]}
  value = lambda x: x or 0.0
  fig, ax = plt.subplots(figsize=(10, 3.5))
  common.bars(ax, list(cells), {
      "answer: matched": [value(c["answer"]["matched"]) for c in cells.values()],
      "answer: first token right": [value(c["answer"]["first"][0]) for c in cells.values()],
      "prompt: first token right": [value(c["prompt"]["first"][0]) for c in cells.values()]},
      "share")
  common.save_figure(fig, path, f"prompt lookup's proposals: {results['model']}")


def table(results: dict) -> str:
  lines = ["| kind | answer: matched | first token right | tokens 2-4 right, given the ones before "
           "| further matches | prompt: first token right |", "|---|---|---|---|---|---|"]
  fmt = lambda x: "-" if x is None else f"{x:.2f}"
  for kind, cell in {**results["kinds"], "overall": results["overall"]}.items():
    a, p = cell["answer"], cell["prompt"]
    lines.append(f"| {kind} | {fmt(a['matched'])} | {fmt(a['first'][0])} | "
                 f"{' / '.join(fmt(x) for x in a['first'][1:4])} | {fmt(a['further'])} | "
                 f"{fmt(p['first'][0])} |")
  return "\n".join(lines)


def main(argv):
  del argv
  questions = common.selected(common.read_questions(common.QUESTIONS), 2 if _QUICK.value else 0,
                              _PROMPTS_PER_KIND.value)
  if _QUICK.value:
    model = mdjax.load("random-llama-tiny")
    rng = np.random.default_rng(0)
    prompts = [common.random_ids(rng, 8, 24).tolist() for _ in questions]  # 8 ids: repeats
  else:
    model = mdjax.load(_MODEL.value, dtype=_DTYPE.value)
    prompts = [chat.chat_ids(model, text) for _, text in questions]
  new = 16 if _QUICK.value else _NEW.value
  answers = mdjax.generate(model, prompts, max_new_tokens=new).sequences
  width = max(map(len, prompts)) + new + 1
  cells: dict[str, list[tuple[dict, dict]]] = {}
  for (kind, _), prompt, answer in tqdm(list(zip(questions, prompts, answers)),
                                        desc="scoring the proposals", unit="answer"):
    cells.setdefault(kind, []).append((scored(prompt + list(answer), len(prompt), width),
                                       scored(prompt, 1, width)))
  per_kind = {kind: [summed([a for a, _ in rows]), summed([p for _, p in rows])]
              for kind, rows in cells.items()}
  everything = [summed([a for a, _ in per_kind.values()]), summed([p for _, p in per_kind.values()])]
  results = dict(
      model=_MODEL.value if not _QUICK.value else "random-llama-tiny",
      command="python3 -m experiments.bench.lookup_prior " + " ".join(sys.argv[1:]),
      options=dict(num_tokens=_NUM_TOKENS.value, max_ngram_size=_NGRAM.value,
                   matches=_MATCHES.value, max_new_tokens=new),
      counts={kind: dict(answer=a, prompt=p) for kind, (a, p) in per_kind.items()},
      kinds={kind: dict(answer=rates(a), prompt=rates(p)) for kind, (a, p) in per_kind.items()},
      overall=dict(answer=rates(everything[0]), prompt=rates(everything[1])))
  common.write_results(results, _OUT.value, "lookup_prior", plot, table)


if __name__ == "__main__":
  app.run(main)
