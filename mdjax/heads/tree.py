r"""Static sparse Medusa trees: which of the heads' top-k guesses the target verifies.

A tree is a tuple of nodes, each node the path of ranks that leads to it from the
root `c` (the last emitted token: the target's own). Depth d is head d's guess (the
token d places after `c`), so node (0, 1) is head 1's top-1 token, then head 2's
top-2 token under it. The tree ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))::

               c                          node    (0,) (1,) (0,0) (0,1) (1,0) (0,0,0)
            /     \                       parent   -1   -1    0     0     1     2
         (0,)      (1,)      head 1       depth     1    1    2     2     2     3
         /  \         \                   head      0    0    1     1     1     2
     (0,0)  (0,1)    (1,0)   head 2       rank      0    1    0     1     0     0
       |
    (0,0,0)                  head 3

`TreeArrays` holds those rows (`head` is the 0-based head index, depth - 1); node n's
token is then `top_k(head logits)[head[n], rank[n]]`. Nodes are ordered parents
before children, each node's children in rank order (the order `tree_accept` tries
them): shallower first, then lexicographically (`check_tree` sorts a given tree so).

Building one (Medusa's greedy construction, `build_tree`): `top_accuracy[k][j]` is
head k's held-out cumulative top-(j + 1) accuracy, so head k's rank j is right with
probability `top_accuracy[k][j] - top_accuracy[k][j - 1]`. Treating the heads as
independent, node (r1, ..., rd) is accepted with probability (its *value*) the
product of its ranks' accuracies, and a tree's expected accepted length per target
pass is 1 (the target's own token) + the sum of its values (`expected_length`). A
child is never worth more than its parent, so adding the best node whose parent is
in the tree, `budget` times (ties: the shallower, then the lexicographically
smaller), maximises it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

from mdjax.errors import MdjaxError, check_count

Node = tuple[int, ...]
MedusaTree = tuple[Node, ...]

# The guesses used when heads carry no measured accuracies: head k (from 1) is right
# at top-1 with probability 0.6 * 0.75^(k - 1), and each further rank is right 0.4
# times as often as the one before it (cumulative top-(j + 1) = top-1 * (1 - 0.4^(j + 1)) / 0.6).
DEFAULT_TOP1, HEAD_DECAY, RANK_DECAY, DEFAULT_RANKS = 0.6, 0.75, 0.4, 10


def default_accuracy(num_heads: int, num_ranks: int = DEFAULT_RANKS
                     ) -> tuple[tuple[float, ...], ...]:
  """A cumulative top-k accuracy table of decaying guesses (see `DEFAULT_TOP1`)."""
  check_count("num_heads", num_heads, 1)
  check_count("num_ranks", num_ranks, 1)
  return tuple(tuple(DEFAULT_TOP1 * HEAD_DECAY**k * (1 - RANK_DECAY**(j + 1)) / (1 - RANK_DECAY)
                     for j in range(num_ranks)) for k in range(num_heads))


def rank_accuracy(top_accuracy) -> list[np.ndarray]:
  """Per head, the probability that exactly its rank j is right: differences of the
  cumulative accuracies (rows may differ in length). Raises `MdjaxError` on a table
  that is not cumulative accuracies."""
  if not top_accuracy or any(len(row) == 0 for row in top_accuracy):
    raise MdjaxError(f"top_accuracy needs one non-empty row per head, got {top_accuracy!r}")
  rows = []
  for k, row in enumerate(top_accuracy):
    row = np.asarray(row, np.float64)
    if not (np.all(np.isfinite(row)) and np.all((row >= 0) & (row <= 1))
            and np.all(np.diff(row) >= 0)):
      raise MdjaxError(f"top_accuracy row {k} must be non-decreasing cumulative accuracies in "
                       f"[0, 1], got {tuple(row.tolist())}")
    rows.append(np.diff(row, prepend=0.0))
  return rows


def node_value(node: Node, per_rank: list[np.ndarray]) -> float:
  """The probability that every guess on `node`'s path is right (0 past the table)."""
  value = 1.0
  for head, rank in enumerate(node):
    if head >= len(per_rank) or rank >= per_rank[head].size:
      return 0.0
    value *= float(per_rank[head][rank])
  return value


