"""`lookahead` and `jacobi`: guesses from a Jacobi window, verified in the same pass.

Lookahead decoding (Fu et al. 2024) needs no draft model. Every pass feeds, after
the last emitted token `c` (not yet cached, at position p), two branches:

* lookahead: a window of W columns x (N - 1) levels of past Jacobi guesses, whose
  level 0, column 0 is `c` itself. Column k is a chain at positions p + k, p + k + 1,
  ...: level 0 up to column k, then column k's higher levels. The target's argmax
  on top of column k completes it into an n-gram of N tokens for the pool;
* verification: up to G n-grams of the pool that start with `c` (the pool is keyed
  by first token), each a chain `c x y ...` at positions p, p + 1, ...

W = 4, N = 3, G = 2: 12 tokens, positions relative to p::

    level 1       v0  v1  v2  v3        pos 1 2 3 4     seg 2 3 4 5 (one per column)
    level 0   c   u1  u2  u3            pos 0 1 2 3     seg 0 1 1 1
    pool      c → x0  y0                pos   1 2       seg   6 6
              c → x1  y1                pos   1 2       seg   7 7

    seg 0      the committed text and c
    seg 1      level-0 chain u1 u2 u3     parent 0, fork p + 1
    seg 2 + k  column k, levels >= 1      parent 1, fork p + k + 1   (sees c, u1 .. uk)
    seg 6, 7   the pool's candidates      parent 0, fork p + 1

Who sees whom (■); every fed token also sees the whole committed text::

           c  u1 u2 u3 v0 v1 v2 v3 x0 y0 x1 y1
      c    ■
      u1   ■  ■
      u2   ■  ■  ■
      u3   ■  ■  ■  ■
      v0   ■           ■
      v1   ■  ■           ■
      v2   ■  ■  ■           ■
      v3   ■  ■  ■  ■           ■
      x0   ■                       ■
      y0   ■                       ■  ■
      x1   ■                             ■
      y1   ■                             ■  ■

This is the paper's mask (as its reference code builds it): level 0 is causal,
a higher level sees its column's level-0 prefix and its own column below it, a
candidate sees only the text. Every chain has consecutive positions, so each token
gets exactly the logits of decoding its chain alone. After the pass:

* the pool gains the n-grams of the columns: (c v0 ·), (u1 v1 ·), (u2 v2 ·), (u3 v3 ·),
  `·` being the argmax on top of the column;
* the candidates are `c u1 u2 u3` (the level-0 chain: its logits come for free)
  and each `c x y`; `greedy_accept` scores each against the target's argmax, the
  longest wins and its accepted guesses plus the target's next token are emitted:
  exactly greedy decoding's tokens. Rows accept different lengths;
* the winner's segment becomes segment 0, every other fed slot dies, the step's
  slots are compacted and rolled back to `c` + the accepted guesses::

      cache   ... | c u1 u2 u3 v0 v1 v2 v3 x0 y0 x1 y1     winner x0 y0, 1 accepted
      then    ... | c x0                                  (next pass feeds the new c at p + 2)

* the window slides: each level takes the one above it, the top takes the argmax
  on top of the columns, and the columns move left by the number of level-0 guesses
  accepted (see `slide`).

The request's controls (`mdjax.controls`) apply to every fed token's column with the
text its chain continues (`FeedLayout.chains`): the generated text, then the chain's
tokens after c up to that column's. The candidates' columns are then greedy's with
the same controls (exact); the window's and its n-grams, processed too, guess what
greedy with the controls would write (only the speed depends on them).

Jacobi decoding (Santilli et al. 2023) is the 2-gram case without a pool:
`strategy="jacobi"` (`Jacobi`) is a `Lookahead` fixed at ngram=2, guess_set=0. The
window is one chain `c u1 .. u(W-1)`; each pass refines every guess in parallel (u_k
becomes the argmax after u_(k-1)), keeps the longest prefix of guesses equal to the
argmax, and slides past it.

Where this differs from the paper (none of it changes the output): the level-0
chain is verified too (free); the window starts filled with prompt tokens and the
pool takes n-grams once every level above 0 holds argmax outputs (after N - 2
passes), instead of a warm-up that fills one level per pass without verifying; the
reference code's window moves one column per pass whatever was accepted, this one
also moves past the accepted level-0 guesses (the same when none are accepted).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from mdjax import cache as cache_ops
from mdjax import controls
from mdjax.cache import KVCache
from mdjax.controls import CONTROL_OPTIONS
from mdjax.errors import check_count
from mdjax.sampling import greedy_accept
from mdjax.strategies import prompt_layouts
from mdjax.strategies.base import (DecodeState, Limits, OutputBuffer, Prompt, Scored, Strategy,
                                   emit, internal, last_emitted, prefill)
from mdjax.strategies.registry import register
from mdjax.topology import Topology


@dataclasses.dataclass(frozen=True)
class FeedLayout:
  """The static shape of one pass (see the module docstring), relative to p.

    offset, segment  int[T]       position - p and segment of every fed token:
                                  the window level by level, then the candidates
    parent, fork     int[S]       the segment tree; fork - p (segment 0 forks at 0)
    paths            int[C, D+1]  per candidate (0: the level-0 chain, then the
                                  pool's), the fed index of c and of its guesses
    guesses          int[C]       guesses per candidate (D = the most)
    owner            int[C]       the segment holding a candidate's guesses
    chains           int[T, E]    per fed token, the fed indices of its chain after c,
                                  itself last (`offset` of them, -1 after; E = the most):
                                  the text its column continues past the generated text

  W = 4, N = 3, G = 2 (the module docstring's feed): v2's chain is u1 u2 v2, y0's x0 y0.
  """

  offset: np.ndarray
  segment: np.ndarray
  parent: np.ndarray
  fork: np.ndarray
  paths: np.ndarray
  guesses: np.ndarray
  owner: np.ndarray
  chains: np.ndarray

  def place(self, next_pos: Int[Array, "B"], done: Bool[Array, "B"]
            ) -> tuple[Int[Array, "B T"], Int[Array, "B T"], Topology]:
    """Positions, segments (-1 for done rows) and topology of every row's feed."""
    positions = next_pos[:, None] + self.offset  # [B, T]
    segments = jnp.where(done[:, None], -1, jnp.asarray(self.segment))  # [B, T]
    fork = jnp.where(np.arange(self.fork.size) == 0, 0, next_pos[:, None] + self.fork)  # [B, S]
    parent = jnp.broadcast_to(jnp.asarray(self.parent), fork.shape)
    return positions, segments, Topology(parent=parent, fork=fork)


@functools.lru_cache(maxsize=None)
def feed_layout(window: int, ngram_size: int, guess_set: int) -> FeedLayout:
  """The layout of W = `window`, N = `ngram_size`, G = `guess_set`: T = (N - 1)(W + G)."""
  levels = ngram_size - 1
  level, column = np.divmod(np.arange(levels * window), window)  # the window, level-major
  columns = window if levels > 1 else 0  # segments for the levels above 0
  candidate, index = np.divmod(np.arange(guess_set * levels), levels)
  offset = np.concatenate([level + column, 1 + index])
  segment = np.concatenate([np.where(level > 0, 2 + column, np.minimum(column, 1)),
                            2 + columns + candidate])
  parent = np.array([-1, 0] + [1] * columns + [0] * guess_set)
  fork = np.array([0, 1] + [1 + k for k in range(columns)] + [1] * guess_set)
  longest = max(window - 1, levels if guess_set else 0)
  chain = np.pad(np.arange(window), (0, longest + 1 - window))
  pool = [np.pad(np.concatenate([[0], levels * window + g * levels + np.arange(levels)]),
                 (0, longest - levels)) for g in range(guess_set)]
  chains = np.full((offset.size, offset.max()), -1)
  for t, (l, k) in enumerate(zip(level, column)):  # level 0 up to column k, then column k's
    chains[t, :k + l] = [*range(1, k + 1), *(window * np.arange(1, l + 1) + k)]
  for t, (g, i) in enumerate(zip(candidate, index), start=levels * window):
    chains[t, :i + 1] = levels * window + g * levels + np.arange(i + 1)
  as_int32 = lambda a: np.asarray(a, np.int32)
  return FeedLayout(offset=as_int32(offset), segment=as_int32(segment),
                    parent=as_int32(parent), fork=as_int32(fork),
                    paths=as_int32(np.stack([chain, *pool])),
                    guesses=as_int32([window - 1] + [levels] * guess_set),
                    owner=as_int32([1] + [2 + columns + g for g in range(guess_set)]),
                    chains=as_int32(chains))


def same_grams(a: Int[Array, "... N"], b: Int[Array, "... N"]) -> Bool[Array, "..."]:
  """Whether n-grams `a` and `b` (broadcast) are equal, token by token: N compares, not a
  reduction over N (XLA:GPU fuses compares into what reads them; a reduction is a
  kernel of its own)."""
  return functools.reduce(jnp.logical_and, [a[..., i] == b[..., i] for i in range(a.shape[-1])])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramPool:
  """Per row, every distinct n-gram the window produced, where it was last produced:
  pass t's W n-grams are columns t*W .. t*W + W - 1 of `grams` int32[B, P, N], and
  `stamp` int32[B, P] is t, or -1 where empty, a repeat of an earlier column of its
  pass, or produced again by a later pass. The G most recent n-grams of a first
  token are the paper's pool (at most G per key, least recently produced dropped).
  A pass writes its own columns and clears the stamps of the n-grams it produces
  again by selects and compares over the row: no count of slots used, no scatter, no
  dynamic update slice (on a GPU 2 kernels with the n-grams' own, against 8 for a
  stamp refreshed in place and only new n-grams appended, and 3 for dynamic update
  slices: the loop's select that keeps a done state reads the slice they overwrite)."""

  grams: Int[Array, "B P N"]
  stamp: Int[Array, "B P"]

  @classmethod
  def empty(cls, batch: int, size: int, ngram_size: int) -> "NgramPool":
    return cls(grams=jnp.full((batch, size, ngram_size), -1, jnp.int32),
               stamp=jnp.full((batch, size), -1, jnp.int32))

  def candidates(self, first: Int[Array, "B"], num: int
                 ) -> tuple[Int[Array, "B G N-1"], Bool[Array, "B G"]]:
    """The `num` most recent n-grams starting with `first`, without it (zeros where
    there are fewer), and which exist."""
    recency = jnp.where(self.grams[..., 0] == first[:, None], self.stamp, -1)  # [B, P]
    best, index = jax.lax.top_k(recency, num)  # [B, G]
    grams = jnp.take_along_axis(self.grams, index[..., None], axis=1)  # [B, G, N]
    exists = best >= 0
    return jnp.where(exists[..., None], grams[..., 1:], 0), exists

  def add(self, grams: Int[Array, "B W N"], now: Int[Array, ""], live: Bool[Array, "B"]
          ) -> "NgramPool":
    """Each live row's `grams`, produced by pass `now`, into columns now*W .. now*W + W - 1.

    The caller sizes the pool: W columns for every pass.
    """
    batch, size, n = self.grams.shape
    width = grams.shape[1]
    again = jnp.zeros((batch, size), jnp.bool_)  # [B, P]: produced again by this pass
    repeated = jnp.zeros((batch, width), jnp.bool_)  # [B, W]: an earlier column's n-gram
    for w in range(width):
      again |= same_grams(self.grams, grams[:, w:w + 1])
      repeated |= same_grams(grams, grams[:, w:w + 1]) & (w < jnp.arange(width))
    stamp = jnp.where(live[:, None] & ~repeated, now, -1)  # [B, W]
    written = jnp.where(again & live[:, None], -1, self.stamp), self.grams  # [B, P], [B, P, N]
    column = jnp.arange(size) - now * width  # [P]: the pass's column w at w
    for w in range(width):
      here = column == w
      written = (jnp.where(here, stamp[:, w:w + 1], written[0]),
                 jnp.where(here[:, None], grams[:, w:w + 1], written[1]))
    return NgramPool(stamp=written[0], grams=written[1])


def slide(window: Int[Array, "B L W"], top: Int[Array, "B W"], shift: Int[Array, "B"]
          ) -> Int[Array, "B L W"]:
  """The next window: every level takes the one above it (the top level takes
  `top`, the argmax on top of each column), moved left by `shift` columns; the last
  column fills the vacated ones. Level 0, column 0 is overwritten by the next `c`.

  Level l, column k sits at p + k + l, so one level down is already one position
  on: with `shift` = the accepted level-0 guesses, every guess keeps its position
  relative to the next `c` (Jacobi decoding's update)::

      level 0    c  u1 u2 u3      argmax  u1 u2 z3 z4     (u1, u2 accepted: shift 2)
      next       c' z4 z4 z4      c' = z3, the target's token after u2
  """
  moved = jnp.concatenate([window[:, 1:], top[:, None]], axis=1)  # [B, L, W]
  width = window.shape[2]
  column = jnp.minimum(jnp.arange(width)[None, :] + shift[:, None], width - 1)  # [B, W]
  return jnp.take_along_axis(moved, column[:, None, :], axis=2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LookaheadState(DecodeState):
  """`DecodeState` (buffer rows R = B: one branch per row); no topology is carried:
  every pass builds its own (`FeedLayout.place`). L = N - 1 levels, W = `window`. c,
  the last emitted token (not yet cached), is the buffer's last (`last_emitted`), at
  position p = `first_pos` + the tokens emitted after the first (`next_pos`): a step
  updates few arrays (on a GPU each is a kernel or more): `passes` is None, the most
  passes a row ran (`passes_run`).

    first_pos               int32[B]            the position of the first emitted token
    window                  int32[B, L, W]      the Jacobi guesses (level 0, column 0:
                                                stale, overwritten by c each pass)
    pool                    NgramPool           [B, P, N] the n-grams the window produced
    accepted_length_counts  int32[B, 2, D + 1]  per row, its live passes by winner (0: the
                                                level-0 chain, 1: a pool candidate) and
                                                guesses accepted (the accepted guesses:
                                                their sum)
  """

  first_pos: Int[Array, "B"]
  window: Int[Array, "B L W"]
  pool: NgramPool
  accepted_length_counts: Int[Array, "B 2 D+1"]

  def passes_run(self) -> Int[Array, ""]:
    """Target passes after prefill: every pass is a live pass of the row that ran longest."""
    return self.accepted_length_counts.sum(axis=(1, 2)).max()

  @property
  def next_pos(self) -> Int[Array, "B"]:
    """c's position p (of a done row: past its last token, never fed)."""
    return self.first_pos + self.buffer.count - 1


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Lookahead(Strategy):
  """W = `window` columns (tokens per level, c included), N = `ngram`,
  G = `guess_set` candidates per pass (0, with N = 2 only: Jacobi decoding)."""

  name: ClassVar[str] = "lookahead"
  layout: ClassVar = prompt_layouts.Plain()
  done_rows_stay: ClassVar = True  # a done row takes no token and tallies no pass
  controls: ClassVar = CONTROL_OPTIONS

  window: int = 7
  ngram: int = 5
  guess_set: int = 7

  def __post_init__(self):
    check_count("window", self.window, 1)
    check_count("ngram", self.ngram, 2)
    check_count("guess_set", self.guess_set, 0 if self.ngram == 2 else 1)

  @property
  def plan(self) -> FeedLayout:
    return feed_layout(self.window, self.ngram, self.guess_set)

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, the generated tokens, and room for one whole pass."""
    return prompt_len + capacity + self.plan.offset.size

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> LookaheadState:
    batch = prompt.tokens.shape[0]
    logits, cache, _ = prefill(self.model, params, prompt, cache)  # [B, 1, V] (one branch)
    buffer = OutputBuffer.empty(batch, capacity, limits)
    logits = controls.process(logits, limits.controls,
                              controls.Context.plain(buffer.tokens, buffer.count), limits.eos_ids)
    first = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)  # [B]
    buffer, _ = emit(buffer, first[:, None], jnp.ones_like(first), limits,
                     Scored.requested(logits, first[:, None], limits))
    # at most `capacity` passes, each writing W n-grams: the pool never fills
    pool_size = self.window * capacity if self.guess_set else 0
    return LookaheadState(
        cache=cache, limits=limits, buffer=buffer, passes=None, first_pos=prompt.lengths,
        window=self._first_window(prompt), pool=NgramPool.empty(batch, pool_size, self.ngram),
        accepted_length_counts=jnp.zeros((batch, 2, self.plan.paths.shape[1]), jnp.int32))

  def _first_window(self, prompt: Prompt) -> Int[Array, "B L W"]:
    """Prompt tokens, cycled: any guesses keep the output exact."""
    levels = self.ngram - 1
    index = np.arange(levels)[:, None] + np.arange(self.window)[None, :]  # [L, W]
    index = index.reshape(1, -1) % prompt.lengths[:, None]  # [B, L * W]
    window = jnp.take_along_axis(prompt.tokens, index, axis=1)
    return window.reshape(-1, levels, self.window)

  def step(self, params, state: LookaheadState) -> LookaheadState:
    done, plan = state.buffer.done, self.plan
    last, next_pos = last_emitted(state.buffer), state.next_pos  # [B]
    window = state.window.at[:, 0, 0].set(last)  # [B, L, W]
    candidates, found = state.pool.candidates(last, self.guess_set)  # [B, G, N-1]
    tokens = jnp.concatenate([window.reshape(done.shape[0], -1),
                              candidates.reshape(done.shape[0], -1)], axis=1)  # [B, T]
    positions, segments, topology = plan.place(next_pos, done)  # [B, T]
    logits, _, cache = self.model(params, state.cache, tokens, positions, segments,
                                  topology)  # [B, T, V]
    logits = self._processed(logits, tokens, state)
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]
    accepted, winner, best = self._verify(tokens, choice, found)  # [B, C], [B], [B]
    emitted = jnp.take_along_axis(choice[:, plan.paths], winner[:, None, None],
                                  axis=1)[:, 0]  # [B, D + 1]: the argmax after c, then each guess
    scored = None
    if state.limits.controls is not None:  # the logits each emitted token was chosen from
      along = logits[jnp.arange(done.shape[0])[:, None], jnp.asarray(plan.paths)[winner]]
      scored = Scored.requested(along, emitted, state.limits)  # [B, D + 1]
    top, grams = self._columns(window, choice)  # [B, W], [B, W, N]
    pool = state.pool
    if self.guess_set:
      now = state.passes_run()
      ready = now >= self.ngram - 2  # every level above 0 holds argmax outputs
      pool = pool.add(grams, now, ~done & ready)
    return dataclasses.replace(
        self._tally(state, best, winner),
        buffer=emit(state.buffer, emitted, best + 1, state.limits, scored)[0],
        cache=self._commit(cache, winner, best, done),
        window=slide(window, top, accepted[:, 0]), pool=pool)

  def _processed(self, logits: Float[Array, "B T V"], tokens: Int[Array, "B T"],
                 state: LookaheadState) -> Float[Array, "B T V"]:
    """The pass's logits with the request's controls applied, each column with the
    generated text and its chain's fed tokens (`FeedLayout.chains`)."""
    limits = state.limits
    if limits.controls is None:
      return logits
    chains = self.plan.chains  # [T, E]
    path = jnp.where(chains >= 0, tokens[:, np.maximum(chains, 0)], -1)  # [B, T, E]
    path_len = jnp.broadcast_to(jnp.asarray(self.plan.offset), tokens.shape)  # [B, T]
    context = controls.Context(state.buffer.tokens, state.buffer.count, path, path_len)
    return controls.process(logits, limits.controls, context, limits.eos_ids)

  def _columns(self, window: Int[Array, "B L W"], choice: Int[Array, "B T"]
               ) -> tuple[Int[Array, "B W"], Int[Array, "B W N"]]:
    """The argmax on top of each column, and the column's n-gram: its tokens, then that."""
    levels = self.ngram - 1
    top = choice[:, (levels - 1) * self.window:levels * self.window]  # [B, W]
    return top, jnp.concatenate([window, top[:, None]], axis=1).transpose(0, 2, 1)

  def _tally(self, state: LookaheadState, best: Int[Array, "B"],
             winner: Int[Array, "B"]) -> LookaheadState:
    """The stats, over the rows this pass decoded."""
    live = ~state.buffer.done
    lengths = self.plan.paths.shape[1]
    counts = jax.nn.one_hot((winner > 0) * lengths + best, 2 * lengths,
                            dtype=jnp.int32) * live[:, None]  # [B, 2 (D + 1)]
    return dataclasses.replace(state, accepted_length_counts=state.accepted_length_counts
                               + counts.reshape(-1, 2, lengths))

  def _verify(self, tokens: Int[Array, "B T"], choice: Int[Array, "B T"], found: Bool[Array, "B G"]
              ) -> tuple[Int[Array, "B C"], Int[Array, "B"], Int[Array, "B"]]:
    """Accepted guesses of every candidate, the winner (the first longest) and its
    accepted guesses: C selects, not an argmax, which XLA:GPU fuses into what reads them
    (a reduction's output is a kernel of its own; `greedy_accept` is elementwise too)."""
    paths = self.plan.paths  # [C, D + 1]
    batch, (num, longest) = tokens.shape[0], paths.shape
    exists = jnp.concatenate([jnp.ones((batch, 1), jnp.bool_), found], axis=1)  # [B, C]
    count = jnp.where(exists, jnp.asarray(self.plan.guesses), 0)  # [B, C]
    accepted = greedy_accept(tokens[:, paths[:, 1:]].reshape(batch * num, longest - 1),
                             count.reshape(-1),
                             choice[:, paths].reshape(batch * num, longest)).reshape(batch, num)
    winner, best = jnp.zeros((batch,), jnp.int32), accepted[:, 0]
    for c in range(1, num):
      longer = accepted[:, c] > best
      winner, best = jnp.where(longer, c, winner), jnp.where(longer, accepted[:, c], best)
    return accepted, winner, best

  def _commit(self, cache: KVCache, winner: Int[Array, "B"], accepted: Int[Array, "B"],
              done: Bool[Array, "B"]) -> KVCache:
    """Keeps c and the winner's accepted guesses, in order, right after the text: the
    fed slots of the winner's path (`FeedLayout.paths`) move there.

    The text's length is read from the pass's cache (a live row's pass took T slots, a
    done row's none), not from the cache before it: on a GPU the length before, read
    after the pass wrote the new one in place, is a copy kept for the purpose.

    Without a pool (Jacobi) the winner is the level-0 chain, fed first: what it keeps
    is already in place, and the rollback alone drops the rest (no slot moves)."""
    plan = self.plan
    cached = cache.length - jnp.where(done, 0, plan.offset.size)  # [B]
    keep = jnp.asarray(plan.owner)[winner]  # [B] the winner's segment joins segment 0
    segment = jnp.arange(plan.parent.size)[None, :]  # [1, S]
    cache = cache_ops.remap_segments(
        cache, jnp.where((segment == 0) | (segment == keep[:, None]), 0, -1))
    kept = jnp.where(done, 0, 1 + accepted)  # [B] c and the accepted guesses
    if not self.guess_set:
      return cache_ops.rollback(cache, cached + kept)
    path = jnp.asarray(plan.paths)[winner]  # [B, D + 1] fed index of c, then the guesses
    return cache_ops.move_slots(cache, cached, cached[:, None] + path, kept)

  def result(self, state: LookaheadState):
    by_winner = state.accepted_length_counts.sum(axis=0)  # [2, D + 1]
    counts = by_winner.sum(axis=0)  # [D + 1] row-passes by guesses accepted
    guesses = jnp.arange(counts.shape[0])
    accepted = (guesses * counts).sum()
    return state.buffer, {
        "target_passes": state.passes_run(), "accepted": accepted,
        "accepted_from_pool": (guesses * by_winner[1]).sum(), "accepted_length_counts": counts,
        "mean_accepted_length": accepted / jnp.maximum(counts.sum(), 1)}


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Jacobi(Lookahead):
  """Jacobi decoding: one level of W guesses refined in parallel, no pool (see the
  module docstring); `window` is its only option."""

  name: ClassVar[str] = "jacobi"

  ngram: int = internal(2)
  guess_set: int = internal(0)
