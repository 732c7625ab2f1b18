r"""`speculative_tree`: the draft proposes a token tree (EAGLE-2), the target verifies
every node in one pass, the accepted path is compacted into contiguous slots.

Options: `tree_depth` D (levels drafted), `tree_top_k` K (children per expanded
node, and nodes expanded per level), `tree_budget` M (nodes the target verifies, at
most the K + (D - 1) K² drafted), plus the sampling options and `return_metadata`.
`tree_budget="auto"` (the default) chooses M, and D and K unless given, by the
measured cost of a target pass at the request's batch, or no tree at all
(`mdjax.strategies.tree_choice`); with an integer budget D and K default to 4.

Drafting, on the draft's own cache after it caught up on `pending`
(`drafting.catch_up`): level 1 is the K most likely tokens after the last emitted
token `c`. For each further level, the K nodes of the level above with the highest
cumulative log-probability (the frontier) are fed in one draft pass, each its own
segment seeing the committed text and its ancestors only, and each yields its K
most likely children. All drafted nodes are then ranked by cumulative
log-probability and the best M kept; a child never outscores its parent and ties
keep the shallower node, so the kept nodes form a tree. D = 3, K = 2, M = 6::

    draft pass 1   pending (ending in c)        -> level 1: a b
    draft pass 2   a b  (segments 1 2)          -> level 2: d e | f f'   frontier d e
    draft pass 3   d e  (segments 3 4, under 1) -> level 3: g g' | h h'
    kept           the best 6 of 2 + 4 + 4:  a b d e f g

Verifying and accepting: `mdjax.strategies.trees` (one target pass over `c` and the
kept nodes; greedy-exact, or lossless sampling by the tree rule).

The draft's cache keeps the accepted nodes it was fed (all but the last: `a`),
compacted the same way; the last accepted node and `x` become its `pending` tokens.

Statistics: `drafted_at` / `accepted_at` count the nodes drafted and accepted per
depth; `mean_accepted_length` is the accepted nodes per verify of a row. Metadata:
at a correction, `rejected` is the first child tried where the walk stopped.

`TreeDrafter` holds all of this but the draft itself: its drafting loop runs any
draft pass (`DraftPass`), so `eagle` drafts the same trees with its head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError, check_count
from mdjax.heads import vocab
from mdjax.sampling import log_softmax, process_logits
from mdjax.strategies import drafting, prompt_layouts, tree_choice, trees
from mdjax.strategies.base import Limits, ModelFn, Prompt, Sampled
from mdjax.strategies.drafting import DraftModelState, DraftState
from mdjax.strategies.pass_cost import pass_cost
from mdjax.strategies.registry import register
from mdjax.strategies.trees import Tree, Verified
from mdjax.topology import Topology

SLOT_MULTIPLE = 8  # attention's key blocks must divide the slot count: keep it composite
DEFAULT_DEPTH, DEFAULT_TOP_K = 4, 4  # the tree's shape with an integer tree_budget


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeDraft:
  """The tree drafting loop's carry (N = num_drafted, F = num_fed, K = tree_top_k).

    cache         KVCache        the draft's cache, holding the nodes fed so far
    tokens        int32[B, N]    every drafted node by level then rank (0 past the
                                 levels drafted so far)
    score         float32[B, N]  its cumulative log-probability (-inf past them)
    parent        int32[B, N]    drafted index of its parent (-1: a child of `c`)
    front         int32[B, K]    drafted index of the frontier: the nodes fed next
    front_parent  int32[B, K]    fed index of each frontier node's parent (-1: level 1)
    fed           int32[B, F]    drafted index of every node fed so far, by level
    fed_parent    int32[B, F]    fed index of its parent (-1: level 1)
    front_context [B, K, ...]    what each frontier node feeds besides its token (a
                                 pytree; EAGLE: float[B, K, H], the feature its parent's
                                 pass predicted); None for a draft model
  """

  cache: KVCache
  tokens: Int[Array, "B N"]
  score: Float[Array, "B N"]
  parent: Int[Array, "B N"]
  front: Int[Array, "B K"]
  front_parent: Int[Array, "B K"]
  fed: Int[Array, "B F"]
  fed_parent: Int[Array, "B F"]
  front_context: Any


# One draft pass over a level's frontier (K nodes per row, each its own segment):
# (cache, tokens, positions, segments, topology, front_context) ->
# (logits [B, K, V] after each node, the context each node passes to its children, cache).
DraftPass = Callable[[KVCache, Int[Array, "B K"], Int[Array, "B K"], Int[Array, "B K"], Topology,
                      Any], tuple[Float[Array, "B K V"], Any, KVCache]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeDrafter(Sampled):
  """What a dynamic-tree strategy (`speculative_tree`, `eagle`) does with the tree
  options: validate them, draft the tree with its `DraftPass`, keep the best
  `tree_budget` nodes, verify and commit them, size the caches, report."""

  tree_depth: int | None = None  # None: chosen by tree_budget="auto", else DEFAULT_DEPTH
  tree_top_k: int | None = None  # None: chosen by tree_budget="auto", else DEFAULT_TOP_K
  tree_budget: int | str = tree_choice.AUTO  # nodes verified, or "auto" (`tree_choice`)
  return_metadata: bool = False  # per-token metadata (`mdjax.strategies.metadata`)

  def __post_init__(self):
    super().__post_init__()
    tree_choice.check_budget(self.tree_budget, 1)
    for name, default in (("tree_depth", DEFAULT_DEPTH), ("tree_top_k", DEFAULT_TOP_K)):
      if getattr(self, name) is None and not self.auto:
        object.__setattr__(self, name, default)
      if getattr(self, name) is not None:
        check_count(name, getattr(self, name), 1)
    if self.tree_top_k is not None and self.tree_top_k > self.model.vocab_size:
      raise MdjaxError(f"tree_top_k ({self.tree_top_k}) exceeds the vocabulary "
                       f"({self.model.vocab_size} tokens)")
    if not self.auto and self.tree_budget > self.num_drafted:
      raise MdjaxError(f"tree_budget ({self.tree_budget}) exceeds the {self.num_drafted} nodes "
                       f"drafted with tree_depth {self.tree_depth} and tree_top_k "
                       f"{self.tree_top_k} (K + (D - 1) K²)")

  @property
  def auto(self) -> bool:
    """The tree is still to be chosen for the request (`for_request`)."""
    return self.tree_budget == tree_choice.AUTO

  def for_request(self, params, prompt: Prompt, capacity: int) -> Sampled:
    """With `tree_budget="auto"`: the depth, top-k and budget of the most expected tokens
    per second at this request's batch (the depth and top-k given are kept), or plain
    decoding when no tree pays (never with `return_metadata`, which describes drafts)."""
    if not self.auto:
      return self
    rows = prompt.tokens.shape[0]
    cost = pass_cost(self.model, params["target"], rows)
    choice = tree_choice.chosen_dynamic_tree(
        tree_choice.hashable(self.acceptance), cost, self.draft_fraction(params),
        tuple(self.catch_up_width(depth) for depth in range(1, tree_choice.MAX_DEPTH + 1)),
        (self.tree_depth,) if self.tree_depth else tuple(range(1, tree_choice.MAX_DEPTH + 1)),
        ((self.tree_top_k,) if self.tree_top_k
         else tuple(range(1, min(tree_choice.MAX_TOP_K, self.model.vocab_size) + 1))),
        tree_choice.Batch(rows=rows, new_tokens=capacity), allow_plain=not self.return_metadata)
    if choice.plain:
      return tree_choice.plain_decoding(self, params, prompt, capacity, choice)
    return dataclasses.replace(self, tree_depth=choice.depth, tree_top_k=choice.top_k,
                               tree_budget=choice.budget,
                               request_stats=choice.stats(self.sampling.greedy))

  @property
  def acceptance(self) -> tuple[tuple[float, ...], ...]:
    """The drafter's acceptance profile (`mdjax.strategies.tree_choice`)."""
    raise NotImplementedError

  def draft_fraction(self, params) -> float:
    """A draft pass's cost relative to a target pass (`tree_choice.draft_fraction`)."""
    raise NotImplementedError

  def catch_up_width(self, depth: int) -> int:
    """Tokens the drafter's first pass of a step feeds, with a tree `depth` deep."""
    raise NotImplementedError

  @property
  def num_drafted(self) -> int:
    return self.tree_top_k + (self.tree_depth - 1) * self.tree_top_k**2

  @property
  def num_fed(self) -> int:
    """Nodes fed to the draft: the frontier of every level but the last."""
    return (self.tree_depth - 1) * self.tree_top_k

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, the generated tokens, and room for one tree in either cache."""
    slots = prompt_len + capacity + 1 + max(self.tree_budget, self.num_fed)
    return -(-slots // SLOT_MULTIPLE) * SLOT_MULTIPLE

  def _log_probs(self, logits: Float[Array, "... V"]) -> Float[Array, "... V"]:
    return log_softmax(process_logits(logits, self.sampling))

  def draft_tree(self, draft_pass: DraftPass, state: DraftState, logits: Float[Array, "B V"],
                  draft_cache: KVCache, front_context: Any,
                  draft_ids: Int[Array, "Vd"] | None = None) -> tuple[Tree, TreeDraft]:
    """Every drafted node (`Tree`, N = num_drafted, by level then rank), and the loop's
    last carry: their cumulative log-probabilities, which of them were fed (by level)
    and the draft cache holding those. Level 1 comes from the draft's `logits` after
    `c` (level 1's `front_context` given); level d + 1 from one `draft_pass` over
    level d's frontier, each node its own segment (`Tree.topology` over the fed nodes).
    Logits over a draft vocabulary (`draft_ids`: the target id of each column) rank
    only its tokens, which the tree holds as target ids."""
    k, done, next_pos = self.tree_top_k, state.buffer.done, state.next_pos
    batch, num_drafted, num_fed = done.shape[0], self.num_drafted, self.num_fed
    score, token = jax.lax.top_k(self._log_probs(logits), k)  # [B, K]: level 1
    token = vocab.to_target(token, draft_ids)
    pad = lambda x, value: jnp.pad(x, ((0, 0), (0, num_drafted - k)), constant_values=value)
    fed_depth = jnp.broadcast_to(jnp.arange(num_fed) // k + 1, (batch, num_fed))
    take = lambda x, i: jnp.take_along_axis(x, i.reshape(i.shape + (1,) * (x.ndim - 2)), axis=1)

    def expand(level, carry: TreeDraft) -> TreeDraft:
      front = carry.front  # [B, K] drafted index of the nodes fed now
      fed = jax.lax.dynamic_update_slice_in_dim(carry.fed, front, level * k, axis=1)
      fed_parent = jax.lax.dynamic_update_slice_in_dim(carry.fed_parent, carry.front_parent,
                                                       level * k, axis=1)
      segments = 1 + level * k + jnp.arange(k)[None, :]  # [1, K]
      logits, context, cache = draft_pass(
          carry.cache, take(carry.tokens, front),
          jnp.broadcast_to((next_pos + level + 1)[:, None], front.shape),
          jnp.where(done[:, None], -1, segments),
          Tree(tokens=fed, parent=fed_parent, depth=fed_depth).topology(next_pos),
          carry.front_context)  # [B, K, V]
      child_score, child = jax.lax.top_k(self._log_probs(logits), k)  # [B, K, K]
      child = vocab.to_target(child, draft_ids)
      score = (take(carry.score, front)[..., None] + child_score).reshape(batch, k * k)
      start = k + level * k * k  # drafted index of the new level
      put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(x, new, start, axis=1)
      _, best = jax.lax.top_k(score, k)  # [B, K] the next frontier, within the new level
      return TreeDraft(cache=cache, tokens=put(carry.tokens, child.reshape(batch, k * k)),
                       score=put(carry.score, score),
                       parent=put(carry.parent, jnp.repeat(front, k, axis=1)),
                       front=start + best, front_parent=level * k + best // k,
                       fed=fed, fed_parent=fed_parent,
                       front_context=jax.tree.map(lambda x: take(x, best // k), context))

    carry = TreeDraft(cache=draft_cache, tokens=pad(token, 0), score=pad(score, -jnp.inf),
                      parent=jnp.full((batch, num_drafted), -1, jnp.int32),
                      front=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k)),
                      front_parent=jnp.full((batch, k), -1, jnp.int32),
                      fed=jnp.zeros((batch, num_fed), jnp.int32),
                      fed_parent=jnp.full((batch, num_fed), -1, jnp.int32),
                      front_context=front_context)
    if self.tree_depth > 1:  # (a zero-trip loop would still trace `expand` on empty arrays)
      carry = jax.lax.fori_loop(0, self.tree_depth - 1, expand, carry)
    depth = np.repeat(np.arange(1, self.tree_depth + 1), [k] + [k * k] * (self.tree_depth - 1))
    tree = Tree(tokens=carry.tokens, parent=carry.parent,
                depth=jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (batch, num_drafted)))
    return tree, carry

  def _keep(self, drafted: Tree, score: Float[Array, "B N"]) -> tuple[Tree, Int[Array, "B M"]]:
    """The `tree_budget` best-scored nodes, still in drafting order, and their drafted
    index. A stable sort puts a parent (earlier, never lower) before its children."""
    batch = score.shape[0]
    kept = jnp.sort(jnp.argsort(-score, axis=1, stable=True)[:, :self.tree_budget], axis=1)
    rank = jnp.full(score.shape, -1, jnp.int32).at[jnp.arange(batch)[:, None], kept].set(
        jnp.arange(self.tree_budget, dtype=jnp.int32))  # [B, N]: kept node of a drafted one
    take = lambda x: jnp.take_along_axis(x, kept, axis=1)  # [B, M]
    parent = take(drafted.parent)
    parent = jnp.where(parent >= 0, jnp.take_along_axis(rank, jnp.maximum(parent, 0), axis=1), -1)
    return Tree(tokens=take(drafted.tokens), parent=parent, depth=take(drafted.depth)), kept

  def _tree_step(self, target_params, state: DraftState, draft_pass: DraftPass,
                 logits: Float[Array, "B V"], draft_cache: KVCache, front_context: Any,
                 draft_ids: Int[Array, "Vd"] | None = None
                 ) -> tuple[DraftState, Verified, TreeDraft, Int[Array, "B D"]]:
    """A step after the draft caught up (its `logits` after `c`, its `draft_cache`, level
    1's `front_context`): the tree drafted, its best `tree_budget` nodes verified in one
    target pass and committed (`state.draft` untouched). Returns the state, the verified
    tree, the drafting loop's last carry, and the drafted index of each accepted node
    (-1 past them)."""
    keys = drafting.step_keys(state)
    drafted, carry = self.draft_tree(draft_pass, state, logits, draft_cache, front_context,
                                      draft_ids)
    tree, kept = self._keep(drafted, carry.score)
    verified = trees.verify(self.model, target_params, state, tree, self.tree_depth, keys,
                            self.sampling)
    path = verified.path  # [B, D]
    path_drafted = jnp.where(path >= 0, jnp.take_along_axis(kept, jnp.maximum(path, 0), axis=1),
                             -1)  # [B, D]
    state = trees.commit(state, tree, verified, self.sampling, draft_passes=self.tree_depth)
    return state, verified, carry, path_drafted

  def result(self, state: DraftState):
    drafted, accepted = state.drafted_at, state.accepted_at
    # every verify of a live row drafts exactly tree_budget nodes
    return state.buffer, drafting.stats(
        state, accepted.sum() * self.tree_budget / jnp.maximum(drafted.sum(), 1))


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeTree(TreeDrafter):
  """A draft model's token tree of `tree_budget` nodes, verified in one target pass."""

  name: ClassVar[str] = "speculative_tree"
  layout: ClassVar = prompt_layouts.Plain()

  draft: ModelFn | None = None  # `construct` turns the user's mdjax Model into its ModelFn

  def __post_init__(self):
    drafting.check_vocabulary(self.model, self.draft)
    super().__post_init__()

  @classmethod
  def construct(cls, target: ModelFn, model, options: dict) -> tuple["SpeculativeTree", dict]:
    return drafting.with_draft_model(cls, target, model, options)

  @property
  def acceptance(self) -> tuple[tuple[float, ...], ...]:
    return tree_choice.DRAFT_ACCURACY  # a draft model carries no measured profile

  def draft_fraction(self, params) -> float:
    return tree_choice.draft_fraction(params["draft"], params["target"], reads_unembedding=False)

  def catch_up_width(self, depth: int) -> int:
    return 2  # `DraftModelState.pending`: the last accepted node and the target's token

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> DraftState:
    return drafting.start(DraftState, self.model, self.draft, params, prompt, cache, limits,
                          capacity, self.sampling, positions=self.tree_depth,
                          return_metadata=self.return_metadata)

  def step(self, params, state: DraftState) -> DraftState:
    def draft_pass(cache, tokens, positions, segments, topology, context):
      logits, _, cache = self.draft(params["draft"], cache, tokens, positions, segments, topology)
      return logits, context, cache

    logits, draft_cache = drafting.catch_up(self.draft, params["draft"], state)
    state, verified, carry, path = self._tree_step(params["target"], state, draft_pass, logits,
                                                   draft_cache, None)
    return dataclasses.replace(state, draft=self._draft_after(carry, draft_cache.length, path,
                                                              verified))

  def _draft_after(self, drafted: TreeDraft, caught_up: Int[Array, "B"], path: Int[Array, "B D"],
                   verified: Verified) -> DraftModelState:
    """The draft cache keeps the accepted nodes it was fed (`path`: drafted indices,
    -1 past the accepted ones): every one but the last, which had children. The
    last accepted node and the target's token are what it has not seen (`pending`)."""
    accepted = verified.accepted  # [B]
    level = np.arange(self.num_fed) // self.tree_top_k  # [F] depth - 1 of each fed node
    kept = (path[:, level] == drafted.fed) & (level[None, :] + 1 < accepted[:, None])  # [B, F]
    last = jnp.take_along_axis(verified.emitted, jnp.maximum(accepted - 1, 0)[:, None],
                               axis=1)[:, 0]  # the last accepted node's token
    return DraftModelState.behind(
        cache_ops.compact(trees.keep_segments(drafted.cache, kept), caught_up, self.num_fed),
        accepted > 0, last, verified.next_token)