def build_tree(top_accuracy, budget: int, max_depth: int | None = None) -> MedusaTree:
  """The `budget`-node tree of the largest expected accepted length (module docstring)
  for heads of `top_accuracy`, at most `max_depth` deep (default: one level per head)."""
  per_rank = rank_accuracy(top_accuracy)
  check_count("tree budget", budget, 1)
  depth = len(per_rank) if max_depth is None else max_depth
  check_count("max_depth", depth, 1)
  if depth > len(per_rank):
    raise MdjaxError(f"max_depth ({depth}) exceeds the {len(per_rank)} heads of the accuracy "
                     "table")
  available = sum(math.prod(per_rank[k].size for k in range(d)) for d in range(1, depth + 1))
  if budget > available:
    raise MdjaxError(f"tree budget ({budget}) exceeds the {available} nodes the accuracy table "
                     f"allows at depth {depth}")
  frontier = [(-node_value((j,), per_rank), 1, (j,)) for j in range(per_rank[0].size)]
  heapq.heapify(frontier)
  tree = []
  while len(tree) < budget:
    _, length, node = heapq.heappop(frontier)
    tree.append(node)
    if length < depth:
      for j in range(per_rank[length].size):
        child = node + (j,)
        heapq.heappush(frontier, (-node_value(child, per_rank), length + 1, child))
  return tuple(sorted(tree, key=lambda n: (len(n), n)))


def expected_length(tree: MedusaTree, top_accuracy) -> float:
  """Expected tokens per target pass: 1 + the sum of the nodes' values."""
  per_rank = rank_accuracy(top_accuracy)
  return 1.0 + sum(node_value(node, per_rank) for node in tree)


def check_tree(tree, num_heads: int, vocab_size: int) -> MedusaTree:
  """`tree` as a `MedusaTree` in tree order (parents first, children in rank order);
  raises `MdjaxError` naming the node that is not a path of ranks < `vocab_size`, at
  most `num_heads` long, under a node of the tree."""
  if not isinstance(tree, (list, tuple)) or not tree:
    raise MdjaxError(f"a tree must be a non-empty sequence of nodes (rank paths), got {tree!r}")
  nodes = []
  for node in tree:
    if (not isinstance(node, (list, tuple)) or not node
        or not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0
                   for r in node)):
      raise MdjaxError(f"tree node {node!r} is not a non-empty path of ranks (integers >= 0)")
    nodes.append(tuple(int(r) for r in node))
  present = set(nodes)
  if len(present) < len(nodes):
    raise MdjaxError(f"tree node {next(n for n in nodes if nodes.count(n) > 1)} appears twice")
  for node in nodes:
    if len(node) > num_heads:
      raise MdjaxError(f"tree node {node} is {len(node)} deep, but only {num_heads} heads guess")
    if max(node) >= vocab_size:
      raise MdjaxError(f"tree node {node} asks for rank {max(node)}, beyond the vocabulary "
                       f"({vocab_size} tokens)")
    if len(node) > 1 and node[:-1] not in present:
      raise MdjaxError(f"tree node {node} has no parent {node[:-1]} in the tree")
  return tuple(sorted(nodes, key=lambda n: (len(n), n)))


def chain(depth: int) -> MedusaTree:
  """Every head's top-1 guess, one under the other: ((0,), (0, 0), ...)."""
  return tuple((0,) * d for d in range(1, depth + 1))


@dataclasses.dataclass(frozen=True)
class TreeArrays:
  """A tree in tree order as int32 rows [M] (module docstring): `parent` (node index,
  -1 under the root), `depth` (1 under the root), `head` (depth - 1) and `rank`."""

  parent: np.ndarray
  depth: np.ndarray
  head: np.ndarray
  rank: np.ndarray

  @classmethod
  def of(cls, tree: MedusaTree) -> "TreeArrays":
    index = {node: n for n, node in enumerate(tree)}
    parent = [index[node[:-1]] if len(node) > 1 else -1 for node in tree]
    depth = [len(node) for node in tree]
    arrays = (parent, depth, [d - 1 for d in depth], [node[-1] for node in tree])
    return cls(*(np.asarray(a, np.int32) for a in arrays))

  @property
  def max_depth(self) -> int:
    return int(self.depth.max())

  @property
  def num_ranks(self) -> int:
    """The top-k each head must give: its largest rank used + 1."""
    return int(self.rank.max()) + 1
