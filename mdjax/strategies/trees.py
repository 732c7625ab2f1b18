r"""Verifying a token tree in one target pass: what `speculative_tree`, `medusa`,
`blockwise` and `eagle` share.

A tree of M nodes hangs under the last emitted token `c` (at `next_pos`); node n
holds `tokens[:, n]` under node `parent[:, n]` (-1: a child of `c`), `depth[:, n]`
levels below `c`, parents before children. The target feeds `c` (segment 0, the
committed text) and the M nodes; node n is a segment of its own (numbered after the
prompt's segments: 1 + n below, for a prompt of one), forked from its parent's
segment at its own position (committed length + depth), so it sees the committed
text and its ancestors only. With `c` at position 7::

          c                 feed     c  a  b  d  e  f  g
        /   \               seg      0  1  2  3  4  5  6     parent [-1, 0, 0, 1, 1, 2, 3]
       a     b              pos      7  8  8  9  9  9 10     fork   [ 0, 8, 8, 9, 9, 9,10]
      / \     \             q(g) sees ...committed, c, a, d, g  (not b, e, f)
     d   e     f
     |
     g

Accepting (`mdjax.sampling.tree_accept`): from `c`, the children are tried in the
order the drafter ranked them. Greedy keeps the child equal to the target's argmax,
so the output is exactly the target's greedy decoding; sampling keeps child x with
probability p(x) after zeroing the children rejected before it, so the output
follows the target's sampling law. Say `a` then `e` are kept and the target's token
after `e` is `x`: emit `a e x`. The accepted nodes join segment 0, the rest die,
and `compact` closes the gaps after the committed text (nothing before `c`'s slot L
moves)::

    token      ... | c  a  b  d  e  f  g      length L + 7
    seg          0 | 0  1  2  3  4  5  6
    remapped     0 | 0  0 -1 -1  0 -1 -1
    compacted  ... | c  a  e                  length L + 3
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from mdjax import cache as cache_ops
from mdjax import controls
from mdjax.cache import KVCache
from mdjax.sampling import Sampling, process_logits, tree_accept, with_ancestors
from mdjax.strategies import drafting, metadata
from mdjax.strategies.base import ModelFn, Scored
from mdjax.strategies.drafting import DraftState, State
from mdjax.strategies.widths import narrowest_width, run_narrowest
from mdjax.topology import Topology


PAD = -2  # the parent of a padding node: no walk from the root ever reaches it
LADDER = (1, 8, 12, 16, 24, 32, 48, 64)  # narrow verify widths (`tree_widths`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
  """Drafted nodes, parents before children: `tokens`, `parent` (node index, -1 for a
  child of the last emitted token), `depth` (1 for those children): int32[B, N]. A
  padding node has depth 0 and parent `PAD`: it is not fed and never accepted (a tree
  of fewer nodes than its static width, `merge_trees`). Siblings hold distinct tokens
  (a drafter's top-k, a trie), which greedy acceptance relies on (`greedy_path`)."""

  tokens: Int[Array, "B N"]
  parent: Int[Array, "B N"]
  depth: Int[Array, "B N"]

  def topology(self, next_pos: Int[Array, "B"]) -> Topology:
    """Segment 0 (the committed text, `c` at `next_pos`), node n in segment 1 + n."""
    return Topology(parent=jnp.pad(self.parent + 1, ((0, 0), (1, 0)), constant_values=-1),
                    fork=jnp.pad(next_pos[:, None] + self.depth, ((0, 0), (1, 0))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Verified:
  """One verified tree (D = the deepest level, M = nodes).

    path        int32[B, D]         the accepted node per level, -1 past the accepted ones
    accepted    int32[B]            accepted nodes
    next_token  int32[B]            the target's own token after them
    emitted     int32[B, 1 + D]     the accepted tokens, then `next_token`
    logits      float32[B, 1+M, V]  the target's, after `c` and after each node (None
                                    where `verify` read only their argmax)
    hidden      float[B, 1 + M, D]  the target's final-norm hidden states there
    cache       KVCache             the target's cache with `c` and the accepted nodes
                                    compacted after the committed text
  """

  path: Int[Array, "B D"]
  accepted: Int[Array, "B"]
  next_token: Int[Array, "B"]
  emitted: Int[Array, "B D+1"]
  logits: Float[Array, "B M+1 V"] | None
  hidden: Float[Array, "B M+1 D"]
  cache: KVCache

  def hidden_on_path(self) -> Float[Array, "B D+1 H"]:
    """The target's hidden states at `c`, then at each accepted node (the committed
    tokens, in order; past the `accepted` ones, `c`'s again)."""
    fed = jnp.pad(self.path + 1, ((0, 0), (1, 0)))  # [B, 1 + D] fed column
    return jnp.take_along_axis(self.hidden, fed[..., None], axis=1)

  def hidden_at_last(self) -> Float[Array, "B H"]:
    """The target's hidden state at the last accepted node (`c` when none was): what
    guesses the tokens after `next_token`."""
    return jnp.take_along_axis(self.hidden_on_path(), self.accepted[:, None, None],
                               axis=1)[:, 0]


def _node_segments(rows: int, branches: int, shared: int, budget: int) -> Int[Array, "R M"]:
  """The segment of each node of a verify pass: node n of row r (branch j = r % N of
  its batch row) is segment `shared` + j M + n, after the prompt's G = `shared`."""
  return shared + (jnp.arange(rows) % branches)[:, None] * budget + jnp.arange(budget)


def pass_parents(prompt_parent: Int[Array, "B G"], parent: Int[Array, "R M"],
                 segment: Int[Array, "R"]) -> Int[Array, "B G+N*M"]:
  """The parent of every segment of a verify pass (`verify`; R = B x N branches, M
  nodes each): the prompt's G, then branch j's node n (segment G + j M + n) under its
  parent node's segment, or under the branch's `segment` for a child of `c`."""
  rows, budget = parent.shape
  batch, shared = prompt_parent.shape
  under = jnp.where(parent >= 0, jnp.take_along_axis(
      _node_segments(rows, rows // batch, shared, budget), jnp.maximum(parent, 0), axis=1),
                    segment[:, None])  # [R, M]
  return jnp.concatenate([prompt_parent, under.reshape(batch, -1)], axis=1)


def verify(model: ModelFn, params, state: DraftState, tree: Tree, depth: int, keys: jax.Array,
           sampling: Sampling, accept=tree_accept,
           branch_segment: Int[Array, "R"] | None = None, narrow: bool = False,
           keep_logits: bool = True, parents: Int[Array, "B G+N*M"] | None = None) -> Verified:
  """One target pass over every row's last emitted token and its `tree` (at most
  `depth` levels deep), accepted with the target's distributions by `accept`
  (`tree_accept`'s signature; by default the exact rule), or when greedy by
  `greedy_path` (what either rule gives on a one-hot p, with no draw over the
  vocabulary), the rejected nodes dropped from the cache.

  Rows are output rows. With branches, `branch_segment` [R] is the segment each
  decodes in (-1: none) and R = B x N: row b * N + j is branch j of cache row b,
  whose N trees are fed side by side; `c` goes to the branch's segment, the nodes to
  segments after the prompt's (`state.topology`), and the accepted ones join the
  branch's segment. None: one branch per cache row, in segment 0 (the drawing).

  `narrow` (one branch per row, padding nodes last): the pass runs only as wide as
  the row with the most real nodes needs, on the narrowest of `tree_widths`
  (`widths.run_narrowest`). Greedy without `keep_logits` then takes the argmax of each
  fed column inside the pass and pads that, not the logits (`Verified.logits` None):
  padding `[B, 1 + M, V]` logits and reducing them over the vocabulary costs what a
  few more fed columns do (SmolLM2's 49k tokens, 30 columns: ~5 ms on a 2-core CPU).

  `parents`: the pass's `pass_parents`, where the caller keeps them (a tree of the same
  parents every step: built once, not every step).
  """
  rows, budget = tree.tokens.shape
  batch = state.cache.length.shape[0]
  branches, shared = rows // batch, state.topology.parent.shape[1]
  segment = jnp.zeros((rows,), jnp.int32) if branch_segment is None else branch_segment  # [R]
  per_row = lambda x: x.reshape(batch, -1)  # [R, ...] -> [B, N x ...]: a cache row's branches
  node_segment = _node_segments(rows, branches, shared, budget)  # [R, M]
  if parents is None:
    parents = pass_parents(state.topology.parent, tree.parent, segment)
  # the prompt's forks, then the nodes' (each at its own position): a select of two pads, which
  # a GPU fuses into the kernels that read it, where a concatenate read by several is a kernel
  fork = per_row(state.next_pos[:, None] + tree.depth)  # [B, N x M]
  fork = jnp.where(jnp.arange(shared + fork.shape[1]) < shared,
                   jnp.pad(state.topology.fork, ((0, 0), (0, fork.shape[1]))),
                   jnp.pad(fork, ((0, 0), (shared, 0))))  # [B, G + N x M]
  topology = Topology(parent=parents, fork=fork)
  level = jnp.pad(tree.depth, ((0, 0), (1, 0)))  # [R, 1 + M]: c's 0, then each node's
  # c in its branch's segment, the nodes in theirs; padding nodes are not fed (selects of
  # pads, not concatenates: see `fork`)
  fed = jnp.where(jnp.arange(budget + 1) == 0, segment[:, None],
                  jnp.where(level > 0, jnp.pad(node_segment, ((0, 0), (1, 0))), -1))  # [R, 1 + M]
  fed = per_row(jnp.where(state.buffer.done[:, None], -1, fed))
  tokens = per_row(jnp.concatenate([state.last[:, None], tree.tokens], axis=1))
  # an unfed column's position is never read: 0, so that the positions are a function of
  # `fed` and one kernel on a GPU writes both
  positions = jnp.where(fed >= 0, per_row(state.next_pos[:, None] + level), 0)
  argmax_only = narrow and sampling.greedy and not keep_logits and state.limits.controls is None
  if narrow:
    logits, hidden, cache = _narrowest_pass(model, params, state.cache, tokens, positions, fed,
                                            topology, argmax_only)
  else:
    logits, hidden, cache = model(params, state.cache, tokens, positions, fed,
                                  topology)  # [B, N (1 + M), V]
  hidden = hidden.reshape(rows, budget + 1, -1)
  if argmax_only:
    chosen, logits = logits.reshape(rows, budget + 1), None  # [R, 1 + M]
  else:
    context = controls.Context.tree(state.buffer.tokens, state.buffer.count, tree.tokens,
                                    tree.parent, tree.depth, depth)  # columns: root, nodes
    logits = controls.process(logits.reshape(rows, budget + 1, -1), state.limits.controls,
                              context, state.limits.eos_ids)  # [R, 1 + M, V]
    chosen = jnp.argmax(logits, axis=-1) if sampling.greedy else None
  if sampling.greedy:  # `accept`'s result on a one-hot p, with no draw over the vocabulary
    path, next_token = greedy_path(tree, chosen, depth)  # [R, D], [R]
  else:
    path, next_token = accept(drafting.fold_in(keys, drafting.ACCEPT_KEY), tree.tokens,
                              tree.parent, drafting.probs(logits, sampling), depth)
  # unrolled, not a reduction (which a GPU runs as a kernel of its own)
  accepted = sum(path[:, d] >= 0 for d in range(depth)).astype(jnp.int32)  # [R]
  path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1)  # [R, D]
  emitted = jnp.where(jnp.arange(depth + 1)[None, :] < accepted[:, None],
                      jnp.pad(path_tokens, ((0, 0), (0, 1))), next_token[:, None])  # [R, 1 + D]
  on_path = (path[:, :, None] == jnp.arange(budget)).any(axis=1)  # [R, M]
  mapping = jnp.concatenate([jnp.broadcast_to(jnp.arange(shared), (batch, shared)),
                             per_row(jnp.where(on_path, segment[:, None], -1))], axis=1)
  cache, cached = cache_ops.remap_segments(cache, mapping), state.cache.length
  if branches == 1:  # c and the path's nodes move to the front: in feed order, fed ones only
    slot = cached[:, None] + jnp.cumsum(fed >= 0, axis=1) - 1  # [B, 1 + M] a fed column's
    kept = jnp.pad(path + 1, ((0, 0), (1, 0)))  # [B, 1 + D] fed columns of c and the path
    cache = cache_ops.move_slots(cache, cached, jnp.take_along_axis(slot, kept, axis=1),
                                 jnp.where(fed[:, 0] >= 0, 1 + accepted, 0))
  else:
    cache = cache_ops.compact(cache, cached, branches * (budget + 1))
  return Verified(path=path, accepted=accepted, next_token=next_token, emitted=emitted,
                  logits=logits, hidden=hidden, cache=cache)


def greedy_path(tree: Tree, chosen: Int[Array, "B N+1"], depth: int
                ) -> tuple[Int[Array, "B D"], Int[Array, "B"]]:
  """`mdjax.sampling.tree_accept`'s result (path [B, depth], next token [B]) where p is
  one-hot at the target's choice `chosen` (column 0 the root, 1 + n after node n),
  without drawing from the vocabulary (`typical_accept` gives the same there): from the
  root, the child holding the target's token after its parent is accepted; then
  `chosen` after the last accepted node. For a tree whose siblings hold distinct tokens
  (a drafter's top-k, a trie), found for every node at once instead of by a walk: a node
  is accepted when it and each of its ancestors hold the target's token after their
  parent (`mdjax.sampling.with_ancestors`), and each level's accepted
  node is a select per node. No reduction: on a GPU it all fuses into the kernels that
  read the path, where a walk's reduction per level is a kernel (two with the step
  between levels)."""
  nodes = tree.tokens.shape[1]
  # every index below is in bounds (a parent clipped at 0): the reads check no bounds
  take = lambda x, i: jnp.take_along_axis(x, i, axis=1, mode="promise_in_bounds")
  hit = (tree.tokens == take(chosen, jnp.maximum(tree.parent + 1, 0))) & (tree.parent >= -1)
  accepted = with_ancestors(hit, tree.parent, depth)  # [B, N]
  # at most one accepted node per level (siblings differ)
  at = accepted[:, None, :] & (tree.depth[:, None, :] == jnp.arange(1, depth + 1)[:, None])
  path = jnp.full(at.shape[:2], -1, jnp.int32)  # [B, D]
  for n in range(nodes):
    path = jnp.where(at[:, :, n], n, path)
  last = path[:, 0]  # the deepest accepted node: parents come before children
  for d in range(1, depth):
    last = jnp.maximum(last, path[:, d])
  return path, take(chosen, (last + 1)[:, None])[:, 0].astype(jnp.int32)


def commit(state: State, tree: Tree, verified: Verified, sampling: Sampling, *,
           draft_passes) -> State:
  """`drafting.commit` of a verified tree: the emitted tokens, the compacted cache, the
  nodes drafted and accepted per depth, and the path's metadata when recorded."""
  depth = verified.path.shape[1]
  live = ~state.buffer.done[:, None]
  return drafting.commit(
      state, cache=verified.cache, emitted=verified.emitted, accepted=verified.accepted,
      draft_passes=draft_passes,
      drafted=(live[..., None] & (tree.depth[..., None] == jnp.arange(1, depth + 1))).sum(
          axis=1, dtype=jnp.int32),  # [B, D] nodes per depth
      accepted_at=live & (verified.path >= 0),
      token_metadata=lambda: path_metadata(tree, verified, sampling),
      scored=None if verified.logits is None else Scored.requested(
          process_logits(_along_path(verified), sampling), verified.emitted, state.limits))


def _along_path(verified: Verified) -> Float[Array, "R D+1 V"]:
  """The logits each emitted token was chosen from: the root's, then after each node
  of the accepted path."""
  rows = jnp.arange(verified.path.shape[0])[:, None]
  return verified.logits[rows, jnp.pad(verified.path + 1, ((0, 0), (1, 0)))]


def path_metadata(tree: Tree, verified: Verified, sampling: Sampling):
  """`metadata.verified` along the accepted path. At a correction the rejected token
  is the first child tried where the walk stopped (the drafter's best guess there)."""
  path, accepted, emitted = verified.path, verified.accepted, verified.emitted
  rows = jnp.arange(path.shape[0])[:, None]
  before = jnp.pad(path + 1, ((0, 0), (1, 0)))  # [B, 1 + D]: what each emitted token follows
  stop = jnp.take_along_axis(before, accepted[:, None], axis=1) - 1  # [B, 1]: -1 the root
  child = tree.parent == stop  # [B, M]
  tried = jnp.take_along_axis(tree.tokens, jnp.argmax(child, axis=1)[:, None], axis=1)  # [B, 1]
  proposal = jnp.where(jnp.arange(path.shape[1]) == accepted[:, None], tried,
                       emitted[:, :-1])  # [B, D]
  return metadata.verified(drafting.probs(verified.logits[rows, before], sampling), emitted,
                           proposal, accepted + child.any(axis=1), accepted)


def chain(tokens: Int[Array, "B L"], count: Int[Array, "B"]) -> Tree:
  """A chain as a tree: token d under token d - 1, the first `count` real (the rest
  padding)."""
  live = jnp.arange(tokens.shape[1])[None, :] < count[:, None]
  return Tree(tokens=tokens, parent=jnp.where(live, jnp.arange(tokens.shape[1]) - 1, PAD),
              depth=jnp.where(live, jnp.arange(1, tokens.shape[1] + 1), 0))


def merge_trees(proposals: Sequence[Tree], used: Sequence[Bool[Array, "B N"]], budget: int,
                depth: int) -> tuple[Tree, list[Int[Array, "B N"]]]:
  """One trie of several drafters' trees (each parents before children; `used[s]` its
  nodes that join, a set closed under parents), at most `budget` nodes, at most `depth`
  levels, padding last. A path two nodes share is one node: a node joins the first node,
  source by source and node by node, that holds the same tokens from the root down
  (within one source too). Nodes come source by source, in each source's order, so
  cutting the trie at `budget` nodes keeps the first sources' and each source's first
  nodes. Three sources (a chain, a tree, a chain), `budget` 5::

      source 0   a b c              trie     c ── a ── b ── c
      source 1   a b d  +  a e                     │    └── d
      source 2   e f                               └── e          (a e: source 1)
                                             nodes    a b c d e   (source 2's e f cut)

  Returns the trie and, per source, `node_of [B, N_s]`: the trie node holding its node
  (-1: not in the trie), so a source is credited with the accepted path's nodes it
  holds."""
  sizes = [tree.tokens.shape[1] for tree in proposals]
  offset = np.cumsum([0] + sizes)
  tokens = jnp.concatenate([tree.tokens for tree in proposals], axis=1)  # [B, N]
  live = jnp.concatenate([u & (tree.depth > 0) for tree, u in zip(proposals, used)], axis=1)
  parent = jnp.concatenate([jnp.where(tree.parent >= 0, tree.parent + offset[s], -1)
                            for s, tree in enumerate(proposals)], axis=1)  # [B, N] flat
  level = jnp.concatenate([tree.depth for tree in proposals], axis=1)
  rows, width = tokens.shape
  # path[b, n, d]: the token at depth d + 1 on node n's path (-1 below n)
  path = jnp.full((rows, width, depth), -1, jnp.int32)
  at = jnp.broadcast_to(jnp.arange(width), (rows, width))  # [B, N] each node's ancestor
  for _ in range(depth):
    safe = jnp.maximum(at, 0)
    here = (at >= 0)[..., None] & (jnp.take_along_axis(level, safe, axis=1)[..., None]
                                   == jnp.arange(1, depth + 1))  # [B, N, D]
    path = jnp.where(here, jnp.take_along_axis(tokens, safe, axis=1)[..., None], path)
    at = jnp.where(at >= 0, jnp.take_along_axis(parent, safe, axis=1), -1)
  same = ((path[:, :, None] == path[:, None, :]).all(axis=-1) & live[:, :, None]
          & live[:, None, :])  # [B, N, N]
  first = jnp.argmax(same, axis=2)  # [B, N] the first node of the same path
  own = live & (first == jnp.arange(width))  # [B, N] a trie node
  order = jnp.argsort(~own, axis=1, stable=True)  # [B, N] trie nodes first, in flat order
  index = jnp.argsort(order, axis=1)  # [B, N] flat -> packed
  order = order[:, :budget]
  index = jnp.where(own & (index < budget), index, -1)  # [B, N] packed node of a trie node
  take = lambda x: jnp.take_along_axis(x, order, axis=1)
  kept = take(index >= 0)
  parent_node = jnp.take_along_axis(first, jnp.maximum(parent, 0), axis=1)  # its trie node
  new_parent = jnp.where(parent >= 0, jnp.take_along_axis(index, parent_node, axis=1), -1)
  tree = Tree(tokens=take(tokens), parent=jnp.where(kept, take(new_parent), PAD),
              depth=jnp.where(kept, take(level), 0))
  node_of = jnp.where(live, jnp.take_along_axis(index, first, axis=1), -1)  # [B, N]
  return tree, [node_of[:, offset[s]:offset[s + 1]] for s in range(len(proposals))]


def keep_segments(cache: KVCache, keep: Bool[Array, "B N"]) -> KVCache:
  """Segment 0 and the tree segments 1 + n with `keep[:, n]` become segment 0; the
  other tree segments die."""
  mapping = jnp.where(keep, 0, -1).astype(jnp.int32)
  return cache_ops.remap_segments(cache, jnp.pad(mapping, ((0, 0), (1, 0))))


def tree_widths(width: int) -> tuple[int, ...]:
  """The columns a narrow verify of `width` columns may run on, widest first: `width`
  and the `LADDER` below it. From 8 columns up each rung is at most 1.5x the one before,
  so a pass runs at most half again its fed columns: on a 2-core CPU a further column
  of SmolLM2-135M in bfloat16 costs ~3% of a pass (a pass of 15 columns: 1.4x one of
  6). Below 8 a pass costs little more than one column does (its matmuls stream the
  weights: its measured t(8) is 1.09 t(1)), and a rung at 6 gained ~2% of a step with
  6 fed columns, so none lies between 1 and 8. Each width is one more compiled pass
  (the whole model, unrolled on the CPU: ~9 s of compile each for SmolLM2-135M)."""
  return (width,) + tuple(w for w in reversed(LADDER) if w < width)


def verify_width(width: int, fed: int) -> int:
  """(host) The columns a narrow verify of `width` columns runs with `fed` fed."""
  return narrowest_width(tree_widths(width), fed)


def _narrowest_pass(model: ModelFn, params, cache: KVCache, tokens: Int[Array, "B W"],
                    positions: Int[Array, "B W"], segments: Int[Array, "B W"],
                    topology: Topology, argmax_only: bool):
  """`model` over the first columns of `tokens` that hold every row's fed ones (segment
  >= 0 first, then padding): the logits `[B, W, V]` (with `argmax_only`, their argmax
  `[B, W]`) and hidden states, zeros at the columns not fed."""
  width = tokens.shape[1]

  def at(fed: int):
    def feed(carry):
      logits, hidden, cache = model(params, carry[2], tokens[:, :fed], positions[:, :fed],
                                    segments[:, :fed], topology)
      if argmax_only:
        logits = jnp.argmax(logits, axis=-1)  # [B, fed]
      pad = lambda x: jnp.pad(x, ((0, 0), (0, width - fed)) + ((0, 0),) * (x.ndim - 2))
      return pad(logits), pad(hidden), cache
    return feed

  shapes = jax.eval_shape(at(width), (None, None, cache))
  unfed = tuple(jnp.zeros(x.shape, x.dtype) for x in shapes[:2])
  carry, _ = run_narrowest(tree_widths(width), (segments >= 0).sum(axis=1).max(), at,
                           (*unfed, cache))
  return carry
