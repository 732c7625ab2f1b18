"""The shipped models' goals, measured on held-out files: accuracy, draft agreement, copying.

    python -m experiments.eval_lm [--target=code-tiny] [--draft=code-tiny-draft]

On the held-out files recorded with the target (`heldout_files.json`, never trained on):
* held-out loss and top-1 next-token accuracy of target and draft;
* the copying of blocks of random ids shown twice (`lm.evaluate_induction`: only an
  induction mechanism scores above chance), for both; and the target's, by the size of
  the alphabet the block is drawn from (4, 16, 64 ids or the whole vocabulary): over a
  small alphabet ids recur with different successors and only a match of several
  tokens says what to copy, as at `IncrementalEncoder` beside `IncrementalDecoder`; and
  on blocks where a few common ids recur among rare ones (as newlines and commas do in
  code), after a recurring id and after a unique one;
* the draft's argmax agreement with the target (how often greedy speculation would
  accept a drafted token);
* a copy task: a held-out function is shown, then its first line is repeated; does
  the target continue it greedily into an exact copy? Each miss is classed (after a
  token the function holds more than once? writing a token of the function? how many
  tokens before it a copy had to match?);
* the target's top-1 accuracy on the repeat of held-out sequences and of the random
  blocks, by how often the copied token occurs in the held-out files. A copy mechanism
  too weak to overrule the model's expectations copies frequent tokens and misses rare
  ones (identifiers), and one miss breaks a greedy copy; and how alike the embeddings
  of each band are (mean cosine); and the same accuracies, of held-out sequences and of
  random blocks with common ids and phrases of 2..4 ids, by how many ids before the
  copied one a copy must match to know where to copy it from (1, 2, 3, 4-5, 6-8, 9+).

Writes `--out` (JSON) and prints a summary.
"""

from __future__ import annotations

import ast
import json
import pathlib

from absl import app, flags
import numpy as np

import mdjax
from experiments.cli import one_line_errors
from mdjax.train import data, lm

_TARGET = flags.DEFINE_string("target", "code-tiny", "Target model (name or directory).")
_DRAFT = flags.DEFINE_string("draft", "code-tiny-draft", "Draft model (same tokenizer).")
_SEQUENCES = flags.DEFINE_integer("sequences", 32, "Held-out sequences for loss/accuracy.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Tokens per held-out sequence.")
_COPIES = flags.DEFINE_integer("copies", 8, "Functions in the copy task.")
_COPY_KIND = flags.DEFINE_enum(
    "copy_kind", "functions", ["functions", "methods"],
    "What the copy task copies: top-level functions, or methods (functions in a top-level "
    "class body, indented as in their file): a second set of held-out code, for checking a "
    "model chosen on the functions.")
_COPY_LINES = flags.DEFINE_list(
    "copy_lines", ["4", "12"], "Fewest and most lines of a copied function (longer ones: "
    "a third held-out set, and a harder one).")
_OUT = flags.DEFINE_string("out", "results/eval_lm/eval_lm.json", "JSON output.")

COPY_TEMPLATE = "{function}\n\n# The same function, repeated exactly:\n{first_line}"


def functions_to_copy(texts: list[str], count: int, lines: tuple[int, int] = (4, 12),
                    kind: str = "functions") -> list[str]:
  """Functions of `lines[0]..lines[1]` lines from the texts, in file order: top-level ones
  (`kind="functions"`) or those in top-level class bodies (`"methods"`, indented)."""
  fewest, most = lines
  found = []
  for text in texts:
    try:
      tree = ast.parse(text)
    except SyntaxError:
      continue
    source_lines = text.splitlines()
    nodes = tree.body if kind == "functions" else [
        node for cls in tree.body if isinstance(cls, ast.ClassDef) for node in cls.body]
    for node in nodes:
      if isinstance(node, ast.FunctionDef) and fewest <= node.end_lineno - node.lineno + 1 <= most:
        found.append("\n".join(source_lines[node.lineno - 1:node.end_lineno]))
        if len(found) == count:
          return found
  return found


def copy_lines() -> tuple[int, int]:
  """`--copy_lines` as (fewest, most), checked."""
  try:
    fewest, most = map(int, _COPY_LINES.value)
  except ValueError:
    raise app.UsageError(f"--copy_lines must be two integers FEWEST,MOST, got "
                         f"{','.join(_COPY_LINES.value)}") from None
  if not 2 <= fewest <= most:
    raise app.UsageError(f"--copy_lines needs 2 <= FEWEST <= MOST, got {fewest},{most}")
  return fewest, most


def copy_prompt(model: mdjax.Model, function: str) -> tuple[str, list[int]]:
  """The copy prompt (the function, the request to repeat it, its first line) and the ids
  a copy continues it with (the rest of the function)."""
  first_line, rest = function.split("\n", 1)
  prompt = COPY_TEMPLATE.format(function=function, first_line=first_line)
  return prompt, model.tokenizer.encode("\n" + rest)  # the newline starts the next token


