"""`entropy_branching`: fork where the model is unsure, explore, keep the best branch.

entropix-style. Decoding is greedy until the next-token distribution's entropy and
varentropy (nats) both exceed their thresholds. There the row forks `num_branches`
branches, one per top-k token, continues each greedily until it holds
`branch_tokens` tokens (all branches advance in the same passes), keeps the branch
with the highest summed log-probability, and carries on greedily from its end.

Branch b is segment b + 1, forked from the main segment 0 at the fork position, so
every branch sees the committed text and its own tokens only — each is exactly what
greedy decoding of that branch alone would produce. When the exploration ends the
winner's slots become segment 0, the others die, and `compact` closes the gap::

    fork at position p (top-3: x y z), branch_tokens = 3:
    slot  ... c | x y z | x' y' z'        seg ... 0 | 1 2 3 | 1 2 3
    pos   ... p-1| p p p | p+1 p+1 p+1    (x'' y'' z'' chosen, not yet fed)
    keep y:     ... c | y y'              seg ... 0 | 0 0      emit y y' y''

Every pass feeds `num_branches` tokens per row; a row decoding linearly uses one of
them (the others are padding and take no slot).

The request's controls (`mdjax.controls`) process every distribution it reads: the
linear token's (after the generated text), a branch's (after the generated text and
the branch's own tokens). So the argmax, the entropy that decides a fork, the top-k a
fork branches on and the scores that pick the winner are all of the processed
distribution, and an emitted token's log-probability is the one it was chosen with.
Where it never forks it is greedy with the same controls.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mdjax import cache as cache_ops
from mdjax import controls, platform
from mdjax.cache import KVCache
from mdjax.controls import CONTROL_OPTIONS
from mdjax.errors import check_count, check_real
from mdjax.sampling import log_softmax
from mdjax.strategies import prompt_layouts
from mdjax.strategies.base import (DecodeState, Limits, OutputBuffer, Prompt, Scored, Strategy,
                                   emit, last_emitted, prefill)
from mdjax.strategies.registry import register
from mdjax.topology import Topology


def entropy_varentropy(logits: Float[Array, "... V"]) -> tuple[Float[Array, "..."],
                                                               Float[Array, "..."]]:
  """Entropy H = -sum p log p and varentropy sum p (log p + H)^2 of softmax(logits), nats."""
  return _entropy_varentropy(log_softmax(logits))


def _entropy_varentropy(logp: Float[Array, "... V"], removed: bool = False
                        ) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
  """`entropy_varentropy` from the log-probabilities; `removed`: some may be -inf (a
  token the controls removed), which add nothing (not 0 x inf)."""
  p = jnp.exp(logp)
  if removed:
    logp = jnp.where(p > 0, logp, 0.0)
  entropy = -(p * logp).sum(-1)
  return entropy, (p * (logp + entropy[..., None]) ** 2).sum(-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class EntropyState(DecodeState):
  """`DecodeState` (its cache: the text as segment 0, then an exploration's branches;
  buffer rows R = B; `passes` None: in `tallies`, per row: no sum over the rows, and on a
  GPU its update shares the branch scores' kernel) with k = num_branches, m =
  branch_tokens. No topology is carried: each pass derives it from `next_pos` (the fork
  position of an exploring row). A step updates few arrays (on a GPU each is a kernel
  or more): what a row feeds next is read from the buffer (`last`) or the branches'
  tokens (`branch_last`), and its position from the buffer's count (`next_pos`).

    first_pos      int32[B]         the position of the first generated token
    exploring      int32[B]         tokens each branch holds (1..m-1); 0: decoding linearly
    fork_slot      int32[B]         the exploration's first slot (where compaction starts)
    branch_tokens  int32[B, k, m]   each branch's tokens so far
    branch_score   float32[B, k]    each branch's summed log-probability
    branch_scored  Scored [B, k, m] each branch token's log-probability (and the K best
                                    there), where the request asks for them; else None
    tallies        int32[B, 2]      per row, its live passes after prefill (the most: the
                                    target's passes) and the explorations it started
  """

  first_pos: Int[Array, "B"]
  exploring: Int[Array, "B"]
  fork_slot: Int[Array, "B"]
  branch_tokens: Int[Array, "B k m"]
  branch_score: Float[Array, "B k"]
  branch_scored: Scored | None
  tallies: Int[Array, "B 2"]

  @property
  def last(self) -> Int[Array, "B"]:
    """A linear row's last committed token: what it feeds next."""
    return last_emitted(self.buffer)

  @property
  def next_pos(self) -> Int[Array, "B"]:
    """The position `last` is fed at; of an exploring row, the fork position (its
    branches' first tokens): after the last committed token."""
    return self.first_pos + self.buffer.count - (self.exploring == 0)

  @property
  def branch_last(self) -> Int[Array, "B k"]:
    """An exploring row's branches' last tokens: what they feed next."""
    last = jnp.maximum(self.exploring - 1, 0)[:, None, None]  # [B, 1, 1]
    return jnp.take_along_axis(self.branch_tokens, last, axis=2)[..., 0]


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class EntropyBranching(Strategy):
  """Greedy, with a `num_branches`-way exploration of `branch_tokens` tokens wherever
  the next token's entropy and varentropy exceed `branch_entropy` and `branch_varentropy`."""

  name: ClassVar[str] = "entropy_branching"
  layout: ClassVar = prompt_layouts.Plain()
  controls: ClassVar = CONTROL_OPTIONS

  num_branches: int = 3
  branch_tokens: int = 4
  branch_entropy: float = 2.0
  branch_varentropy: float = 0.0

  def __post_init__(self):
    check_count("num_branches", self.num_branches, 1)
    check_count("branch_tokens", self.branch_tokens, 1)
    check_real("branch_entropy", self.branch_entropy, minimum=0)
    check_real("branch_varentropy", self.branch_varentropy, minimum=0)

  @property
  def exploration_slots(self) -> int:
    """Cache slots one exploration fills before compaction (the last tokens are not fed)."""
    return self.num_branches * (self.branch_tokens - 1)

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    return prompt_len + capacity + self.exploration_slots + self.num_branches

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> EntropyState:
    batch, k = prompt.tokens.shape[0], self.num_branches
    logits, cache, _ = prefill(self.model, params, prompt, cache)
    zeros = jnp.zeros((batch,), jnp.int32)
    top = -1 if limits.controls is None else limits.controls.logprobs
    scored = None
    if top >= 0:
      shape = (batch, k, self.branch_tokens)
      scored = Scored(jnp.zeros(shape, jnp.float32),
                      jnp.zeros(shape + (top,), jnp.int32) if top else None,
                      jnp.zeros(shape + (top,), jnp.float32) if top else None)
    state = EntropyState(cache=cache, limits=limits,
                         buffer=OutputBuffer.empty(batch, capacity, limits), passes=None,
                         first_pos=prompt.lengths, exploring=zeros, fork_slot=zeros,
                         branch_tokens=jnp.zeros((batch, k, self.branch_tokens), jnp.int32),
                         branch_score=jnp.zeros((batch, k), jnp.float32), branch_scored=scored,
                         tallies=jnp.zeros((batch, 2), jnp.int32))
    logits = self._processed(logits, state)
    logp = log_softmax(logits)  # [B, 1, V]
    token, top = self._choices(logits, logp)
    return self._after_main(state, logp, token[:, 0], top, jnp.ones((batch,), jnp.bool_))

  def step(self, params, state: EntropyState) -> EntropyState:
    done, exploring = state.buffer.done, state.exploring > 0  # [B]
    k = self.num_branches
    column = jnp.arange(k)[None, :]
    # linear rows feed `last` in column 0 (segment 0); exploring rows feed every branch
    tokens = jnp.where(exploring[:, None], state.branch_last, state.last[:, None])
    segments = jnp.where(exploring[:, None], column + 1, jnp.where(column == 0, 0, -1))
    segments = jnp.where(done[:, None], -1, segments)
    depth = state.exploring  # tokens each branch holds (1..branch_tokens-1 while exploring)
    positions = jnp.broadcast_to((state.next_pos + jnp.maximum(depth - 1, 0))[:, None],
                                 tokens.shape)
    fork_pos = state.next_pos  # of an exploring row: its branches' first tokens
    logits, _, cache = self.model(params, state.cache, tokens, positions, segments,
                                  Topology.fan(fork_pos, k))  # [B, k, V]
    logits = self._processed(logits, state)
    state = dataclasses.replace(state, cache=cache,
                                tallies=state.tallies + jnp.stack([~done, jnp.zeros_like(done)], 1))
    # one log-softmax and the choices over every column (on a GPU, each a few kernels):
    # column 0 is a linear row's
    logp = log_softmax(logits)  # [B, k, V]
    token, top = self._choices(logits, logp)  # [B, k], ([B, k], [B, k])
    linear = ~exploring & ~done
    state = self._after_main(state, logp, token[:, 0], top, linear)
    return self._after_branches(state, logp, token, exploring & ~done)

  def _processed(self, logits: Float[Array, "B C V"], state: EntropyState
                 ) -> Float[Array, "B C V"]:
    """The logits with the request's controls applied: column c after the generated
    text, then (an exploring row's) branch c's tokens so far; a linear row's column 0
    after the generated text alone."""
    limits = state.limits
    if limits.controls is None:
      return logits
    columns, depth = logits.shape[1], state.exploring  # [B]: 0 for a linear row
    held = jnp.arange(self.branch_tokens) < depth[:, None, None]  # [B, 1, m]
    path = jnp.where(held, state.branch_tokens, -1)[:, :columns]  # [B, C, m]
    context = controls.Context(state.buffer.tokens, state.buffer.count, path,
                               jnp.broadcast_to(depth[:, None], path.shape[:2]))
    return controls.process(logits, limits.controls, context, limits.eos_ids)

  def _choices(self, logits: Float[Array, "B C V"], logp: Float[Array, "B C V"]
               ) -> tuple[Int[Array, "B C"], tuple[Float[Array, "B k"], Int[Array, "B k"]]]:
    """Each column's argmax, and column 0's k most likely tokens, most likely first, with
    their log-probabilities (a fork's branches). On a GPU both from one top-k of the
    logits over every column (an argmax beside it is 2 kernels more; ties: the lower
    token, as argmax and a stable sort); XLA:CPU runs that ~20% slower than an argmax
    and column 0's top-k of its log-probabilities (a 1-prompt generation), and those
    ~5% faster than a top-k of column 0's logits."""
    k = self.num_branches
    if platform.current() == "gpu":
      top = jax.lax.top_k(logits, k)[1].astype(jnp.int32)  # [B, C, k]
      return top[..., 0], (jnp.take_along_axis(logp[:, 0], top[:, 0], axis=1), top[:, 0])
    top_logp, top = jax.lax.top_k(logp[:, 0], k)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), (top_logp, top.astype(jnp.int32))

  def _after_main(self, state: EntropyState, logp: Float[Array, "B C V"], token: Int[Array, "B"],
                  top: tuple[Float[Array, "B k"], Int[Array, "B k"]], rows: Bool[Array, "B"]
                  ) -> EntropyState:
    """Rows `rows` got the log-probabilities after their last committed token (column
    0 of the C fed; their argmax `token` and k most likely tokens with their
    log-probabilities, `top`): emit it, or fork there when the distribution is uncertain
    enough.

    On a GPU the entropies are reduced over every column, then column 0 taken: the
    reductions of a column's slice read it from a product of its own (2 kernels more).
    XLA:CPU runs the slice's alone (C times less work)."""
    columns = logp if platform.current() == "gpu" else logp[:, :1]
    removed = state.limits.controls is not None and state.limits.controls.processes
    entropy, varentropy = (h[:, 0] for h in _entropy_varentropy(columns, removed))  # [B]
    fork = rows & (entropy > self.branch_entropy) & (varentropy > self.branch_varentropy)
    if self.num_branches == 1 or self.branch_tokens == 1:
      fork = jnp.zeros_like(fork)
    buffer, _ = emit(state.buffer, token[:, None], (rows & ~fork).astype(jnp.int32),
                     state.limits, _scored(logp[:, :1], token[:, None], state.limits))
    top_logp, top = top  # [B, k]
    fed = state.cache.length  # the main token was just written: branches start here
    fork_scored = lambda: _scored(  # every branch's first token: column 0's top-k
        jnp.broadcast_to(logp[:, :1], top.shape + logp.shape[-1:]), top, state.limits)
    return dataclasses.replace(
        state, buffer=buffer, exploring=jnp.where(fork, 1, state.exploring),
        fork_slot=jnp.where(fork, fed, state.fork_slot),
        branch_tokens=jnp.where(fork[:, None, None], state.branch_tokens.at[:, :, 0].set(top),
                                state.branch_tokens),
        branch_score=jnp.where(fork[:, None], top_logp, state.branch_score),
        branch_scored=_record(state.branch_scored, fork_scored, fork,
                              jnp.zeros_like(state.exploring)),
        tallies=state.tallies + jnp.stack([jnp.zeros_like(fork), fork], 1))

  def _after_branches(self, state: EntropyState, logp: Float[Array, "B k V"],
                      token: Int[Array, "B k"], rows: Bool[Array, "B"]) -> EntropyState:
    """Exploring rows extend every branch by its argmax `token`; a row whose branches
    are complete keeps the best one, compacts its cache and emits its tokens."""
    depth = state.exploring  # tokens each branch holds before this pass
    token_logp = jnp.take_along_axis(logp, token[..., None], axis=-1)[..., 0]
    slot = jnp.arange(self.branch_tokens)[None, None, :] == depth[:, None, None]
    branch_tokens = jnp.where(rows[:, None, None] & slot, token[..., None], state.branch_tokens)
    score = state.branch_score + jnp.where(rows[:, None], token_logp, 0.0)
    depth = jnp.where(rows, depth + 1, depth)
    finished = rows & (depth == self.branch_tokens)
    best = jnp.argmax(score, axis=1).astype(jnp.int32)  # [B]
    winning = lambda x: jnp.take_along_axis(x, best.reshape((-1,) + (1,) * (x.ndim - 1)),
                                            axis=1)[:, 0]
    scored = _record(state.branch_scored, lambda: _scored(logp, token, state.limits), rows,
                     state.exploring)
    buffer, _ = emit(state.buffer, winning(branch_tokens), finished * self.branch_tokens,
                     state.limits, None if scored is None else jax.tree.map(winning, scored))
    cache = self._keep_branch(state.cache, finished, best, state.fork_slot)
    return dataclasses.replace(
        state, cache=cache, buffer=buffer, branch_tokens=branch_tokens, branch_score=score,
        branch_scored=scored, exploring=jnp.where(finished, 0, depth))

  def _keep_branch(self, cache: KVCache, finished: Bool[Array, "B"], best: Int[Array, "B"],
                   fork_slot: Int[Array, "B"]) -> KVCache:
    """Rows `finished`: the best branch's slots become segment 0, the others die, and
    the exploration window is compacted (the committed prefix is never moved)."""
    segment = jnp.arange(self.num_branches + 1)[None, :]
    mapping = jnp.where(segment == 0, 0, jnp.where(segment == best[:, None] + 1, 0, -1))
    mapping = jnp.where(finished[:, None], mapping, segment).astype(jnp.int32)
    start = jnp.where(finished, fork_slot, cache.length)
    return cache_ops.compact(cache_ops.remap_segments(cache, mapping), start,
                             self.exploration_slots)

  def result(self, state: EntropyState) -> tuple[OutputBuffer, dict]:
    return state.buffer, {"target_passes": state.tallies[:, 0].max(),
                          "forks": state.tallies[:, 1].sum()}


def _scored(logp: Float[Array, "B C V"], tokens: Int[Array, "B C"], limits: Limits
            ) -> Scored | None:
  """The log-probabilities of `tokens` (and the K best) where the request asks for them."""
  if limits.controls is None or limits.controls.logprobs < 0:
    return None
  return Scored.of(logp, tokens, limits.controls.logprobs)  # a log-softmax keeps log-probs


def _record(stored: Scored | None, new, rows: Bool[Array, "B"], at: Int[Array, "B"]
            ) -> Scored | None:
  """`stored` [B, k, m] with `new()` [B, k] written at each of `rows`' branch position
  `at` (None: the request asks for no log-probabilities)."""
  if stored is None:
    return None
  here = rows[:, None] & (jnp.arange(stored.logprobs.shape[2]) == at[:, None])  # [B, m]

  def put(old, value):  # old [B, k, m, ...], value [B, k, ...]
    mask = jnp.expand_dims(here[:, None], tuple(range(3, old.ndim)))  # [B, 1, m, 1...]
    return jnp.where(mask, jnp.expand_dims(value, 2), old)

  return jax.tree.map(put, stored, new())
