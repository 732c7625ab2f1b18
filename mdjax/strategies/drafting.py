"""Draft and verify: what `speculative`, `speculative_tree` and `self_speculative` share.

Every step a draft proposes tokens after the last emitted token `c` (a chain, or a
tree), the target scores `c` and every proposed token in one pass, keeps what its
acceptance rule accepts and adds one token of its own (a correction, or a bonus
token after a full accept); both caches then drop what was not kept. Rows accept
different lengths, so each row has its own `next_pos`.

A draft model with its own cache (`DraftModelState`) has not seen the tokens the
target emitted last: it catches up on them (`pending`: the target's token, after
the last accepted draft token where its cache does not hold that one) in one pass
whose logits give the first drafted token (`catch_up`). A fully accepted chain::

    emitted      ... c  d0 d1 x       (chain d0 d1 accepted, x the target's)
    draft cache  ... c  d0            (d0 fed to propose d1; d1 never fed)
    pending      d1 x                 count 2 (a chain cut short: x alone, count 1)

Randomness: a step's key per row comes from the run's key, the row and its emitted
count (`step_keys`), so a row's tokens do not depend on the batch; the draft folds
in `DRAFT_KEY` (then the chain position), the acceptance rule `ACCEPT_KEY`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mdjax import cache as cache_ops
from mdjax import controls, platform
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError, check_count, check_real
from mdjax.sampling import (Sampling, choose, draw, greedy_accept, process_logits, row_keys,
                            speculative_accept)
from mdjax.strategies import metadata
from mdjax.strategies.base import (DecodeState, Limits, ModelFn, OutputBuffer, Prompt, Sampled,
                                   Scored, Strategy, emit, last_emitted, prefill)
from mdjax.strategies.widths import decode_chains
from mdjax.topology import Topology

DRAFT_KEY, ACCEPT_KEY = 1, 2  # fold_in tags of a step's row key
SCHEDULES = ("constant", "heuristic")


def with_draft_model(cls: type[Strategy], target: ModelFn, model,
                     options: dict) -> tuple[Strategy, dict]:
  """`Strategy.construct` for a strategy whose `draft` option is an mdjax Model: the
  strategy with both models as `ModelFn`s (the same attention), and the params it
  runs on, `{"target": ..., "draft": ...}`."""
  options = dict(options)
  draft = options.pop("draft", None)
  if draft is None or not hasattr(draft, "config") or not hasattr(draft, "params"):
    raise MdjaxError(f"strategy {cls.name!r} needs draft=<an mdjax Model>, got {draft!r}")
  strategy = cls(model=target, draft=ModelFn(config=draft.config, attention=target.attention),
                 **options)
  return strategy, {"target": model.params, "draft": draft.params}


def check_vocabulary(target: ModelFn, draft: ModelFn) -> None:
  """Draft tokens are target tokens: the two vocabularies must be one."""
  if draft.vocab_size != target.vocab_size:
    raise MdjaxError(f"the draft's vocabulary ({draft.vocab_size} tokens) differs "
                     f"from the target's ({target.vocab_size} tokens)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
  """How many tokens a row drafts (its `budget`, at most `longest`), from the chain
  strategies' options of the same names (`Schedule.of`).

  `draft_schedule="constant"` drafts `num_draft_tokens` every step; `"heuristic"` is
  transformers' rule: start at `num_draft_tokens`, +2 after a step that accepted the
  whole budget, -1 (at least 1) otherwise. `max_draft_tokens` 0 means
  `num_draft_tokens` (constant) or twice it (heuristic). A `confidence_threshold` > 0
  also stops a row's chain after a token the draft gave less than that probability.
  """

  num_draft_tokens: int
  draft_schedule: str
  max_draft_tokens: int
  confidence_threshold: float

  def __post_init__(self):
    check_count("num_draft_tokens", self.num_draft_tokens, 1)
    check_count("max_draft_tokens", self.max_draft_tokens, 0)
    if self.draft_schedule not in SCHEDULES:
      raise MdjaxError(f"draft_schedule must be one of {', '.join(SCHEDULES)}, "
                       f"got {self.draft_schedule!r}")
    if self.max_draft_tokens and self.max_draft_tokens < self.num_draft_tokens:
      raise MdjaxError(f"max_draft_tokens ({self.max_draft_tokens}) must be >= num_draft_tokens "
                       f"({self.num_draft_tokens})")
    check_real("confidence_threshold", self.confidence_threshold, minimum=0, maximum=1)

  @classmethod
  def of(cls, strategy: Strategy) -> "Schedule":
    """The schedule `strategy`'s options of the same names set (validated here)."""
    return cls(**{field.name: getattr(strategy, field.name) for field in dataclasses.fields(cls)})

  @property
  def longest(self) -> int:
    """Static chain length: what the cache and the target's verify pass are sized for."""
    if self.max_draft_tokens:
      return self.max_draft_tokens
    return self.num_draft_tokens * (2 if self.draft_schedule == "heuristic" else 1)

  def cache_slots(self, prompt_len: int, capacity: int) -> int:
    """The padded prompt, the generated tokens, and room for one rejected chain."""
    return prompt_len + capacity + self.longest + 1

  def next_budget(self, budget: Int[Array, "B"], accepted: Int[Array, "B"]) -> Int[Array, "B"]:
    """Every row's budget after a step that accepted `accepted` of its `budget`."""
    if self.draft_schedule == "constant":
      return budget
    return jnp.where(accepted == budget, jnp.minimum(budget + 2, self.longest),
                     jnp.maximum(budget - 1, 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModelState:
  """A draft model's own cache and the emitted tokens it has not been fed.

    cache          KVCache [B]  the draft's cache: the prompt, then every emitted token
                                before the pending ones
    pending        int32[B, 2]  its first `pending_count` tokens are those not fed yet,
                                the last emitted token last
    pending_count  int32[B]     1, or 2 when `cache` lacks the last accepted draft token
  """

  cache: KVCache
  pending: Int[Array, "B 2"]
  pending_count: Int[Array, "B"]

  @classmethod
  def start(cls, draft: ModelFn, params, prompt: Prompt, target_cache: KVCache,
            first: Int[Array, "B"]) -> "DraftModelState":
    """The draft's prefill into a cache shaped like the target's; `first` (the
    target's first token) pending."""
    cache = KVCache.for_params(draft.config, params, prompt.tokens.shape[0],
                               target_cache.num_slots, target_cache.dtype)
    _, cache, _ = prefill(draft, params, prompt, cache)
    return cls(cache=cache, pending=jnp.stack([first] * 2, axis=1),
               pending_count=jnp.ones_like(first))

  @classmethod
  def behind(cls, cache: KVCache, unseen: Bool[Array, "B"], last_accepted: Int[Array, "B"],
             next_token: Int[Array, "B"]) -> "DraftModelState":
    """After a verify: `cache` holds what the draft keeps; pending is the target's
    `next_token`, after `last_accepted` where the draft never fed it (`unseen`)."""
    return cls(cache=cache,
               pending=jnp.stack([jnp.where(unseen, last_accepted, next_token), next_token], 1),
               pending_count=jnp.where(unseen, 2, 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftState(DecodeState):
  """`DecodeState` (buffer rows R = B: one branch per prompt; R = B x N for a tree
  strategy with branches, `trees.verify`). A step updates few arrays (on a GPU each is
  a kernel or more): the last emitted token, which the target feeds first next
  (`last`), is the buffer's, at position `next_pos` = `first_pos` + the tokens emitted
  after the first; `passes` is None, the counters are one array, `tallies`.

    topology      Topology [B, G]  the prompt's
    first_pos     int32[R]         the position of the first emitted token
    tallies       int32[2, D + 1]  over all steps: [0, :D] live rows' drafted tokens per
                                   chain position (or nodes per tree depth), [1, :D] of
                                   those the accepted ones (`drafted_at`, `accepted_at`);
                                   [0, D] target passes after prefill (`passes_run`),
                                   [1, D] draft passes (`draft_passes`)
    metadata      TokenMetadata [B, N]  per emitted token, with return_metadata; else None
    draft         DraftModelState  the draft model's cache and pending tokens (or an
                                   EAGLE head's, `eagle.HeadState`); None when the
                                   draft runs on the target's cache (self_speculative)
  """

  topology: Topology
  first_pos: Int[Array, "R"]
  tallies: Int[Array, "2 D+1"]
  metadata: metadata.TokenMetadata | None
  draft: DraftModelState | None

  @property
  def last(self) -> Int[Array, "R"]:
    return last_emitted(self.buffer)

  @property
  def next_pos(self) -> Int[Array, "R"]:
    """`last`'s position (of a done row: past its last token, never fed)."""
    return self.first_pos + self.buffer.count - 1

  @property
  def drafted_at(self) -> Int[Array, "D"]:
    return self.tallies[0, :-1]

  @property
  def accepted_at(self) -> Int[Array, "D"]:
    return self.tallies[1, :-1]

  @property
  def draft_passes(self) -> Int[Array, ""]:
    return self.tallies[1, -1]

  def passes_run(self) -> Int[Array, ""]:
    """Target passes after prefill."""
    return self.tallies[0, -1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainState(DraftState):
  """`DraftState` (D = the longest chain), and

    budget       int32[B]   tokens each row drafts next step (`Schedule`)
    columns_fed  int32[]    tokens fed to the target's verify passes (B x the pass's width)
  """

  budget: Int[Array, "B"]
  columns_fed: Int[Array, ""]


State = TypeVar("State", bound=DraftState)


def start(state_type: type[State], target: ModelFn, draft: ModelFn | None, params,
          prompt: Prompt, cache: KVCache, limits: Limits, capacity: int,
          sampling: Sampling, *, positions: int, return_metadata: bool,
          prefilled: tuple[Float[Array, "B N V"], KVCache, Topology] | None = None,
          **fields) -> State:
  """The first state: the target's prefill and every branch's first token emitted
  (one output row per branch, R = B x N: row b * N + j is branch j of prompt row b,
  done from the start where that row has no branch j), the counters (`positions`
  per chain position or tree depth) at zero, and the prefilled `DraftModelState` of
  a `draft` with its own cache (None: the draft runs on the target's; one branch per
  row only); `prefilled`: `prefill`'s result when the caller ran it (to read the
  hidden states too); `fields`: `state_type`'s others."""
  logits, target_cache, topology = prefilled or prefill(target, params["target"], prompt, cache)
  logits = logits.reshape(-1, logits.shape[-1])  # [B, N, V] -> [R, V]
  rows = jnp.arange(logits.shape[0])
  absent = (prompt.branch_segment < 0).reshape(-1)  # [R]
  buffer = dataclasses.replace(OutputBuffer.empty(rows.size, capacity, limits), done=absent)
  context = controls.Context.plain(buffer.tokens, buffer.count)
  logits = controls.process(logits[:, None], limits.controls, context, limits.eos_ids)[:, 0]
  processed = process_logits(logits, sampling)
  first = draw(row_keys(limits.key, rows, jnp.zeros_like(rows)), processed, sampling.greedy)
  buffer, _ = emit(buffer, first[:, None], jnp.ones_like(first), limits,
                   Scored.requested(processed[:, None], first[:, None], limits))
  token_metadata = None
  if return_metadata:
    token_metadata = metadata.first(capacity, probs(logits, sampling), first)
  return state_type(
      cache=target_cache, topology=topology, limits=limits, buffer=buffer, passes=None,
      first_pos=prompt.branch_positions().reshape(-1),
      tallies=jnp.zeros((2, positions + 1), jnp.int32), metadata=token_metadata,
      draft=None if draft is None else DraftModelState.start(draft, params["draft"], prompt,
                                                             cache, first), **fields)


def start_chain(target: ModelFn, draft: ModelFn | None, params, prompt: Prompt, cache: KVCache,
                limits: Limits, capacity: int, sampling: Sampling, schedule: Schedule,
                return_metadata: bool) -> ChainState:
  """`start` for a chain strategy: every row's budget at `num_draft_tokens`."""
  return start(ChainState, target, draft, params, prompt, cache, limits, capacity, sampling,
               positions=schedule.longest, return_metadata=return_metadata,
               budget=jnp.full((prompt.tokens.shape[0],), schedule.num_draft_tokens, jnp.int32),
               columns_fed=jnp.zeros((), jnp.int32))


def probs(logits: Float[Array, "... V"], sampling: Sampling) -> Float[Array, "... V"]:
  """The distribution `sampling` draws from (p of the target, q of the draft)."""
  return jax.nn.softmax(process_logits(logits, sampling), axis=-1)


def fold_in(keys: jax.Array, data) -> jax.Array:
  """Every row's key with `data` folded in."""
  return jax.vmap(lambda key: jax.random.fold_in(key, data))(keys)


def step_keys(state: DraftState) -> jax.Array:
  """One key per row, fresh every step (see the module docstring)."""
  return row_keys(state.limits.key, jnp.arange(state.last.shape[0]), state.buffer.count)


def pending_feed(state: DraftState) -> tuple[Int[Array, "B W"], Int[Array, "B W"]]:
  """Positions and segments of the draft's W pending columns (`state.draft.pending`,
  the last emitted token at `next_pos` last): segment 0 for the first
  `pending_count`, -1 after them and for done rows."""
  count = state.draft.pending_count
  first_pos = state.next_pos + 1 - count  # [B] of pending[0]
  offsets = jnp.arange(state.draft.pending.shape[1])[None, :]
  feed = (offsets < count[:, None]) & ~state.buffer.done[:, None]
  return first_pos[:, None] + offsets, jnp.where(feed, 0, -1)


def catch_up(draft: ModelFn, params, state: DraftState) -> tuple[Float[Array, "B V"], KVCache]:
  """One draft pass over the pending tokens: the draft's logits after the last
  emitted token, and its cache holding everything emitted so far."""
  positions, segments = pending_feed(state)
  logits, _, cache = draft(params, state.draft.cache, state.draft.pending, positions, segments,
                           state.topology,
                           logits_at=(state.draft.pending_count - 1)[:, None])  # [B, 1, V]
  return logits[:, 0], cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Chain:
  """The chain drafting loop's carry (D = the longest chain), and its result.

    tokens  int32[B, D]       the drafted chain (zeros past `length`)
    length  int32[B]          tokens each row drafted (0: a done row)
    q       float32[B, D, V]  the draft's distribution at each position when
                              sampling; None when greedy
    active  bool[B]           the row drafts on (budget and confidence left)
    cache   KVCache           the cache the draft runs on: everything emitted, then
                              tokens[:i - 1] of the rows that drafted them
    i       int32[]           positions drafted: the draft passes made this step
  """

  tokens: Int[Array, "B D"]
  length: Int[Array, "B"]
  q: Float[Array, "B D V"] | None
  active: Bool[Array, "B"]
  cache: KVCache
  i: Int[Array, ""]


def draft_chain(draft: ModelFn, params, cache: KVCache, logits: Float[Array, "B V"],
                keys: jax.Array, state: DraftState, schedule: Schedule,
                sampling: Sampling, budget: Int[Array, "B"] | None = None) -> Chain:
  """From the draft's `logits` after the last emitted token (and `cache`, holding
  everything emitted), the chain: one draft pass per further token, each row until
  its budget (`budget`, else the `ChainState`'s) or the confidence threshold stops it,
  all rows until none drafts on."""
  done = state.buffer.done
  budget = state.budget if budget is None else budget
  batch, longest = done.shape[0], schedule.longest
  chain_keys = fold_in(keys, DRAFT_KEY)

  def record(chain: Chain, logits: Float[Array, "B V"]) -> Chain:
    """Chain position `i` from the draft's `logits`, for the rows still drafting."""
    i, active, threshold = chain.i, chain.active, schedule.confidence_threshold
    if state.limits.controls is not None:  # the draft proposes what the controls allow
      path = jnp.where(jnp.arange(longest) < i, chain.tokens, -1)[:, None]  # [B, 1, D]
      logits = controls.process(logits[:, None], state.limits.controls, controls.Context(
          state.buffer.tokens, state.buffer.count, path, jnp.full((batch, 1), i, jnp.int32)),
          state.limits.eos_ids)[:, 0]
    q = None if sampling.greedy and not threshold else probs(logits, sampling)
    token = choose(fold_in(chain_keys, i), logits, sampling)
    length = chain.length + active
    active = active & (length < budget)
    if threshold:  # (every probability passes a threshold of 0: no softmax to find it)
      active = active & (jnp.take_along_axis(q, token[:, None], axis=1)[:, 0] >= threshold)
    return dataclasses.replace(
        chain, tokens=jnp.where(jnp.arange(longest) == i, token[:, None], chain.tokens),
        length=length, active=active, i=i + 1,
        q=None if chain.q is None else chain.q.at[:, i].set(q))

  def extend(chain: Chain) -> Chain:
    logits, _, cache = draft(
        params, chain.cache, jax.lax.dynamic_slice_in_dim(chain.tokens, chain.i - 1, 1, axis=1),
        (state.next_pos + chain.i)[:, None], jnp.where(chain.active, 0, -1)[:, None],
        state.topology)  # [B, 1, V]
    return record(dataclasses.replace(chain, cache=cache), logits[:, 0])

  chain = record(Chain(tokens=jnp.zeros((batch, longest), jnp.int32),
                       length=jnp.zeros((batch,), jnp.int32),
                       q=None if sampling.greedy else jnp.zeros((batch, longest, logits.shape[-1]),
                                                                jnp.float32),
                       active=~done, cache=cache, i=jnp.zeros((), jnp.int32)), logits)
  if platform.is_cpu():
    return jax.lax.while_loop(lambda c: (c.i < longest) & c.active.any(), extend, chain)
  # Off the CPU a loop that stops when no row drafts on asks the host after every draft
  # pass; `longest` passes with the stopped rows fed as padding (segment -1: no cache
  # write, no length) ask nothing, and draft passes are cheap (a small draft model).
  # Unrolled, the chain's position is a constant: no loop counter, and the small
  # per-row arrays fuse into the passes that read them instead of being stored.
  for _ in range(1, longest):
    chain = extend(chain)
  return chain


def accept_chain(keys: jax.Array, chain: Chain, logits: Float[Array, "B D+1 V"],
                 sampling: Sampling) -> tuple[Int[Array, "B"], Int[Array, "B"]]:
  """(accepted [B], the target's next token [B]) from the target's `logits` (controls
  applied): greedy keeps the target's argmax up to and including the first
  disagreement; sampling keeps token i with probability min(1, p/q) and resamples the
  first rejected one (`mdjax.sampling.speculative_accept`)."""
  if sampling.greedy:
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, 1 + D]
    accepted = greedy_accept(chain.tokens, chain.length, choice)
    return accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]
  return speculative_accept(fold_in(keys, ACCEPT_KEY), chain.tokens, chain.length, chain.q,
                            probs(logits, sampling))


def verify_chain(target: ModelFn, params, state: ChainState, cache: KVCache, keys: jax.Array,
                 chain: Chain, schedule: Schedule, sampling: Sampling
                 ) -> tuple[ChainState, Int[Array, "B"]]:
  """One target pass over the last emitted token and `chain` (on `cache`: the
  target's, holding what `state.cache` holds), the accepted prefix and the target's
  next token emitted, the rejected tail rolled back. Returns the state and the
  accepted count per row."""
  done = state.buffer.done
  batch, longest = done.shape[0], schedule.longest
  tokens = jnp.concatenate([state.last[:, None], chain.tokens], axis=1)  # [B, 1 + D]
  offsets = jnp.arange(longest + 1)[None, :]
  scored = (offsets <= chain.length[:, None]) & ~done[:, None]
  cached = state.cache.length
  logits, cache, fed = decode_chains(target, params, cache, tokens[:, None],
                                     (state.next_pos[:, None] + offsets)[:, None],
                                     jnp.where(scored, 0, -1)[:, None], state.topology)
  logits = controls.process(logits[:, 0], state.limits.controls, controls.Context.chain(
      state.buffer.tokens, state.buffer.count, chain.tokens), state.limits.eos_ids)  # [B, 1 + D, V]
  accepted, next_token = accept_chain(keys, chain, logits, sampling)
  emitted = jnp.where(offsets < accepted[:, None], jnp.pad(chain.tokens, ((0, 0), (0, 1))),
                      next_token[:, None])  # [B, 1 + D]: chain[:accepted], next_token
  position = jnp.arange(longest)[None, :]
  live = ~done[:, None] & (position < chain.length[:, None])  # [B, D]
  state = commit(
      state, cache=cache_ops.rollback(cache, jnp.where(done, cached, cached + 1 + accepted)),
      emitted=emitted, accepted=accepted, draft_passes=chain.i,
      drafted=live, accepted_at=live & (position < accepted[:, None]),
      token_metadata=lambda: metadata.verified(probs(logits, sampling), emitted, chain.tokens,
                                               chain.length, accepted),
      scored=Scored.requested(process_logits(logits, sampling), emitted, state.limits))
  return dataclasses.replace(state, budget=schedule.next_budget(state.budget, accepted),
                             columns_fed=state.columns_fed + batch * fed), accepted


def commit(state: State, *, cache: KVCache, emitted: Int[Array, "B D+1"],
           accepted: Int[Array, "B"], draft_passes: Int[Array, ""],
           drafted: Int[Array, "B D"] | Bool[Array, "B D"], accepted_at: Bool[Array, "B D"],
           token_metadata: Callable[[], Any], scored: Scored | None = None) -> State:
  """The state after a verify: `emitted[:, :accepted + 1]` (the accepted tokens, then
  the target's `next_token`) in the buffer, the target's `cache`, the counters
  advanced by one target pass, `draft_passes`, and this step's `drafted` /
  `accepted_at` per row and position. `token_metadata()` (called with
  return_metadata only) gives the emitted tokens' `metadata.verified` values; `scored`
  their log-probabilities, where the request asks for them (`emit`)."""
  buffer, taken = emit(state.buffer, emitted, accepted + 1, state.limits, scored)
  recorded = (None if state.metadata is None else
              state.metadata.record(state.buffer.count, taken, *token_metadata()))
  tallies = jnp.stack([
      jnp.append(drafted.sum(axis=0, dtype=jnp.int32), 1),
      jnp.append(accepted_at.sum(axis=0, dtype=jnp.int32), draft_passes)])  # [2, D + 1]
  return dataclasses.replace(
      state, cache=cache, buffer=buffer, metadata=recorded, tallies=state.tallies + tallies)


def stats(state: DraftState, mean_accepted_length: Float[Array, ""]) -> dict:
  """The statistics every draft-and-verify strategy reports."""
  drafted, accepted = state.drafted_at, state.accepted_at
  return {"target_passes": state.passes_run(), "draft_passes": state.draft_passes,
          "drafted": drafted.sum(), "accepted": accepted.sum(),
          "drafted_at": drafted, "accepted_at": accepted,
          "mean_accepted_length": mean_accepted_length} | (
              {} if state.metadata is None else {"metadata": state.metadata})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainDrafter(Sampled):
  """What a chain strategy (`speculative`, `self_speculative`) does with the chain
  options it declares (`num_draft_tokens`, `draft_schedule`, `max_draft_tokens`,
  `confidence_threshold`, `return_metadata`): validate them, size the cache, report."""

  def __post_init__(self):
    super().__post_init__()
    self.schedule  # validates the schedule's options

  @property
  def schedule(self) -> Schedule:
    return Schedule.of(self)

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    return self.schedule.cache_slots(prompt_len, capacity)

  def result(self, state: ChainState) -> tuple[OutputBuffer, dict]:
    """`stats` per chain position."""
    drafted, accepted = state.drafted_at, state.accepted_at
    # every verify of a live row drafts position 0: drafted[0] = verified chains
    return state.buffer, stats(state, accepted.sum() / jnp.maximum(drafted[0], 1)) | {
        "columns_fed": state.columns_fed,  # tokens fed to the target's passes
        "acceptance_rate_at": accepted / jnp.maximum(drafted, 1)}
