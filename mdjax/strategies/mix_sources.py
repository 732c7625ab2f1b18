r"""The draft sources of `mixed`: each proposes a chain after the last emitted token `c`
and follows the committed text after every verify, whatever source's path the target
kept. A source is a static, hashable object:

    available(state)                    [R] tokens it can propose this step (its cap,
                                        or a lookup's match)
    propose(params, state, length, keys) -> (tokens [R, cap], scratch, passes): its
                                        chain, `length[r]` tokens of it used
    after(params, before, state, verified, scratch, credited) -> fields of `MixState`
                                        updated after the verify (`credited`: how many of
                                        its chain's tokens the accepted path holds)
    fixed_and_per_token(params, cost)   its drafting cost in seconds: every step, and per
                                        further token (`mix_choice`)

`PromptLookup` copies what followed the latest earlier occurrence of the last n-gram
(`lookup.propose_by_lookup`) in the prompt and the text emitted so far. `ParallelHeads`
reads its family's `Guess` (Medusa, MTP): head k's top-1 is the chain's token k.
`SequentialHead` runs its family's `draft_step` (EAGLE, EAGLE-3): a catch-up pass on
the committed tokens, then one pass per further token, each fed the feature its
predecessor's pass predicted; its cache then drops the chain (`eagle.HeadState.after`).
`DraftModel` catches up and drafts with `drafting.catch_up` / `draft_chain` at
temperature 0 (the tree rule needs children fixed before the target's draw); its cache
keeps the chain tokens it was fed that the accepted path holds, and the rest of the
committed tokens become pending, so its `pending` is `[R, 1 + D]` wide, not 2::

    emitted      c  e1 e2 x          (e1 e2 accepted from a lookup chain, x the target's)
    draft chain  e1 f2 f3            fed e1 f2 in its passes; e1 is on the path
    draft cache  keeps pending + e1  pending: e2 x (count 2)
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from mdjax import cache as cache_ops
from mdjax import platform
from mdjax.cache import KVCache
from mdjax.heads import get_family, vocab
from mdjax.heads.base import HeadsConfig
from mdjax.heads.family import Feed, Guess
from mdjax.heads.tree import default_accuracy
from mdjax.sampling import SamplingParams
from mdjax.strategies import drafting, mix_choice, tree_choice
from mdjax.strategies.base import ModelFn, Prompt
from mdjax.strategies.drafting import DraftModelState, Schedule
from mdjax.strategies.eagle import HeadState
from mdjax.strategies.lookup import branch_histories, propose_by_lookup
from mdjax.strategies.pass_cost import PassCost
from mdjax.strategies.trees import Verified

GREEDY = SamplingParams(temperature=0.0)


def widen(pending: Int[Array, "B W"], depth: int) -> Int[Array, "B D+1"]:
  """Pending tokens in a `[B, 1 + depth]` array (what a verify can commit at once)."""
  return jnp.pad(pending, ((0, 0), (0, 1 + depth - pending.shape[1])))


@dataclasses.dataclass(frozen=True)
class PromptLookup:
  """Prompt lookup (`lookup`): chains of up to `cap` tokens, from n-grams of
  `max_ngram_size` ... 1."""

  cap: int
  max_ngram_size: int
  name: str = "prompt_lookup"

  def prior(self) -> tuple[float, ...]:
    return mix_choice.LOOKUP_ACCURACY

  def fixed_and_per_token(self, params, cost: PassCost, depth: int) -> tuple[float, float]:
    return 0.0, 0.0

  def start(self, params, prompt: Prompt, first: Int[Array, "B"], capacity: int, depth: int,
            **_) -> dict:
    history, length = branch_histories(prompt, capacity + depth + 1)
    return dict(history=history.at[jnp.arange(first.shape[0]), length].set(first),
                length=length + 1)

  def _proposal(self, state):
    return propose_by_lookup(state.history, state.length, self.max_ngram_size, self.cap)

  def available(self, state) -> Int[Array, "R"]:
    return self._proposal(state)[1]

  def propose(self, params, state, length, keys):
    return self._proposal(state)[0], None, 0

  def after(self, params, before, state, verified: Verified, scratch, credited) -> dict:
    taken = state.buffer.count - before.buffer.count  # [R] tokens emitted this step
    offsets = jnp.arange(verified.emitted.shape[1])[None, :]
    index = jnp.where(offsets < taken[:, None], before.length[:, None] + offsets,
                      before.history.shape[1])
    history = before.history.at[jnp.arange(taken.shape[0])[:, None], index].set(
        verified.emitted, mode="drop")
    return dict(history=history, length=before.length + taken)


@dataclasses.dataclass(frozen=True)
class HeadsSource:
  """What both kinds of heads are: their config, on the target (`ModelFn`), drafting
  chains of `cap` tokens every step."""

  heads: HeadsConfig
  target: ModelFn
  cap: int
  name: str = "heads"

  def available(self, state) -> Int[Array, "R"]:
    return jnp.full(state.last.shape, self.cap, jnp.int32)


@dataclasses.dataclass(frozen=True)
class ParallelHeads(HeadsSource):
  """Parallel heads (a family's `Guess`): head k's top-1 is the chain's token k + 1."""

  @property
  def guess(self) -> Guess:
    return get_family(self.heads.family).guesser(self.heads, self.target.config,
                                                  self.target.attention, self.cap)

  def used(self, params) -> dict:
    return {"target": params["target"],
            "heads": get_family(self.heads.family).first_heads(params["heads"], self.cap)}

  def prior(self) -> tuple[float, ...]:
    accuracy = self.heads.top_accuracy or default_accuracy(self.cap)
    return tuple(row[0] for row in accuracy[:self.cap])

  def fixed_and_per_token(self, params, cost: PassCost, depth: int) -> tuple[float, float]:
    heads = self.used(params)["heads"]
    fraction = tree_choice.draft_fraction(
        heads, params["target"],
        reads_unembedding=not (self.heads.own_unembedding or "draft_unembedding" in heads))
    return fraction * cost(1), 0.0

  def start(self, params, prompt: Prompt, hidden, cache: KVCache, **_) -> dict:
    feed = Feed(prompt.positions, prompt.segments, prompt.topology())
    return dict(read=self.guess.start(self.used(params), hidden, prompt.branch_last, feed,
                                      cache.num_slots, cache.k.dtype))

  def propose(self, params, state, length, keys):
    used = self.used(params)
    logits = self.guess.logits(used, state.read)  # [R, K, V]
    tokens = vocab.to_target(jnp.argmax(logits, axis=-1), used["heads"].get("draft_ids"))
    return tokens.astype(jnp.int32), None, self.guess.passes

  def after(self, params, before, state, verified: Verified, scratch, credited) -> dict:
    column = jnp.arange(verified.path.shape[1] + 1)[None, :]
    committed = (column <= verified.accepted[:, None]) & ~before.buffer.done[:, None]
    feed = Feed(before.next_pos[:, None] + column, jnp.where(committed, 0, -1), before.topology)
    return dict(read=self.guess.advance(self.used(params), before.read,
                                        verified.hidden_on_path(), verified.accepted, feed))


@dataclasses.dataclass(frozen=True)
class SequentialHead(HeadsSource):
  """A head that drafts one token at a time (its family's `draft_step`)."""

  def prior(self) -> tuple[float, ...]:
    return tuple(row[0] for row in (self.heads.top_accuracy or tree_choice.DRAFT_ACCURACY))

  def fixed_and_per_token(self, params, cost: PassCost, depth: int) -> tuple[float, float]:
    own = self.heads.own_unembedding or "lm_head" in params["heads"]  # EAGLE-3's, over V_d
    fraction = tree_choice.draft_fraction(params["heads"], params["target"],
                                          reads_unembedding=not own)
    return fraction * cost(1 + depth), fraction * cost(1)

  def _pass(self, params, cache, tokens, features, positions, segments, topology,
            logits_at=None):
    return get_family(self.heads.family).draft_step(
        self.heads, params["heads"], params["target"], cache, tokens, features, positions,
        segments, topology, model_config=self.target.config, attention=self.target.attention,
        logits_at=logits_at)

  def start(self, params, prompt: Prompt, hidden, cache: KVCache, first, depth: int,
            topology, **_) -> dict:
    """The head's prefill: the prompt's tokens with the target's hidden states shifted by
    one (zeros at position 0); `first` pending, with the last prompt token's state."""
    batch = first.shape[0]
    config = get_family(self.heads.family).cache_config(self.heads, self.target.config)
    head_cache = KVCache.create(config, batch, cache.num_slots, cache.k.dtype)
    shifted = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))  # [B, P, H] h_{t-1}
    _, _, head_cache = self._pass(params, head_cache, prompt.tokens, shifted, prompt.positions,
                                  prompt.segments, topology,
                                  logits_at=jnp.zeros((batch, 0), jnp.int32))
    last = jnp.take_along_axis(hidden, prompt.branch_last[:, :1, None], axis=1)  # [B, 1, H]
    features = jnp.zeros((batch, 1 + depth, hidden.shape[-1]), hidden.dtype)
    return dict(read=HeadState(cache=head_cache, pending=widen(first[:, None], depth),
                               features=features.at[:, :1].set(last),
                               pending_count=jnp.ones((batch,), jnp.int32)))

  def propose(self, params, state, length, keys):
    """The catch-up pass (level 1 from its logits at `c`), then a pass per further token
    while a row wants more: the chain, and the caught-up cache length as scratch."""
    head, done = state.read, state.buffer.done
    draft_ids = params["heads"].get("draft_ids")
    positions, segments = drafting.pending_feed(dataclasses.replace(state, draft=head))
    last = (head.pending_count - 1)[:, None]  # [B, 1] the column of `c`
    logits, features, cache = self._pass(params, head.cache, head.pending, head.features,
                                         positions, segments, state.topology, logits_at=last)
    top = lambda logits: vocab.to_target(jnp.argmax(logits[:, 0], axis=-1), draft_ids)
    tokens = jnp.zeros((done.shape[0], self.cap), jnp.int32).at[:, 0].set(top(logits))
    feature = jnp.take_along_axis(features, last[..., None], axis=1)  # [B, 1, H]

    def extend(carry):
      i, tokens, feature, cache = carry
      fed = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)  # [B, 1]
      logits, feature, cache = self._pass(params, cache, fed, feature,
                                          (state.next_pos + i)[:, None],
                                          jnp.where((i < length) & ~done, 0, -1)[:, None],
                                          state.topology)
      return i + 1, jax.lax.dynamic_update_slice_in_dim(tokens, top(logits)[:, None], i,
                                                        axis=1), feature, cache

    carry = (jnp.ones((), jnp.int32), tokens, feature, cache)
    if platform.is_cpu():
      carry = jax.lax.while_loop(lambda c: (c[0] < self.cap) & (c[0] < length).any(), extend,
                                 carry)
    elif self.cap > 1:  # a loop of known trip count asks the host nothing (`draft_chain`)
      carry = jax.lax.fori_loop(1, self.cap, lambda _, c: extend(c), carry)
    return carry[1], (cache.length, carry[3]), carry[0]

  def after(self, params, before, state, verified: Verified, scratch, credited) -> dict:
    caught_up, cache = scratch
    return dict(read=HeadState.after(verified, cache_ops.rollback(cache, caught_up)))


