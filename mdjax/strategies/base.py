"""What every strategy shares: the prompt batch, run limits and the output buffer.

A strategy is a frozen dataclass of static options (hashable: it is a static jit
argument, and the key of the compiled-program cache) with pure functions over its
own state pytree::

    cache_slots(prompt_len, capacity) -> int          (static: how big a cache it needs)
    init(params, prompt, cache, limits, capacity) -> state   (prefill + first tokens)
    step(params, state) -> state                      (propose -> decode_step -> commit)
    done(state) -> bool[rows]
    result(state) -> (OutputBuffer, stats: dict of int32 scalars)

`mdjax.generate` runs `step` inside one `lax.while_loop`, so a whole generation is
one compiled program with no host sync per token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from mdjax.cache import CacheRegions, KVCache
from mdjax.models.config import ModelConfig
from mdjax.step import decode_step
from mdjax.topology import Topology


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompt:
  """What every row prefills, and where its branches start decoding.

    tokens, positions, segments  int32[B, P]   right-padded (segment -1 = padding)
    lengths                      int32[B]      real tokens per row
    parent, fork                 int32[B, G]   the segment tree (`mdjax.topology`)
    branch_segment               int32[B, N]   segment each branch decodes in (-1: none)
    branch_last                  int32[B, N]   token whose logits give the branch's first token

  A plain prompt is one branch in segment 0. Questions over one context (see
  `layout_prompts`): the context is segment 0 at positions 0..c-1, question j is
  segment j+1 forked at c, at positions c, c+1, ...; branch j continues after it.
  """

  tokens: Int[Array, "B P"]
  positions: Int[Array, "B P"]
  segments: Int[Array, "B P"]
  lengths: Int[Array, "B"]
  parent: Int[Array, "B G"]
  fork: Int[Array, "B G"]
  branch_segment: Int[Array, "B N"]
  branch_last: Int[Array, "B N"]

  def topology(self) -> Topology:
    return Topology(parent=self.parent, fork=self.fork)

  def branch_positions(self) -> Int[Array, "B N"]:
    """Position of each branch's first generated token."""
    return jnp.take_along_axis(self.positions, self.branch_last, axis=1) + 1


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Limits:
  """Run-time (traced) limits: changing them does not recompile."""

  max_new_tokens: Int[Array, ""]
  eos_ids: Int[Array, "E"]  # -1 entries never match
  key: jax.Array  # PRNG key of the whole run


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutputBuffer:
  """Generated tokens per output row: `tokens` int32[R, N] (-1 past `count`); `scores`
  float32[R] for strategies that score their outputs (beam search), else None."""

  tokens: Int[Array, "R N"]
  count: Int[Array, "R"]
  done: Bool[Array, "R"]
  scores: Float[Array, "R"] | None = None

  @classmethod
  def empty(cls, rows: int, capacity: int) -> "OutputBuffer":
    return cls(tokens=jnp.full((rows, capacity), -1, jnp.int32),
               count=jnp.zeros((rows,), jnp.int32), done=jnp.zeros((rows,), jnp.bool_))


def emit(buffer: OutputBuffer, new: Int[Array, "R A"], num_new: Int[Array, "R"],
         limits: Limits) -> tuple[OutputBuffer, Bool[Array, "R A"]]:
  """Appends the first `num_new[r]` tokens of `new[r]` to row r.

  A row stops at its first EOS (kept) or at `max_new_tokens`; a done row takes
  nothing. Returns the buffer and which of the offered tokens were taken.
  """
  offered = jnp.arange(new.shape[1])[None, :] < num_new[:, None]  # [R, A]
  is_eos = (new[..., None] == limits.eos_ids).any(-1) & offered  # [R, A]
  eos_before = (jnp.cumsum(is_eos, axis=1) - is_eos) > 0
  index = buffer.count[:, None] + jnp.arange(new.shape[1])[None, :]  # [R, A]
  taken = offered & ~eos_before & (index < limits.max_new_tokens) & ~buffer.done[:, None]
  rows = jnp.arange(new.shape[0])[:, None]
  tokens = buffer.tokens.at[rows, jnp.where(taken, index, buffer.tokens.shape[1])].set(
      new, mode="drop")
  count = buffer.count + taken.sum(axis=1, dtype=jnp.int32)
  done = buffer.done | (taken & is_eos).any(axis=1) | (count >= limits.max_new_tokens)
  return OutputBuffer(tokens=tokens, count=count, done=done), taken


def prefill(params, prompt: Prompt, cache: KVCache, config: ModelConfig, attention: str,
            slots: Int[Array, "B P"] | None = None
            ) -> tuple[Float[Array, "B N V"], KVCache, Topology]:
  """Every row's context and branch tokens in one pass (into `slots` when given): the
  logits that start each branch, the cache, and the prompt's topology."""
  topology = prompt.topology()
  logits, _, cache = decode_step(params, cache, prompt.tokens, prompt.positions,
                                 prompt.segments, topology, config=config,
                                 logits_at=prompt.branch_last, attention=attention,
                                 slots=slots)  # [B, N, V]
  return logits, cache, topology


def branch_membership(prompt: Prompt) -> Bool[Array, "B P N"]:
  """`[b, i, j]`: prompt token i of row b belongs to branch j (its question, suffix)."""
  return ((prompt.segments[:, :, None] == prompt.branch_segment[:, None, :])
          & (prompt.segments >= 0)[..., None])


