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

`TreeDrafter` holds all of this but the draft itself: its drafting runs any
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
from mdjax.sampling import Sampling, log_softmax, process_logits
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
  """What drafting a tree leaves besides the tree (N = num_drafted, F = num_fed).

    cache  KVCache        the draft's cache, holding the fed nodes
    score  float32[B, N]  each drafted node's cumulative log-probability
    fed    int32[B, F]    drafted index of every fed node, by level (the frontiers)
  """

  cache: KVCache
  score: Float[Array, "B N"]
  fed: Int[Array, "B F"]


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
                               request_stats=choice.stats(self.greedy))

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

  def _top_k(self, logits: Float[Array, "B ... V"], sampling: Sampling
             ) -> tuple[Float[Array, "B ... K"], Int[Array, "B ... K"]]:
    """The `tree_top_k` likeliest tokens of each row and their log-probabilities. Ranked
    on the logits (the same order): only those K log-probabilities are formed, so on a
    GPU no [..., V] array of them is written (a kernel per draft pass)."""
    processed = process_logits(logits, sampling)
    _, token = jax.lax.top_k(processed, self.tree_top_k)
    return jnp.take_along_axis(log_softmax(processed), token, axis=-1), token

  def draft_tree(self, draft_pass: DraftPass, state: DraftState, logits: Float[Array, "B V"],
                  draft_cache: KVCache, front_context: Any,
                  draft_ids: Int[Array, "Vd"] | None = None) -> tuple[Tree, TreeDraft]:
    """Every drafted node (`Tree`, N = num_drafted, by level then rank), their cumulative
    log-probabilities, which of them were fed (by level) and the draft cache holding
    those. Level 1 comes from the draft's `logits` after `c` (level 1's `front_context`
    given: what each frontier node feeds besides its token, a pytree [B, K, ...]; EAGLE:
    the feature its parent's pass predicted); level d + 1 from one `draft_pass` over
    level d's frontier, each node its own segment (`Tree.topology` over the fed nodes).
    Logits over a draft vocabulary (`draft_ids`: the target id of each column) rank
    only its tokens, which the tree holds as target ids.

    The levels are unrolled (D - 1 passes): each level's nodes are arrays of their own,
    joined once at the end, and the frontier's indices stay small values, where a loop
    would store every carried array after each pass (a kernel each on a GPU)."""
    k, done, next_pos = self.tree_top_k, state.buffer.done, state.next_pos
    batch, num_fed = done.shape[0], self.num_fed
    score, token = self._top_k(logits, state.limits.sampling)  # [B, K]: level 1, the frontier
    token = vocab.to_target(token, draft_ids)
    tokens, scores, parents = [token], [score], [jnp.full((batch, k), -1, jnp.int32)]
    front = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))  # drafted index
    front_parent = jnp.full((batch, k), -1, jnp.int32)  # fed index of its parent (-1: level 1)
    fed, fed_parent = [], []  # per level: the frontier fed, and its parents
    fed_depth = jnp.broadcast_to(jnp.arange(num_fed) // k + 1, (batch, num_fed))
    padded = lambda parts, value: jnp.concatenate(parts + [jnp.full(
        (batch, num_fed - len(parts) * k), value, jnp.int32)], axis=1)  # [B, F]
    take = lambda x, i: jnp.take_along_axis(x, i.reshape(i.shape + (1,) * (x.ndim - 2)), axis=1)
    cache, context = draft_cache, front_context
    for level in range(self.tree_depth - 1):
      fed.append(front)
      fed_parent.append(front_parent)
      logits, context, cache = draft_pass(
          cache, token, jnp.broadcast_to((next_pos + level + 1)[:, None], (batch, k)),
          jnp.where(done[:, None], -1, 1 + level * k + jnp.arange(k)[None, :]),
          Tree(tokens=padded(fed, 0), parent=padded(fed_parent, -1),
               depth=fed_depth).topology(next_pos),
          context)  # [B, K, V]
      child_score, child = self._top_k(logits, state.limits.sampling)  # [B, K, K]
      child = vocab.to_target(child, draft_ids).reshape(batch, k * k)
      child_score = (score[..., None] + child_score).reshape(batch, k * k)
      tokens.append(child)
      scores.append(child_score)
      parents.append(jnp.repeat(front, k, axis=1))
      score, best = jax.lax.top_k(child_score, k)  # [B, K] the next frontier, in this level
      front, front_parent = k + level * k * k + best, level * k + best // k
      token = take(child, best)
      context = jax.tree.map(lambda x: take(x, best // k), context)
    depth = np.repeat(np.arange(1, self.tree_depth + 1), [k] + [k * k] * (self.tree_depth - 1))
    tree = Tree(tokens=jnp.concatenate(tokens, axis=1), parent=jnp.concatenate(parents, axis=1),
                depth=jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (batch, self.num_drafted)))
    return tree, TreeDraft(cache=cache, score=jnp.concatenate(scores, axis=1), fed=padded(fed, 0))

  def _keep(self, drafted: Tree, score: Float[Array, "B N"]) -> tuple[Tree, Int[Array, "B M"]]:
    """The `tree_budget` best-scored nodes, still in drafting order, and their drafted
    index. `top_k` ranks equal scores by index, so a parent (earlier, never lower)
    comes before its children. A kept node's parent is kept: its new index is the
    count of kept nodes before it (no scatter of every drafted node's rank)."""
    kept = jnp.sort(jax.lax.top_k(score, self.tree_budget)[1], axis=1)  # [B, M]
    take = lambda x: jnp.take_along_axis(x, kept, axis=1)  # [B, M]
    parent = take(drafted.parent)
    parent = jnp.where(parent >= 0, (kept[:, None, :] < parent[:, :, None]).sum(
        axis=2, dtype=jnp.int32), -1)  # [B, M, M] -> [B, M]
    return Tree(tokens=take(drafted.tokens), parent=parent, depth=take(drafted.depth)), kept

  def _tree_step(self, target_params, state: DraftState, draft_pass: DraftPass,
                 logits: Float[Array, "B V"], draft_cache: KVCache, front_context: Any,
                 draft_ids: Int[Array, "Vd"] | None = None
                 ) -> tuple[DraftState, Verified, TreeDraft, Int[Array, "B D"]]:
    """A step after the draft caught up (its `logits` after `c`, its `draft_cache`, level
    1's `front_context`): the tree drafted, its best `tree_budget` nodes verified in one
    target pass and committed (`state.draft` untouched). Returns the state, the verified
    tree, what drafting left (`TreeDraft`), and the drafted index of each accepted node
    (-1 past them)."""
    keys = drafting.step_keys(state)
    drafted, left = self.draft_tree(draft_pass, state, logits, draft_cache, front_context,
                                    draft_ids)
    tree, kept = self._keep(drafted, left.score)
    verified = trees.verify(self.model, target_params, state, tree, self.tree_depth, keys,
                            state.limits.sampling)
    path = verified.path  # [B, D]
    path_drafted = jnp.where(path >= 0, jnp.take_along_axis(kept, jnp.maximum(path, 0), axis=1),
                             -1)  # [B, D]
    state = trees.commit(state, tree, verified, state.limits.sampling, draft_passes=self.tree_depth)
    return state, verified, left, path_drafted

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
                          capacity, limits.sampling, positions=self.tree_depth,
                          return_metadata=self.return_metadata)

  def step(self, params, state: DraftState) -> DraftState:
    def draft_pass(cache, tokens, positions, segments, topology, context):
      logits, _, cache = self.draft(params["draft"], cache, tokens, positions, segments, topology)
      return logits, context, cache

    logits, draft_cache = drafting.catch_up(self.draft, params["draft"], state)
    state, verified, left, path = self._tree_step(params["target"], state, draft_pass, logits,
                                                  draft_cache, None)
    return dataclasses.replace(state, draft=self._draft_after(left, draft_cache.length, path,
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
