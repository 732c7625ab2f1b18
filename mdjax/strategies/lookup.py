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

The request's controls (`mdjax.controls`) apply to every verified column with the text
it continues: the generated text, then the proposal's tokens before it. The argmax is
then greedy's with the same controls, a proposal that repeats a banned n-gram or brings
EOS before `min_new_tokens` is cut where greedy would not take it, and a proposal that
completes a stop string ends there (`emit`). Lookup itself reads the raw text: what it
proposes only changes the speed.

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
from mdjax import controls, platform
from mdjax.cache import KVCache
from mdjax.controls import CONTROL_OPTIONS
from mdjax.errors import check_count
from mdjax.sampling import greedy_accept
from mdjax.strategies import metadata, prompt_layouts
from mdjax.strategies.base import (DecodeState, Limits, OutputBuffer, Prompt, Scored, Strategy,
                                   emit, prefill)
from mdjax.strategies.registry import register
from mdjax.strategies.widths import decode_chains
from mdjax.topology import Topology


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


def lookup_matches(history: Int[Array, "B H"], length: Int[Array, "B"], max_ngram_size: int,
                   num_tokens: int, num_matches: int = 1
                   ) -> tuple[Int[Array, "B M D"], Int[Array, "B M"]]:
  """Up to `num_matches` proposals per row: the `num_tokens` tokens after an earlier
  occurrence of the row's last n tokens, the longest n (`max_ngram_size` ... 1) first,
  the latest occurrence first among equal n, each continuation distinct from those
  before it (a continuation cut short by the end of the text compares as its tokens
  only). Returns the proposals `[B, M, D]` and how many tokens of each are real (0: no
  such match)::

      history   a b c a b d . . a b      (length 10, last bigram `a b`)
      follower  .  .  c  .  .  d         followers 2 and 5 follow `a b`
      proposals d . . a b |  c a b d .    (latest first; D = 5)
  """
  rows, width = history.shape
  follow = jnp.arange(width)[None, :]  # [1, H] the index a proposal starts at
  last = lambda k: jnp.take_along_axis(history, jnp.maximum(length - k, 0)[:, None], axis=1)
  matched = jnp.ones((rows, width), jnp.bool_)
  ngram = jnp.zeros((rows, width), jnp.int32)  # [B, H] the longest n-gram ending before f
  for k in range(1, max_ngram_size + 1):
    before = jnp.pad(history, ((0, 0), (k, 0)), constant_values=-1)[:, :width]  # [B, H] h[f-k]
    matched &= (before == last(k)) & (follow >= k) & (length[:, None] >= k)
    ngram += matched
  ngram = jnp.where(follow < length[:, None], ngram, 0)  # the suffix itself has no follower
  index = jnp.clip(follow[..., None] + jnp.arange(num_tokens), 0, width - 1)  # [1, H, D]
  count = jnp.clip(length[:, None] - follow, 0, num_tokens)  # [B, H]
  continuation = jnp.where(jnp.arange(num_tokens) < count[..., None],
                           history[jnp.arange(rows)[:, None, None], index], -1)  # [B, H, D]
  priority = jnp.where(ngram > 0, ngram * width + follow, -1)  # [B, H]
  proposals, counts = [], []
  for _ in range(num_matches):
    best = jnp.argmax(priority, axis=1)  # [B]
    found = jnp.take_along_axis(priority, best[:, None], axis=1)[:, 0] >= 0
    chosen = jnp.take_along_axis(continuation, best[:, None, None], axis=1)  # [B, 1, D]
    proposals.append(jnp.maximum(chosen[:, 0], 0))
    counts.append(jnp.where(found, jnp.take_along_axis(count, best[:, None], axis=1)[:, 0], 0))
    priority = jnp.where((continuation == chosen).all(axis=-1), -1, priority)
  return jnp.stack(proposals, axis=1), jnp.stack(counts, axis=1).astype(jnp.int32)


