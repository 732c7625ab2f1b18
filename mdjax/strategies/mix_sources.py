r"""The draft sources of `mixed`: each proposes a tree after the last emitted token `c`
(a chain is a tree too), its nodes parents first and best first, and follows the
committed text after every verify, whatever source's path the target kept. A source is
a static, hashable object:

    size, depth                         nodes of its tree, and how deep it goes
    table(depth)                        its reach table `[size + 1, depth]` (`mix_choice`)
    available(state)                    [R] nodes it can propose this step (its size,
                                        or what a lookup matched)
    propose(params, state, count, keys) -> (Tree [R, size], scratch, passes): its tree,
                                        the first `count[r]` real nodes used
    after(params, before, state, verified, scratch, credited) -> fields of `MixState`
                                        updated after the verify (`credited`: how many of
                                        the accepted path's nodes its tree held)
    fixed_and_per_token(params, cost, depth)  its drafting cost in seconds: every step,
                                        and per further node (`mix_choice`)

`PromptLookup` copies what followed earlier occurrences of the last n-gram
(`lookup.lookup_matches`: the longest n, latest first, distinct continuations) in the
prompt and the text emitted so far: `matches` chains, siblings where they part.
`ParallelHeads` reads its family's `Guess` (Medusa, MTP) through a static tree of rank
paths (`mdjax.heads.tree`, as `medusa` verifies), its nodes in order of value.
`SequentialHead` drafts EAGLE-2's tree with its family's `draft_step` (EAGLE, EAGLE-3),
as `eagle` does (`speculative_tree.TreeDrafter`: a catch-up pass on the committed
tokens, then a pass per further level over its K best nodes), its nodes in order of
score; its cache then drops the tree (`eagle.HeadState.after`). `DraftModel` catches
up and drafts a chain with `drafting.catch_up` / `draft_chain` at temperature 0 (the
tree rule needs children fixed before the target's draw); its cache keeps the chain
tokens it was fed that the accepted path holds, and the rest of the committed tokens
become pending, so its `pending` is `[R, 1 + D]` wide, not 2::

    emitted      c  e1 e2 x          (e1 e2 accepted from a lookup chain, x the target's)
    draft chain  e1 f2 f3            fed e1 f2 in its passes; e1 is on the path
    draft cache  keeps pending + e1  pending: e2 x (count 2)

Every source drafts at temperature 0 (its children ranked by its own logits, fixed
before the target's draw), so the tree rule keeps sampling lossless.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.heads import get_family, vocab
from mdjax.heads.base import HeadsConfig
from mdjax.heads.family import Feed, Guess
from mdjax.heads.tree import TreeArrays, default_accuracy, node_value, rank_accuracy
from mdjax.sampling import Sampling
from mdjax.strategies import drafting, mix_choice, tree_choice, trees
from mdjax.strategies.base import ModelFn, Prompt
from mdjax.strategies.drafting import DraftModelState, Schedule
from mdjax.strategies.eagle import Eagle, HeadState
from mdjax.strategies.lookup import branch_histories, lookup_matches
from mdjax.strategies.pass_cost import PassCost
from mdjax.strategies.trees import Tree, Verified


def widen(pending: Int[Array, "B W"], depth: int) -> Int[Array, "B D+1"]:
  """Pending tokens in a `[B, 1 + depth]` array (what a verify can commit at once)."""
  return jnp.pad(pending, ((0, 0), (0, 1 + depth - pending.shape[1])))


@dataclasses.dataclass(frozen=True)
class PromptLookup:
  """Prompt lookup: up to `matches` distinct chains of up to `cap` tokens, from n-grams
  of `max_ngram_size` ... 1 (`lookup.lookup_matches`), one chain after the other."""

  cap: int
  max_ngram_size: int
  matches: int
  name: str = "prompt_lookup"

  @property
  def size(self) -> int:
    return self.matches * self.cap

  @property
  def depth(self) -> int:
    return self.cap

  def table(self, depth: int) -> np.ndarray:
    return mix_choice.matches_table(self.matches, self.cap, depth)

  def fixed_and_per_token(self, params, cost: PassCost, depth: int) -> tuple[float, float]:
    return 0.0, 0.0

  def start(self, params, prompt: Prompt, first: Int[Array, "B"], capacity: int, depth: int,
            **_) -> dict:
    history, length = branch_histories(prompt, capacity + depth + 1)
    return dict(history=history.at[jnp.arange(first.shape[0]), length].set(first),
                length=length + 1)

  def _matches(self, state):
    return lookup_matches(state.history, state.length, self.max_ngram_size, self.cap,
                          self.matches)  # [R, M, L], [R, M]

  def available(self, state) -> Int[Array, "R"]:
    return self._matches(state)[1].sum(axis=1)

  def propose(self, params, state, count, keys):
    tokens, counts = self._matches(state)
    rows = tokens.shape[0]
    live = jnp.arange(self.cap) < counts[..., None]  # [R, M, L]
    index = jnp.arange(self.size).reshape(self.matches, self.cap)  # [M, L]
    parent = jnp.where(jnp.arange(self.cap) > 0, index - 1, -1)
    flat = lambda x: jnp.broadcast_to(x, live.shape).reshape(rows, self.size)
    return Tree(tokens=flat(tokens), parent=flat(jnp.where(live, parent, trees.PAD)),
                depth=flat(jnp.where(live, jnp.arange(1, self.cap + 1), 0))), None, 0

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
  their whole tree every step."""

  heads: HeadsConfig
  target: ModelFn
  name: str = "heads"

  def available(self, state) -> Int[Array, "R"]:
    return jnp.full(state.last.shape, self.size, jnp.int32)