@dataclasses.dataclass(frozen=True)
class DraftModel:
  """A draft model's greedy chain (`drafting.draft_chain`)."""

  draft: ModelFn
  cap: int
  name: str = "draft"

  def prior(self) -> tuple[float, ...]:
    return tuple(row[0] for row in tree_choice.DRAFT_ACCURACY)

  def fixed_and_per_token(self, params, cost: PassCost, depth: int) -> tuple[float, float]:
    fraction = tree_choice.draft_fraction(params["draft"], params["target"],
                                          reads_unembedding=False)
    return fraction * cost(2), fraction * cost(1)

  def start(self, params, prompt: Prompt, cache: KVCache, first, depth: int, **_) -> dict:
    start = DraftModelState.start(self.draft, params["draft"], prompt, cache, first)
    return dict(draft=dataclasses.replace(start, pending=widen(start.pending[:, :1], depth)))

  def available(self, state) -> Int[Array, "R"]:
    return jnp.full(state.last.shape, self.cap, jnp.int32)

  def propose(self, params, state, length, keys):
    logits, cache = drafting.catch_up(self.draft, params["draft"], state)
    schedule = Schedule(num_draft_tokens=self.cap, draft_schedule="constant", max_draft_tokens=0,
                        confidence_threshold=0.0)
    chain = drafting.draft_chain(self.draft, params["draft"], cache, logits, keys, state,
                                 schedule, GREEDY, budget=length)
    return chain.tokens, chain, chain.i

  def after(self, params, before, state, verified: Verified, scratch, credited) -> dict:
    """Keep the fed chain tokens the path holds; the committed tokens after them pend."""
    chain, done = scratch, before.buffer.done
    cached, pending_count = before.draft.cache.length, before.draft.pending_count
    kept = jnp.minimum(credited, jnp.maximum(chain.length - 1, 0))  # [B] fed and accepted
    cache = cache_ops.rollback(chain.cache, jnp.where(done, cached,
                                                      cached + pending_count + kept))
    width = verified.emitted.shape[1]
    index = jnp.minimum(kept[:, None] + jnp.arange(width), width - 1)
    pending = jnp.take_along_axis(verified.emitted, index, axis=1)
    return dict(draft=DraftModelState(cache=cache, pending=pending,
                                      pending_count=verified.accepted + 1 - kept))