def propose_by_lookup(history, length, max_ngram_size: int, num_tokens: int):
  """The proposal after the latest earlier occurrence of the longest n-gram
  (`lookup_matches`' first)."""
  proposals, counts = lookup_matches(history, length, max_ngram_size, num_tokens)
  return proposals[:, 0], counts[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLookupState(DecodeState):
  """`DecodeState` (buffer rows R = B * N: row b * N + j is branch j of row b; `passes`
  None: they are the most a branch ran, in `tallies`, so a step updates one array fewer:
  on a GPU each is a kernel or more), and

    topology        Topology [B, G]  the prompt's segment tree
    history         int32[R, H]   what branch r sees, left-aligned: the context, its own
                                  question, then its answer (`branch_histories`)
    length          int32[R]      tokens in `history`; the last one is not yet cached
    branch_segment  int32[R]      the segment branch r decodes in (-1: no such branch)
    tallies         int32[R, 3]   per branch, over its live passes: passes, proposed
                                  tokens, and of those the ones the target kept
    columns_fed     int32[]       columns fed over all passes (R x the pass's width); None
                                  where every pass is the whole width (`run_narrowest` off
                                  the CPU): passes x R x (1 + prompt_lookup_num_tokens)
    metadata        TokenMetadata [R, N]  per emitted token, with return_metadata; else None
  """

  topology: Topology
  history: Int[Array, "R H"]
  length: Int[Array, "R"]
  branch_segment: Int[Array, "R"]
  tallies: Int[Array, "R 3"]
  columns_fed: Int[Array, ""] | None
  metadata: metadata.TokenMetadata | None


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLookup(Strategy):
  """Proposals of up to `prompt_lookup_num_tokens` tokens, after the latest earlier
  occurrence of the last n-gram (n = `max_ngram_size` ... 1)."""

  name: ClassVar[str] = "prompt_lookup"
  layout: ClassVar = prompt_layouts.Questions(required=False)
  done_rows_stay: ClassVar = True  # a done row proposes and takes nothing
  controls: ClassVar = CONTROL_OPTIONS

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
    absent = (prompt.branch_segment < 0).reshape(rows)
    buffer = dataclasses.replace(OutputBuffer.empty(rows, capacity, limits), done=absent)
    logits = controls.process(logits.reshape(rows, 1, -1), limits.controls,
                              controls.Context.plain(buffer.tokens, buffer.count),
                              limits.eos_ids)  # [R, 1, V]
    first = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)  # [R]
    buffer, _ = emit(buffer, first[:, None], jnp.ones_like(first), limits,
                     Scored.requested(logits, first[:, None], limits))
    history, length = branch_histories(prompt, capacity + self.prompt_lookup_num_tokens + 1)
    history = history.at[jnp.arange(rows), length].set(first)
    token_metadata = None
    if self.return_metadata:
      token_metadata = metadata.first(capacity, jax.nn.softmax(logits[:, 0], axis=-1), first)
    return PromptLookupState(
        cache=cache, topology=topology, limits=limits, buffer=buffer, passes=None,
        history=history, length=length + 1, branch_segment=prompt.branch_segment.reshape(rows),
        tallies=jnp.zeros((rows, 3), jnp.int32),
        columns_fed=jnp.zeros((), jnp.int32) if platform.is_cpu() else None,
        metadata=token_metadata)

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
    # column t continues the generated text and the proposal's first t tokens
    logits = controls.process(logits.reshape(rows, width, -1), state.limits.controls,
                              controls.Context.chain(buffer.tokens, buffer.count, proposal),
                              state.limits.eos_ids)  # [R, 1 + D, V]
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R, 1 + D]
    accepted = greedy_accept(proposal, count, choice)  # [R]
    buffer, taken = emit(buffer, choice, accepted + 1, state.limits,
                         Scored.requested(logits, choice, state.limits))
    token_metadata = state.metadata
    if self.return_metadata:
      token_metadata = token_metadata.record(
          state.buffer.count, taken,
          *metadata.verified(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), choice,
                             proposal, count, accepted))
    emitted = taken.sum(axis=1, dtype=jnp.int32)
    history = cache_ops.set_columns(
        history, jnp.where(taken, length[:, None] + offsets, history.shape[1]), choice)
    # keep each branch's fed last token and its accepted proposal; compact out the rest
    # (one branch per row: what it keeps is the start of what it fed, so a rollback)
    if rows == batch:
      cache = cache_ops.rollback(cache, cached + jnp.where(state.buffer.done, 0, accepted + 1))
    else:
      rejected = active & (offsets > accepted[:, None])
      cache = cache_ops.compact(_kill_fed(cache, cached, active, rejected, batch), cached,
                                rows // batch * width)
    live = ~state.buffer.done
    columns_fed = None if state.columns_fed is None else state.columns_fed + rows * fed
    tallies = state.tallies + jnp.where(live[:, None], jnp.stack(
        [jnp.ones_like(count), count, accepted], axis=1), 0)  # [R, 3]
    return dataclasses.replace(
        state, cache=cache, buffer=buffer, history=history, length=length + emitted,
        tallies=tallies, columns_fed=columns_fed, metadata=token_metadata)

  def result(self, state: PromptLookupState):
    passes, drafted, accepted = state.tallies[:, 0].max(), *state.tallies[:, 1:].sum(axis=0)
    columns_fed = state.columns_fed
    if columns_fed is None:
      columns_fed = passes * state.history.shape[0] * (self.prompt_lookup_num_tokens + 1)
    stats = {"target_passes": passes, "drafted": drafted, "accepted": accepted,
             "columns_fed": columns_fed}
    if state.metadata is not None:
      stats["metadata"] = state.metadata
    return state.buffer, stats