def branch_token_counts(prompt: Prompt) -> tuple[int, int]:
  """(host) The most shared prompt tokens of a row, and the most prompt tokens of one
  branch: what `regions` must hold besides generated tokens."""
  in_branch = np.asarray(branch_membership(prompt))  # [B, P, N]
  shared = ((np.asarray(prompt.segments) >= 0) & ~in_branch.any(-1)).sum(axis=1)  # [B]
  return int(shared.max()), int(in_branch.sum(axis=1).max())


def region_slot_base(prompt: Prompt, regions: CacheRegions) -> Int[Array, "B N"]:
  """With one cache region per branch (`mdjax.cache.CacheRegions`), branch j's token
  at position p takes slot `base[b, j] + p`: its region's first slot minus its fork
  position, so the branch's tokens fill the region in order from its fork (question,
  then answer)."""
  fork = jnp.take_along_axis(prompt.fork, jnp.maximum(prompt.branch_segment, 0), axis=1)
  first = regions.shared + jnp.arange(prompt.branch_segment.shape[1]) * regions.size  # [N]
  return first - fork  # [B, N]


def region_prompt_slots(prompt: Prompt, regions: CacheRegions) -> Int[Array, "B P"]:
  """The slot of every prompt token with one region per branch: shared tokens keep
  their index (`layout_prompts` and `layout_chains` put them first), branch tokens go
  to their region."""
  in_branch = branch_membership(prompt)  # [B, P, N]
  base = jnp.take_along_axis(region_slot_base(prompt, regions), jnp.argmax(in_branch, -1),
                             axis=1)  # [B, P]
  return jnp.where(in_branch.any(-1), base + prompt.positions,
                   jnp.arange(prompt.tokens.shape[1]))


def run_narrowest(widths: tuple[int, ...], need, pass_at, carry, *operands):
  """`(pass_at(w)(carry, *operands), w)` for the narrowest `w` in `widths` (widest
  first) that holds `need` (a traced count) columns. Every width is compiled; only
  the one taken runs, in place (`switch_in_place`)."""
  level = sum((need <= w).astype(jnp.int32) for w in widths[1:])
  carry = switch_in_place(level, [pass_at(w) for w in widths], carry, *operands)
  return carry, jnp.asarray(widths, jnp.int32)[level]


def switch_in_place(index, branches, carry, *operands):
  """`branches[index](carry, *operands)` for a traced `index`, each branch returning
  a tree shaped like `carry` (e.g. `(logits, cache)`): what `lax.switch` gives, run
  as one while loop per branch that iterates once when taken, never otherwise.

  Inside a `lax.switch` or `lax.cond` branch, XLA:CPU copies the KV cache between
  layer writes (the attention loops take the whole cache as an operand): at
  multi_question N = 16, context 1024, 4 copies of 55 MB per pass, a third of the
  step. A while loop's body updates it in place.
  """
  for i, branch in enumerate(branches):
    def once(taken_carry, branch=branch):
      return False, branch(taken_carry[1], *operands)
    _, carry = jax.lax.while_loop(lambda taken_carry: taken_carry[0], once, (index == i, carry))
  return carry


def chain_widths(width: int) -> tuple[int, ...]:
  """The columns a verify pass may run on, widest first: the whole chain, half of it
  (chains of 6 or more), or only the last emitted token (nothing drafted). Each width
  is one more compiled pass."""
  half = (-(-width // 2),) if width >= 6 else ()
  return tuple(sorted({width, *half, 1}, reverse=True))


def decode_chains(params, cache: KVCache, tokens: Int[Array, "B N C"],
                  positions: Int[Array, "B N C"], segments: Int[Array, "B N C"],
                  topology: Topology, *, config: ModelConfig, attention: str
                  ) -> tuple[Float[Array, "B N C V"], KVCache, Int[Array, ""]]:
  """`decode_step` over N chains of C columns per row, each chain's scored tokens a
  prefix (segment -1 after it), run only as wide as the longest prefix needs::

      chains   c d0 d1 d2 d3 d4 | c d0 .  .  .  .     longest prefix 3 -> W = 3
      fed      c d0 d1          | c d0 .              (W from `chain_widths(C)`)

  Padding takes no cache slot, so the cache is the same at any W; the logits of the
  columns not fed are zeros (past every prefix: never read). Saves the pass its
  unused columns when chains come out short (no n-gram match, a low-confidence stop,
  a small heuristic budget). Returns the logits, the cache and W.
  """
  batch, branches, width = tokens.shape
  def feed(fed: int, carry):
    def cut(x):
      return x[..., :fed].reshape(batch, branches * fed)
    logits, _, cache = decode_step(params, carry[1], cut(tokens), cut(positions), cut(segments),
                                   topology, config=config, attention=attention)
    logits = logits.reshape(batch, branches, fed, -1)
    return jnp.pad(logits, ((0, 0), (0, 0), (0, width - fed), (0, 0))), cache

  unfed = jnp.zeros((batch, branches, width, config.vocab_size), jnp.float32)
  (logits, cache), fed_width = run_narrowest(
      chain_widths(width), (segments >= 0).sum(axis=-1).max(),
      lambda w: functools.partial(feed, w), (unfed, cache))
  return logits, cache, fed_width