@dataclasses.dataclass(frozen=True)
class ParallelHeads(HeadsSource):
  """Parallel heads (a family's `Guess`) through a static tree: `nodes`, rank paths in
  order of value (`ordered_by_value`), node (r1 .. rd) head d's rank-rd guess."""

  nodes: tuple[tuple[int, ...], ...] = ()

  @property
  def size(self) -> int:
    return len(self.nodes)

  @property
  def depth(self) -> int:
    return max(map(len, self.nodes))

  @functools.cached_property
  def arrays(self) -> TreeArrays:
    """The tree's rows (`TreeArrays`), in the order of `nodes` (not tree order)."""
    index = {node: n for n, node in enumerate(self.nodes)}
    rows = ([index[node[:-1]] if len(node) > 1 else -1 for node in self.nodes],
            [len(node) for node in self.nodes], [len(node) - 1 for node in self.nodes],
            [node[-1] for node in self.nodes])
    return TreeArrays(*(np.asarray(a, np.int32) for a in rows))

  @property
  def guess(self) -> Guess:
    return get_family(self.heads.family).guesser(self.heads, self.target.config,
                                                  self.target.attention, self.depth)

  def used(self, params) -> dict:
    return {"target": params["target"],
            "heads": get_family(self.heads.family).first_heads(params["heads"], self.depth)}

  def table(self, depth: int) -> np.ndarray:
    per_rank = rank_accuracy(self.heads.top_accuracy or default_accuracy(self.depth))
    return mix_choice.tree_table([(node_value(node, per_rank), len(node))
                                  for node in self.nodes], depth)

  def fixed_and_per_token(self, params, cost: PassCost, depth: int) -> tuple[float, float]:
    return tree_choice.heads_fraction(self.used(params)["heads"], params["target"]) * cost(1), 0.0

  def start(self, params, prompt: Prompt, hidden, cache: KVCache, **_) -> dict:
    feed = Feed(prompt.positions, prompt.segments, prompt.topology())
    return dict(read=self.guess.start(self.used(params), hidden, prompt.branch_last, feed,
                                      cache.num_slots, cache.dtype))

  def propose(self, params, state, count, keys):
    used, arrays = self.used(params), self.arrays
    logits = self.guess.logits(used, state.read)  # [R, K, V]
    _, top = jax.lax.top_k(logits, arrays.num_ranks)  # [R, K, ranks]
    tokens = vocab.to_target(top[:, arrays.head, arrays.rank], used["heads"].get("draft_ids"))
    rows = tokens.shape[0]
    broadcast = lambda a: jnp.broadcast_to(jnp.asarray(a), (rows, a.size))
    return Tree(tokens=tokens.astype(jnp.int32), parent=broadcast(arrays.parent),
                depth=broadcast(arrays.depth)), None, self.guess.passes

  def after(self, params, before, state, verified: Verified, scratch, credited) -> dict:
    column = jnp.arange(verified.path.shape[1] + 1)[None, :]
    committed = (column <= verified.accepted[:, None]) & ~before.buffer.done[:, None]
    feed = Feed(before.next_pos[:, None] + column, jnp.where(committed, 0, -1), before.topology)
    return dict(read=self.guess.advance(self.used(params), before.read,
                                        verified.hidden_on_path(), verified.accepted, feed))


def ordered_by_value(tree, accuracy) -> tuple[tuple[int, ...], ...]:
  """A static tree's nodes best first (`node_value`; ties: the shallower, then the
  smaller): its first n are the best n-node tree (`build_tree`), parents first."""
  per_rank = rank_accuracy(accuracy)
  return tuple(sorted(tree, key=lambda node: (-node_value(node, per_rank), len(node), node)))


