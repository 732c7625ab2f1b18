"""How a strategy lays out a request's prompts in the cache: the `Prompt` batch.

A strategy declares one layout (`Strategy.layout`); the layout reads at most one
`generate` option (`Layout.option`: the questions, the sample count, the text every
branch appends) and turns the prompts into rows of segments with branches:

    Plain        one branch per prompt, decoding in the prompt's own segment 0
    Questions    a shared context (segment 0), then one branch per question
    Samples      `num_samples` empty branches after the shared prompt
    Chains       a prompt of chunks, one branch after each chunk (`layout_chains`)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from mdjax.errors import MdjaxError
from mdjax.models.model import Model
from mdjax.prompts import bucket, check_context, encode_continuation, encode_prompts
from mdjax.strategies import skeleton
from mdjax.strategies.base import Prompt


@dataclasses.dataclass(frozen=True)
class LaidOut:
  """A request's prompt batch, its real prompt tokens, and each prompt's branch count
  (output rows are prompt-major: prompt i's branches are rows i * N .. i * N + count - 1)."""

  prompt: Prompt
  prompt_tokens: int
  branch_counts: list[int]


@dataclasses.dataclass(frozen=True)
class Plain:
  """One branch per prompt; subclasses add branches after a shared context."""

  option: str | None = None  # the `generate` option this layout reads
  required: bool = True

  def branches(self, model: Model, value, num_prompts: int) -> list[list[list[int]]] | None:
    """Per prompt, the token lists its branches append (None: one plain branch)."""
    return None

  def lay_out(self, model: Model, prompts, value, max_new_tokens: int) -> LaidOut:
    ids = encode_prompts(model, prompts)
    extra = None if value is None else self.branches(model, value, len(ids))
    if extra is not None and max(len(b) for b in extra) == 1:  # nothing to share: plain prompts
      ids, extra = [c + b[0] for c, b in zip(ids, extra)], None
    rows = ids if extra is None else [c + max(b, key=len) for c, b in zip(ids, extra)]
    check_context(model, rows, max_new_tokens)
    total = [len(c) + (0 if extra is None else sum(len(b) for b in extra[i]))
             for i, c in enumerate(ids)]
    counts = [1] * len(ids) if extra is None else [len(b) for b in extra]
    return LaidOut(layout_prompts(ids, extra, bucket(max(total))), sum(total), counts)


@dataclasses.dataclass(frozen=True)
class Questions(Plain):
  """`questions`: one list of questions (texts or token ids) for every prompt, or one
  such list per prompt; each question is a branch after its prompt (the context)."""

  option: str | None = "questions"

  def branches(self, model: Model, value, num_prompts: int) -> list[list[list[int]]]:
    per_prompt = (isinstance(value, (list, tuple)) and value and  # not a question as ids
                  all(isinstance(q, (list, tuple)) and q and not isinstance(q[0], (int, np.integer))
                      for q in value))
    lists = list(value) if per_prompt else [value] * num_prompts
    if len(lists) != num_prompts:
      raise MdjaxError(f"questions has {len(lists)} lists for {num_prompts} prompts")
    result = []
    for i, questions in enumerate(lists):
      if not isinstance(questions, (list, tuple)) or not questions:
        raise MdjaxError(f"prompt {i} needs at least one question, got {questions!r}")
      result.append([_question(model, q, i, j) for j, q in enumerate(questions)])
    return result


def _question(model: Model, question, prompt: int, index: int) -> list[int]:
  try:
    return encode_continuation(model, question)
  except MdjaxError as e:
    raise MdjaxError(f"question {index} of prompt {prompt}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Samples(Plain):
  """`num_samples` empty branches per prompt, sampled independently."""

  option: str | None = "num_samples"

  def branches(self, model: Model, value, num_prompts: int) -> list[list[list[int]]]:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise MdjaxError(f"num_samples must be an integer >= 1, got {value!r}")
    return [[[] for _ in range(value)] for _ in range(num_prompts)]


@dataclasses.dataclass(frozen=True)
class Chains:
  """Each prompt is Python source (cut after every stub's docstring, `skeleton.chunks`)
  or a list of chunks (texts or ids); one branch continues after every chunk,
  appending the text of `option` first when the layout has one (an instruction)."""

  option: str | None = None
  required: bool = True

  def lay_out(self, model: Model, prompts, suffix, max_new_tokens: int) -> LaidOut:
    rows = [_chunks(model, p, i)
            for i, p in enumerate([prompts] if isinstance(prompts, str) else prompts)]
    suffixes = None
    if self.option is not None:
      suffixes = [[encode_continuation(model, suffix)] * len(chunks) for chunks in rows]
    flat = [sum(chunks, []) + (suffixes[i][0] if suffixes else [])
            for i, chunks in enumerate(rows)]
    check_context(model, flat, max_new_tokens)
    total = [len(f) + (len(suffixes[i][0]) * (len(c) - 1) if suffixes else 0)
             for i, (f, c) in enumerate(zip(flat, rows))]
    return LaidOut(layout_chains(rows, bucket(max(total)), suffixes), sum(total),
                   [len(c) for c in rows])


def _chunks(model: Model, source, index: int) -> list[list[int]]:
  """Python source (cut after every stub's docstring), or its chunks (texts or ids)."""
  if isinstance(source, str):
    source = skeleton.chunks(source)
  if not isinstance(source, Sequence) or not source:
    raise MdjaxError(f"prompt {index} must be Python source text or a list of chunks (texts "
                     f"or token ids), got {source!r}")
  (head,) = encode_prompts(model, [source[0]])  # special tokens (BOS) only here
  return [head] + [encode_continuation(model, chunk) for chunk in source[1:]]


def layout_prompts(contexts: list[list[int]], branches: list[list[list[int]]] | None,
                   width: int) -> Prompt:
  """Prompts (padded to `width` tokens) with, per row, branches that each append
  their own tokens (possibly none) after the shared context. `branches` None: one
  plain branch per row, decoding in the context's own segment 0."""
  batch = len(contexts)
  num_branches = 1 if branches is None else max(len(b) for b in branches)
  tokens, positions = np.zeros((batch, width), np.int32), np.zeros((batch, width), np.int32)
  segments = np.full((batch, width), -1, np.int32)
  parent = np.full((batch, num_branches + 1), -1, np.int32)
  fork = np.zeros((batch, num_branches + 1), np.int32)
  branch_segment = np.full((batch, num_branches), -1, np.int32)
  branch_last = np.zeros((batch, num_branches), np.int32)
  lengths = np.zeros((batch,), np.int32)
  for row, context in enumerate(contexts):
    c = len(context)
    tokens[row, :c], positions[row, :c], segments[row, :c] = context, np.arange(c), 0
    end = c
    if branches is None:
      branch_segment[row, 0], branch_last[row, 0] = 0, c - 1
    for j, extra in enumerate([] if branches is None else branches[row]):
      n = len(extra)
      tokens[row, end:end + n], positions[row, end:end + n] = extra, c + np.arange(n)
      segments[row, end:end + n] = j + 1
      parent[row, j + 1], fork[row, j + 1] = 0, c
      branch_segment[row, j], branch_last[row, j] = j + 1, end + n - 1 if n else c - 1
      end += n
    lengths[row] = end
  return Prompt(*(jnp.asarray(a) for a in (tokens, positions, segments, lengths, parent, fork,
                                           branch_segment, branch_last)))


def layout_chains(rows: list[list[list[int]]], width: int,
                  suffixes: list[list[list[int]]] | None = None) -> Prompt:
  """Prompts made of chained chunks, with one branch continuing after every chunk
  (after its own `suffixes[row][j]` tokens, e.g. an instruction, when given).

  Chunk j of a row is segment j, forked from chunk j - 1 where it ends (so chunk j
  sees chunks 0..j); branch j is segment n + j, forked from chunk j at its end, so it
  sees chunks 0..j and its own tokens, never the chunks after it. Three chunks
  (`a b | c | d e`), after one pass::

      slot   0 1 2 3 4 | 5 6 7       tokens a b c d e, then the branches' first tokens
      seg    0 0 1 2 2 | 3 4 5       parent [-1, 0, 1, 0, 1, 2]
      pos    0 1 2 3 4 | 2 3 5       fork   [ 0, 2, 3, 2, 3, 5]

  Branch j decodes exactly as greedy after the tokens of chunks 0..j alone.
  """
  batch, num_chunks = len(rows), max(len(chunks) for chunks in rows)
  tokens, positions = np.zeros((batch, width), np.int32), np.zeros((batch, width), np.int32)
  segments = np.full((batch, width), -1, np.int32)
  parent = np.full((batch, 2 * num_chunks), -1, np.int32)
  fork = np.zeros((batch, 2 * num_chunks), np.int32)
  branch_segment = np.full((batch, num_chunks), -1, np.int32)
  branch_last = np.zeros((batch, num_chunks), np.int32)
  lengths = np.zeros((batch,), np.int32)
  for row, chunks in enumerate(rows):
    end, ends = 0, []
    for j, chunk in enumerate(chunks):
      start, end = end, end + len(chunk)
      ends.append(end)
      tokens[row, start:end], positions[row, start:end] = chunk, np.arange(start, end)
      segments[row, start:end] = j
      parent[row, j], fork[row, j] = j - 1, start if j else 0
      branch = num_chunks + j
      parent[row, branch], fork[row, branch] = j, end
      branch_segment[row, j], branch_last[row, j] = branch, end - 1
    tail = end
    for j, chunk_end in enumerate(ends):
      suffix = suffixes[row][j] if suffixes else []
      tokens[row, tail:tail + len(suffix)] = suffix
      positions[row, tail:tail + len(suffix)] = chunk_end + np.arange(len(suffix))
      segments[row, tail:tail + len(suffix)] = num_chunks + j
      if suffix:
        branch_last[row, j] = tail + len(suffix) - 1
      tail += len(suffix)
    lengths[row] = tail
  return Prompt(*(jnp.asarray(a) for a in (tokens, positions, segments, lengths, parent, fork,
                                           branch_segment, branch_last)))