def fits_the_context(model: mdjax.Model, function: str) -> bool:
  """Do the copy prompt and the copy fit in the model's positions?"""
  prompt, expected = copy_prompt(model, function)
  return (len(model.tokenizer.encode(prompt)) + len(expected)
          <= model.config.max_position_embeddings)


def copy_task(model: mdjax.Model, functions: list[str]) -> dict:
  """Greedy continuation after the repeated first line == the rest of the function?

  Each first miss is also classed: did it follow a token the function holds more than
  once (then that token alone does not say where to copy from), and is the token written
  instead one of the function's (copied from the wrong place) or not (the model's own
  expectation won)?"""
  exact, token_match = 0, []
  examples, after_repeated, from_function, match_needed = [], 0, 0, []
  for function in functions:
    prompt, expected = copy_prompt(model, function)
    out = mdjax.generate(model, prompt, max_new_tokens=len(expected), eos_token_id=[])
    got = out.sequences[0]
    matched = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(expected))
    token_match.append(matched / len(expected))
    exact += matched == len(expected)
    if matched < len(expected):
      shown = model.tokenizer.encode(function)
      seen = model.tokenizer.encode(prompt) + expected[:matched]
      after_repeated += shown.count(seen[-1]) > 1
      match_needed.append(data.match_needed(np.asarray(seen)))
      from_function += got[matched] in shown
    examples.append({"function": function, "continuation": out.texts[0]})
  return {"functions": len(functions), "exact_copies": exact,
          "mean_prefix_copied": float(np.mean(token_match)),
          "prefix_copied_by_function": [round(share, 4) for share in token_match],
          "misses_after_a_repeated_token": after_repeated,
          "misses_writing_a_token_of_the_function": from_function,
          "misses_match_needed": match_needed, "examples": examples[:2]}


FREQUENCY_BANDS = (0, 16, 64, 256, 1024)  # lower edges of bands of held-out token counts
ALPHABETS = (4, 16, 64, 0)  # ids each random block is drawn from; 0: the whole vocabulary


def copy_accuracy_by_token_count(model: mdjax.Model, rows: np.ndarray, first: int,
                               counts: np.ndarray) -> dict[str, dict]:
  """Top-1 accuracy on the targets of copy rows `[N, T + 1]` from index `first` on
  (target j is token j + 1), by the band of `counts` `[V]` of each copied token."""
  _, predicted = lm.token_scores(model.params, rows, model.config, batch_size=4)
  correct = (predicted == rows[:, 1:])[:, first:]
  return accuracy_by_band(correct, counts[rows[:, first + 1:]], FREQUENCY_BANDS)


def accuracy_by_band(correct: np.ndarray, counts: np.ndarray,
                     edges: tuple[int, ...]) -> dict[str, dict]:
  """Mean of `correct` over the tokens whose `counts` (same shape) fall in each band
  [edges[i], edges[i + 1]), the last band open; bands without tokens are left out."""
  band = count_band(counts, edges)
  return {label: {"tokens": int((band == i).sum()), "accuracy": float(correct[band == i].mean())}
          for i, label in enumerate(band_labels(edges)) if (band == i).any()}


def count_band(counts: np.ndarray, edges: tuple[int, ...]) -> np.ndarray:
  """The index of the band [edges[i], edges[i + 1]) of each count (same shape)."""
  return np.searchsorted(edges, counts, side="right") - 1


def band_labels(edges: tuple[int, ...]) -> list[str]:
  """"lo-hi" for each band [lo, hi + 1) between `edges`, ">=last" for the open one."""
  return [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])] + [f">={edges[-1]}"]


def embedding_similarity_by_token_count(model: mdjax.Model, counts: np.ndarray,
                                      sample: int = 200) -> dict[str, float]:
  """Mean cosine between the input embeddings of distinct ids in each band of `counts`
  `[V]` (up to `sample` ids per band, seed 0). Near 1: the band's vectors share one
  direction and little is left to tell them apart (nor, with tied embeddings, to
  predict one of them rather than another)."""
  embed = np.asarray(model.params["embed"], np.float64)  # [V, D]
  band = count_band(counts, FREQUENCY_BANDS)  # [V]
  rng = np.random.default_rng(0)
  similarity = {}
  for i, label in enumerate(band_labels(FREQUENCY_BANDS)):
    ids = np.flatnonzero(band == i)
    if len(ids) < 2:
      continue
    vectors = embed[rng.choice(ids, min(sample, len(ids)), replace=False)]
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosines = unit @ unit.T
    similarity[label] = float(cosines[~np.eye(len(unit), dtype=bool)].mean())
  return similarity


def random_copy_accuracy_by_alphabet(model: mdjax.Model, rows: int = 32) -> dict[str, float]:
  """Top-1 on the repeat of random blocks (`lm.induction_rows`) drawn from 4, 16 or 64 ids
  each, or from the whole vocabulary ("all")."""
  return {str(alphabet or "all"): lm.evaluate_induction(model.params, model.config, 4, rows,
                                                        alphabet)
          for alphabet in ALPHABETS}