@dataclasses.dataclass(frozen=True)
class SequentialHead(HeadsSource):
  """A head that drafts one level at a time (its family's `draft_step`): EAGLE-2's tree
  of `tree_depth` levels and `top_k` children per expanded node, its `size` best nodes
  by score (`eagle.Eagle`'s drafting)."""

  tree_depth: int = 1
  top_k: int = 1
  size: int = 1

  @property
  def depth(self) -> int:
    return self.tree_depth

  @functools.cached_property
  def drafter(self) -> Eagle:
    return Eagle(model=self.target, heads=self.heads, tree_depth=self.tree_depth,
                 tree_top_k=self.top_k, tree_budget=self.size)

  @property
  def fed(self) -> int:
    """Nodes fed to the head's cache while drafting (`TreeDrafter.num_fed`)."""
    return self.drafter.num_fed

  def table(self, depth: int) -> np.ndarray:
    values = tree_choice.drafted_values(tree_choice.hashable(self.drafter.acceptance),
                                        self.tree_depth, self.top_k)
    return mix_choice.tree_table(values[:self.size], depth)

  def fixed_and_per_token(self, params, cost: PassCost, depth: int) -> tuple[float, float]:
    fraction = self.drafter.draft_fraction(params)
    return fraction * (cost(1 + depth) + (self.tree_depth - 1) * cost(self.top_k)), 0.0

  def start(self, params, prompt: Prompt, hidden, cache: KVCache, first, depth: int,
            topology, **_) -> dict:
    """The head's prefill: the prompt's tokens with the target's hidden states shifted by
    one (zeros at position 0); `first` pending, with the last prompt token's state."""
    batch = first.shape[0]
    config = get_family(self.heads.family).cache_config(self.heads, self.target.config)
    head_cache = KVCache.create(config, batch, cache.num_slots, cache.dtype)
    shifted = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))  # [B, P, H] h_{t-1}
    head_pass = self.drafter.head_pass_of(params)
    _, _, head_cache = head_pass(head_cache, prompt.tokens, prompt.positions, prompt.segments,
                                 topology, shifted, logits_at=jnp.zeros((batch, 0), jnp.int32))
    last = jnp.take_along_axis(hidden, prompt.branch_last[:, :1, None], axis=1)  # [B, 1, H]
    features = jnp.zeros((batch, 1 + depth, hidden.shape[-1]), hidden.dtype)
    return dict(read=HeadState(cache=head_cache, pending=widen(first[:, None], depth),
                               features=features.at[:, :1].set(last),
                               pending_count=jnp.ones((batch,), jnp.int32)))

  def propose(self, params, state, count, keys):
    """The catch-up pass (level 1 from its logits at `c`), then a pass per further level
    (`TreeDrafter.draft_tree`); the drafted nodes best score first, the first `size`.
    Scratch: the caught-up cache length, and the cache holding the fed nodes."""
    drafter, head_pass = self.drafter, self.drafter.head_pass_of(params)
    as_draft = dataclasses.replace(state, draft=state.read)
    logits, feature, cache = drafter.catch_up_head(head_pass, as_draft)
    front = jnp.broadcast_to(feature[:, None], (feature.shape[0], self.top_k, feature.shape[1]))
    drafted, carry = drafter.draft_tree(head_pass, as_draft, logits, cache, front,
                                         draft_ids=params["heads"].get("draft_ids"))
    rows = logits.shape[0]
    best = jnp.argsort(-carry.score, axis=1, stable=True)[:, :self.size]  # [R, M] parents first
    rank = jnp.full(carry.score.shape, -1, jnp.int32).at[jnp.arange(rows)[:, None], best].set(
        jnp.arange(self.size, dtype=jnp.int32))  # [R, N] its place among the best
    take = lambda x: jnp.take_along_axis(x, best, axis=1)
    parent = take(drafted.parent)
    parent = jnp.where(parent >= 0, jnp.take_along_axis(rank, jnp.maximum(parent, 0), axis=1), -1)
    tree = Tree(tokens=take(drafted.tokens), parent=parent, depth=take(drafted.depth))
    return tree, (cache.length, carry.cache), self.tree_depth

  def after(self, params, before, state, verified: Verified, scratch, credited) -> dict:
    caught_up, cache = scratch
    return dict(read=HeadState.after(verified, cache_ops.rollback(cache, caught_up)))


@dataclasses.dataclass(frozen=True)
class DraftModel:
  """A draft model's greedy chain (`drafting.draft_chain`)."""

  draft: ModelFn
  cap: int
  name: str = "draft"

  @property
  def size(self) -> int:
    return self.cap

  @property
  def depth(self) -> int:
    return self.cap

  def table(self, depth: int) -> np.ndarray:
    return mix_choice.chain_table([row[0] for row in tree_choice.DRAFT_ACCURACY], self.cap,
                                  depth)

  def fixed_and_per_token(self, params, cost: PassCost, depth: int) -> tuple[float, float]:
    fraction = tree_choice.draft_fraction(params["draft"], params["target"],
                                          reads_unembedding=False)
    return fraction * cost(2), fraction * cost(1)

  def start(self, params, prompt: Prompt, cache: KVCache, first, depth: int, **_) -> dict:
    start = DraftModelState.start(self.draft, params["draft"], prompt, cache, first)
    return dict(draft=dataclasses.replace(start, pending=widen(start.pending[:, :1], depth)))

  def available(self, state) -> Int[Array, "R"]:
    return jnp.full(state.last.shape, self.cap, jnp.int32)

  def propose(self, params, state, count, keys):
    logits, cache = drafting.catch_up(self.draft, params["draft"], state)
    schedule = Schedule(num_draft_tokens=self.cap, draft_schedule="constant", max_draft_tokens=0,
                        confidence_threshold=0.0)
    chain = drafting.draft_chain(self.draft, params["draft"], cache, logits, keys, state,
                                 schedule, Sampling.argmax(), budget=count)
    return trees.chain(chain.tokens, count), chain, chain.i

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
