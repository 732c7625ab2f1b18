"""`prompt_lookup`: draft tokens copied from the text itself, verified in one pass.

Each step, every row looks for the latest earlier occurrence of its last `n` tokens
(n = max_ngram_size ... 1) in prompt + generated text and proposes the (up to)
`prompt_lookup_num_tokens` tokens that followed it. The target model scores the last
emitted token and the proposal in one pass (a chain in the row's own segment);
greedy acceptance keeps the target's argmax up to and including its first
disagreement with the proposal, so the output is exactly greedy decoding's. The
rejected tokens are marked dead and compacted out of the cache. Rows accept
different lengths.

With branches (`questions=`, as `multi_question`), every branch looks up in what it
sees (the context and its own question and answer) and feeds its own chain in its
own segment: all branches of all rows are verified in the same pass.

One row, last emitted token `c` (not yet cached), proposal `d e f`::

    feed     c  d  e  f           positions p .. p+3, segment 0
    argmax   d  e  x  .           -> emit d e x; cache keeps c d e; `f` rolled back
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.errors import check_count
from mdjax.sampling import greedy_accept
from mdjax.strategies import metadata, prompt_layouts
from mdjax.strategies.base import (DecodeState, Limits, OutputBuffer, Prompt, Strategy,
                                   decode_chains, emit, prefill)
from mdjax.strategies.registry import register
from mdjax.topology import Topology


def latest_ngram_continuation(history: Int[Array, "B H"], length: Int[Array, "B"], ngram: int,
                              num_tokens: int) -> tuple[Int[Array, "B D"], Int[Array, "B"]]:
  """The tokens after the latest earlier occurrence of each row's last `ngram` tokens.

  Returns the proposal `[B, num_tokens]` and how many of its tokens are real (0 when
  the n-gram does not occur earlier, or the row is shorter than `ngram + 1`).
  """
  width = history.shape[1]
  suffix = jnp.take_along_axis(
      history, jnp.clip(length[:, None] - ngram + jnp.arange(ngram), 0, width - 1), axis=1)
  padded = jnp.pad(history, ((0, 0), (0, ngram)), constant_values=-1)  # [B, H + n]
  match = jnp.ones(history.shape, jnp.bool_)
  for k in range(ngram):
    match &= padded[:, k:k + width] == suffix[:, k:k + 1]  # [B, H]: window j matches at k
  start = jnp.arange(width)[None, :]  # window start j
  match &= start < length[:, None] - ngram  # earlier than the suffix itself, with a follower
  latest = jnp.max(jnp.where(match, start, -1), axis=1)  # [B]
  follow = latest + ngram  # [B] first proposed index
  index = jnp.clip(follow[:, None] + jnp.arange(num_tokens), 0, width - 1)
  count = jnp.where(latest >= 0, jnp.minimum(num_tokens, length - follow), 0)
  return jnp.take_along_axis(history, index, axis=1), count.astype(jnp.int32)


def branch_histories(prompt: Prompt, extra: int) -> tuple[Int[Array, "R H"], Int[Array, "R"]]:
  """Per branch (R = B * N rows), the tokens it sees — the context, then its own
  question — left-aligned in `[R, P + extra]`, and how many there are."""
  seg = prompt.segments[:, None, :]  # [B, 1, P]
  sees = (seg == 0) | (seg == prompt.branch_segment[..., None])  # [B, N, P]
  order = jnp.argsort(~sees, axis=-1, stable=True)  # seen slots first, in slot order
  tokens = jnp.take_along_axis(jnp.broadcast_to(prompt.tokens[:, None], sees.shape), order, -1)
  rows = sees.shape[0] * sees.shape[1]
  history = jnp.pad(tokens.reshape(rows, -1), ((0, 0), (0, extra)))
  return history, sees.sum(-1, dtype=jnp.int32).reshape(rows)


def _kill_fed(cache: KVCache, cached: Int[Array, "B"], active: Bool[Array, "R F"],
              dead: Bool[Array, "R F"], batch: int) -> KVCache:
  """Marks dead the slots `claim_slots` gave the fed tokens flagged `dead` (the fed
  tokens of a row took consecutive slots from `cached`, in feed order)."""
  active, dead = active.reshape(batch, -1), dead.reshape(batch, -1)  # [B, N F]
  slot = cached[:, None] + jnp.cumsum(active, axis=1) - 1
  slot = jnp.where(dead, slot, cache.num_slots)  # the others are left alone (dropped write)
  return cache.replace(seg=cache.seg.at[jnp.arange(batch)[:, None], slot].set(-1, mode="drop"))


def propose_by_lookup(history, length, max_ngram_size: int, num_tokens: int):
  """The longest n-gram (max_ngram_size ... 1) that occurs earlier decides the proposal."""
  proposal = jnp.zeros((history.shape[0], num_tokens), jnp.int32)
  count = jnp.zeros((history.shape[0],), jnp.int32)
  for ngram in range(1, max_ngram_size + 1):  # longer n-grams override shorter ones
    found, found_count = latest_ngram_continuation(history, length, ngram, num_tokens)
    proposal = jnp.where((found_count > 0)[:, None], found, proposal)
    count = jnp.where(found_count > 0, found_count, count)
  return proposal, count


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLookupState(DecodeState):
  """`DecodeState` (buffer rows R = B * N: row b * N + j is branch j of row b), and

    topology        Topology [B, G]  the prompt's segment tree
    history         int32[R, H]   what branch r sees, left-aligned: the context, its own
                                  question, then its answer (`branch_histories`)
    length          int32[R]      tokens in `history`; the last one is not yet cached
    branch_segment  int32[R]      the segment branch r decodes in (-1: no such branch)
    drafted         int32[]       proposed tokens over all passes, live branches only
    accepted        int32[]       of those, the ones the target kept
    columns_fed     int32[]       columns fed over all passes (R x the pass's width)
    metadata        TokenMetadata [R, N]  per emitted token, with return_metadata; else None
  """

  topology: Topology
  history: Int[Array, "R H"]
  length: Int[Array, "R"]
  branch_segment: Int[Array, "R"]
  drafted: Int[Array, ""]
  accepted: Int[Array, ""]
  columns_fed: Int[Array, ""]
  metadata: metadata.TokenMetadata | None


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLookup(Strategy):
  """Proposals of up to `prompt_lookup_num_tokens` tokens, after the latest earlier
  occurrence of the last n-gram (n = `max_ngram_size` ... 1)."""

  name: ClassVar[str] = "prompt_lookup"
  layout: ClassVar = prompt_layouts.Questions(required=False)

  prompt_lookup_num_tokens: int = 10
  max_ngram_size: int = 2
  return_metadata: bool = False  # per-token metadata (`mdjax.strategies.metadata`)

  def __post_init__(self):
    check_count("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens, 1)
    check_count("max_ngram_size", self.max_ngram_size, 1)

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, every branch's generated tokens, and one proposal per branch
    before the rejected ones are compacted away."""
    return prompt_len + (capacity + self.prompt_lookup_num_tokens + 1) * branches

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> PromptLookupState:
    logits, cache, topology = prefill(self.model, params, prompt, cache)
    rows = prompt.branch_segment.size  # R = B * N: one output row per branch
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(rows)  # [R]
    absent = (prompt.branch_segment < 0).reshape(rows)
    buffer = dataclasses.replace(OutputBuffer.empty(rows, capacity), done=absent)
    buffer, _ = emit(buffer, first[:, None], jnp.ones_like(first), limits)
    history, length = branch_histories(prompt, capacity + self.prompt_lookup_num_tokens + 1)
    history = history.at[jnp.arange(rows), length].set(first)
    zero = jnp.zeros((), jnp.int32)
    token_metadata = None
    if self.return_metadata:
      token_metadata = metadata.first(capacity, jax.nn.softmax(logits, axis=-1).reshape(
          rows, -1), first)
    return PromptLookupState(
        cache=cache, topology=topology, limits=limits, buffer=buffer, passes=zero,
        history=history, length=length + 1, branch_segment=prompt.branch_segment.reshape(rows),
        drafted=zero, accepted=zero, columns_fed=zero, metadata=token_metadata)

  def step(self, params, state: PromptLookupState) -> PromptLookupState:
    history, length, buffer = state.history, state.length, state.buffer
    rows, width = history.shape[0], self.prompt_lookup_num_tokens + 1
    batch = state.cache.length.shape[0]
    proposal, count = propose_by_lookup(history, length, self.max_ngram_size,
                                        self.prompt_lookup_num_tokens)
    count = jnp.where(buffer.done, 0, count)
    last = jnp.take_along_axis(history, (length - 1)[:, None], axis=1)  # [R, 1] not yet cached
    tokens = jnp.concatenate([last, proposal], axis=1)  # [R, 1 + D]
    offsets = jnp.arange(width)[None, :]
    active = (offsets <= count[:, None]) & ~buffer.done[:, None]  # [R, 1 + D]
    segments = jnp.where(active, state.branch_segment[:, None], -1)
    cached = state.cache.length
    logits, cache, fed = decode_chains(
        self.model, params, state.cache, tokens.reshape(batch, -1, width),
        ((length - 1)[:, None] + offsets).reshape(batch, -1, width),
        segments.reshape(batch, -1, width), state.topology)  # [B, N, 1 + D, V]
    logits = logits.reshape(rows, width, -1)
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R, 1 + D]
    accepted = greedy_accept(proposal, count, choice)  # [R]
    buffer, taken = emit(buffer, choice, accepted + 1, state.limits)
    token_metadata = state.metadata
    if self.return_metadata:
      token_metadata = token_metadata.record(
          state.buffer.count, taken,
          *metadata.verified(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), choice,
                             proposal, count, accepted))
    emitted = taken.sum(axis=1, dtype=jnp.int32)
    history = history.at[jnp.arange(rows)[:, None],
                         jnp.where(taken, length[:, None] + offsets, history.shape[1])].set(
        choice, mode="drop")
    # keep each branch's fed last token and its accepted proposal; compact out the rest
    rejected = active & (offsets > accepted[:, None])
    cache = cache_ops.compact(_kill_fed(cache, cached, active, rejected, batch), cached,
                              rows // batch * width)
    live = ~state.buffer.done
    return dataclasses.replace(
        state, cache=cache, buffer=buffer, history=history, length=length + emitted,
        passes=state.passes + 1, columns_fed=state.columns_fed + rows * fed,
        drafted=state.drafted + jnp.where(live, count, 0).sum(),
        accepted=state.accepted + jnp.where(live, accepted, 0).sum(), metadata=token_metadata)

  def result(self, state: PromptLookupState):
    buffer, stats = super().result(state)
    stats |= {"drafted": state.drafted, "accepted": state.accepted,
              "columns_fed": state.columns_fed}
    if state.metadata is not None:
      stats["metadata"] = state.metadata
    return buffer, stats