def random_copy_after_repeated_ids(model: mdjax.Model, rows: int = 32,
                                   common_share: float = 0.3) -> dict[str, float]:
  """Top-1 on the repeat of random blocks with common ids (`lm.induction_rows` with
  `common_share`), split by the id before the predicted one: held more than once by the
  block (only a longer match says where to copy from, as after a newline in code) or once."""
  sequences, block = lm.induction_rows(model.config, rows, common_share=common_share)
  _, predicted = lm.token_scores(model.params, sequences, model.config, batch_size=4)
  correct = (predicted == sequences[:, 1:])[:, block:]  # [R, L]: predictions of the repeat
  previous = sequences[:, block:-1]  # [R, L]: the id each of them follows
  held = (previous[:, :, None] == sequences[:, None, :block]).sum(-1)  # [R, L]: times in the block
  return {"after_a_repeated_id": float(correct[held > 1].mean()),
          "after_a_unique_id": float(correct[held == 1].mean())}


MATCH_BANDS = (1, 2, 3, 4, 6, 9)  # lower edges of bands of `data.match_needed`


def copy_accuracy_by_match_needed(model: mdjax.Model, rows: np.ndarray,
                                  first: int) -> dict[str, dict]:
  """Top-1 accuracy on the targets of copy rows `[N, T + 1]` from index `first` on, by
  how many ids before each a copy must match to know where to copy it from
  (`data.match_needed`, bands 1, 2, 3, 4-5, 6-8 and >= 9)."""
  _, predicted = lm.token_scores(model.params, rows, model.config, batch_size=4)
  correct = (predicted == rows[:, 1:])[:, first:]
  needed = np.array([[data.match_needed(row[:t + 1]) for t in range(first, row.size - 1)]
                     for row in rows])  # [N, T - first]
  return accuracy_by_band(correct, needed, MATCH_BANDS)


def main(argv):
  del argv
  lines = copy_lines()  # a bad flag fails before minutes of measuring
  target, draft = mdjax.load(_TARGET.value), mdjax.load(_DRAFT.value)
  texts = data.recorded_heldout_texts(target.path)
  eos = target.tokenizer.convert_tokens_to_ids(target.tokenizer.eos_token)
  stream = data.token_stream(texts, target.tokenizer.backend_tokenizer, eos)
  packed = data.pack(stream, _SEQ_LEN.value)
  sequences = packed[np.unique(np.linspace(0, len(packed) - 1, _SEQUENCES.value).astype(int))]
  targets = sequences[:, 1:]
  result = {"heldout_files": len(texts), "tokens_scored": int(targets.size)}
  argmaxes = {}
  for role, model in (("target", target), ("draft", draft)):
    losses, argmax = lm.token_scores(model.params, sequences, model.config, batch_size=4)
    argmaxes[role] = argmax
    result[role] = {"name": model.name, "params": model.config.num_params,
                    "heldout_loss": float(losses.mean()),
                    "heldout_accuracy": float((argmax == targets).mean()),
                    "random_copy_accuracy": lm.evaluate_induction(model.params, model.config, 4)}
  result["draft_target_argmax_agreement"] = float((argmaxes["draft"] == argmaxes["target"]).mean())
  counts = np.bincount(stream, minlength=target.config.vocab_size)
  copies = data.repeat_first_half(sequences)  # targets from `half` on: a1 .. a(h-1)
  result["copy_accuracy_by_token_count"] = copy_accuracy_by_token_count(
      target, copies, data.first_half(sequences.shape[1]), counts)
  result["random_copy_accuracy_by_token_count"] = copy_accuracy_by_token_count(
      target, *lm.induction_rows(target.config, rows=128), counts)
  result["copy_accuracy_by_match_needed"] = copy_accuracy_by_match_needed(
      target, copies, data.first_half(sequences.shape[1]))
  result["random_copy_accuracy_by_match_needed"] = copy_accuracy_by_match_needed(
      target, *lm.induction_rows(target.config, rows=32, common_share=0.3, phrase_rate=0.2))
  result["random_copy_accuracy_by_alphabet"] = random_copy_accuracy_by_alphabet(target)
  result["random_copy_after_repeated_ids"] = random_copy_after_repeated_ids(target)
  result["embedding_similarity_by_token_count"] = embedding_similarity_by_token_count(target, counts)
  candidates = functions_to_copy(texts, _COPIES.value, lines, _COPY_KIND.value)
  functions = [f for f in candidates if fits_the_context(target, f)]
  result["copy_task"] = copy_task(target, functions)
  result["copy_task"].update(kind=_COPY_KIND.value, lines=list(lines),
                             too_long_for_the_context=len(candidates) - len(functions))
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  summary = {k: v for k, v in result.items() if k != "copy_task"}
  summary["copy_task"] = {k: v for k, v in result["copy_task"].items() if k != "examples"}
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  app.run(one_line_errors(main))
