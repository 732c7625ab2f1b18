r"""`tree_budget="auto"`: the tree of the most expected tokens per second (Sequoia's
objective, Chen et al. 2024), or no tree at all.

A step verifies a tree of M nodes in one target pass over the last emitted token `c`
and the nodes, and emits E tokens in expectation: the target's own, plus every node
whose whole path is right, with the probability an *acceptance profile* gives it
(`mdjax.heads.tree`: rank j at depth d is right with probability
top_accuracy[d-1][j] - top_accuracy[d-1][j-1], depths independent; `expected_length`).
With N branches per row (Medusa with questions) every branch feeds its own tree, so
per branch::

    rate(tree)  = E(tree) / (t(N (1 + M)) + draft(tree))     tokens per second
    rate(plain) = 1 / t(N)                                   one token per pass

t is the target's pass cost on this device (`mdjax.strategies.pass_cost`) and
draft(tree) what drafting the tree costs, counted as passes of the drafter's weights
over its rows: fraction x t(rows), with fraction = the drafter's weights (plus the
target's unembedding when it reads it) over the target's (`draft_fraction`), since
at small batches a pass's time goes to reading weights::

    medusa            the D heads a tree of depth D reads fraction x t(N D)
                      (the others do not run), over h once
    eagle             catch-up over 1 + D, D - 1 levels   fraction x (t(1 + D) + (D - 1) t(K))
    speculative_tree  catch-up over 2, D - 1 levels       fraction x (t(2) + (D - 1) t(K))

The candidates, no wider than the profile measured (N (1 + M) <= 64):

    static trees   (medusa)   M = 1 .. 63: `build_tree(accuracy, M)`, the best M-node tree
    dynamic trees  (eagle,    D, K = 1 .. 8: what EAGLE-2's loop drafts when the profile
    speculative_tree)         is its score (K nodes at level 1, K children of each level's
                              K best), and M = 1 .. K + (D - 1) K²: the best M of them

A batch of B rows runs until its slowest row is done, so its E is not the mean row's
but `batch_tokens_per_pass`'s: L tokens per row, X = 1 + A tokens per pass and row (A
the accepted path's length, P(A >= k) = the summed values of the tree's depth-k nodes)::

    passes of a row     ~ L / EX  +/-  sqrt(L Var X / EX^3        the steps' luck
                                         + (L c (EX - 1) / EX^2)^2)   the prompt's
    passes of a batch   ~ the most of B rows'   = mean + z_B sd
    E(batch)            = L / passes of a batch                 (= EX at B = 1)

with c = `PROMPT_SPREAD` (how much a row's accepted tokens differ between prompts)
and z_B the expected largest of B standard normals. Plain decoding pays none of it.

The highest rate wins (ties: the smaller tree); plain decoding wins when no tree
promises `MIN_GAIN` (5%) more than it: the model counts the target's pass and the
drafting, not all a step costs beyond them (the verify's argmax over every node, the
commit; on an H200 the chosen trees' steps cost 5-17% more than counted). At batch 8
on a 2-core CPU a one-node Medusa step costs 1.35x a greedy step where t(2) and the
head make ~1.14x (1.41x before greedy verification stopped drawing a token over the
vocabulary, `mdjax.strategies.trees.greedy_path`; the rest is not yet found).

The profiles: Medusa heads carry `top_accuracy[k][j]` (head k's held-out top-(j+1)
accuracy) and EAGLE heads the same per unrolled step; heads without one use
`default_accuracy` (Medusa) or `DRAFT_ACCURACY`, and so does a draft model, which
carries none: rank j right with probability 0.6 x 0.4^j at every depth, i.e. a
drafter whose first guess is right 60% of the time, however deep (a default, not a
measurement; `default_accuracy`'s first head).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from typing import Callable, Sequence

import jax
import numpy as np

from mdjax.errors import MdjaxError
from mdjax.heads.tree import build_tree, default_accuracy, node_value, rank_accuracy
from mdjax.sampling import SAMPLING_OPTIONS
from mdjax.strategies.autoregressive import OnTarget
from mdjax.strategies.base import Prompt, Sampled
from mdjax.strategies.pass_cost import WIDTHS, PassCost

MAX_DEPTH, MAX_TOP_K = 8, 8  # the dynamic trees searched
DRAFT_ACCURACY = (default_accuracy(1)[0],) * MAX_DEPTH
AUTO = "auto"
# The coefficient of variation, over prompts, of a row's accepted tokens per pass (its
# mean E X - 1): measured over the 13 task kinds of
# experiments/bench/data/head_questions.jsonl at batch 1
# (docs/results/heads/bench_heads_r4.json): 0.24 for the shipped Medusa heads, 0.34 for the
# shipped EAGLE-3 head (prompt lookup: 0.89).
PROMPT_SPREAD = 0.3
MIN_GAIN = 1.05  # the expected speedup a tree must promise over plain decoding


@dataclasses.dataclass(frozen=True)
class Batch:
  """The rows (branches counted apart) a step advances together, and the tokens each
  generates: the batch runs until its slowest row is done."""

  rows: int = 1
  new_tokens: int = 1


@dataclasses.dataclass(frozen=True)
class Choice:
  """What `auto` chose: `budget` nodes verified per pass (0: plain decoding), the
  tree's `depth`, `top_k` children per expanded node (dynamic trees; 0 otherwise),
  the expected tokens per pass and speedup over plain decoding, and the t(n) used."""

  budget: int
  depth: int
  top_k: int
  tokens_per_pass: float
  speedup: float
  cost: PassCost

  @property
  def plain(self) -> bool:
    return self.budget == 0

  def stats(self, greedy: bool) -> dict:
    """What `out.stats` says of it (plain decoding is "greedy", or "sample" when the
    strategy samples)."""
    plain = "greedy" if greedy else "sample"
    return {"tree_choice": plain if self.plain else "tree", "tree_budget": self.budget,
            "tree_depth": self.depth, "tree_top_k": self.top_k,
            "expected_tokens_per_pass": self.tokens_per_pass,
            "expected_speedup": self.speedup, **self.cost.stats()}


def check_budget(value, minimum: int) -> None:
  """Raises `MdjaxError` naming `value` unless it is "auto" or an integer >= `minimum`."""
  if isinstance(value, str) and value == AUTO:
    return
  if not isinstance(value, int) or isinstance(value, bool):
    raise MdjaxError(f"tree_budget must be an integer or {AUTO!r}, got {value!r}")
  if value < minimum:
    raise MdjaxError(f"tree_budget must be an integer >= {minimum}, got {value!r}")


def draft_fraction(drafter, target, *, reads_unembedding: bool) -> float:
  """A drafter pass's cost relative to a target pass over as many tokens: its weights
  (`drafter`, a params pytree; plus the target's unembedding when `reads_unembedding`)
  over the target's (`target`)."""
  size = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
  unembedding = target["lm_head"] if "lm_head" in target else target["embed"]
  return (size(drafter) + (size(unembedding) if reads_unembedding else 0)) / size(target)


def reads_target_unembedding(heads) -> bool:
  """Heads (a params pytree) score tokens with the target's whole unembedding unless
  they carry their own (`lm_head`: Medusa's own, EAGLE-3's over its draft vocabulary)
  or the target's draft columns (`draft_unembedding`), counted among their weights."""
  return not {"lm_head", "draft_unembedding"} & set(heads)


def heads_fraction(heads, target) -> float:
  """`draft_fraction` of heads (a params pytree): the target's unembedding counted
  where they read it (`reads_target_unembedding`)."""
  return draft_fraction(heads, target, reads_unembedding=reads_target_unembedding(heads))


def first_heads_fractions(family, heads_params, target_params, count: int) -> tuple[float, ...]:
  """Per depth d = 1 .. `count`, the `heads_fraction` of parallel heads' first d heads
  (a tree d deep runs those only). The heads' shapes are numpy views of one byte:
  cutting heads off them runs nothing."""
  shapes = jax.tree.map(lambda x: np.broadcast_to(np.int8(0), x.shape), heads_params)
  return tuple(heads_fraction(family.first_heads(shapes, depth), target_params)
               for depth in range(1, count + 1))


def batch_tokens_per_pass(reach: Sequence[float], batch: Batch) -> float:
  """The expected tokens per pass of `batch` (module docstring) when each row accepts
  at least k drafted tokens with probability `reach[k - 1]`."""
  reach = list(reach)
  mean = 1.0 + sum(reach)
  if batch.rows == 1 or mean == 1.0:
    return mean
  square = sum((2 * k - 1) * p for k, p in enumerate(reach, start=1))  # E A^2
  passes = batch.new_tokens / mean
  luck = batch.new_tokens * (square - (mean - 1) ** 2) / mean**3
  prompts = (batch.new_tokens * PROMPT_SPREAD * (mean - 1) / mean**2) ** 2
  return batch.new_tokens / (passes + _largest_normal(batch.rows) * math.sqrt(luck + prompts))


def static_tree(accuracy, cost: PassCost, draft_s: Callable[[int], float], *,
                branches: int = 1, batch: Batch = Batch(), allow_plain: bool = True) -> Choice:
  """The best `build_tree(accuracy, M)` (module docstring) for `branches` trees per
  row, a tree of depth D drafted for `draft_s(D)` seconds (only its first D heads run),
  for a batch of `batch` (its rows each branch counted apart)."""
  per_rank = rank_accuracy(accuracy)
  available = sum(math.prod(len(row) for row in per_rank[:depth])
                  for depth in range(1, len(per_rank) + 1))  # nodes the table can rank
  plain = 1 / cost(branches)
  best, best_rate = _plain(cost), plain * MIN_GAIN if allow_plain else 0.0
  for budget in range(1, min(_max_nodes(branches), available) + 1):
    tree = best_static_tree(hashable(accuracy), budget)
    depth = max(map(len, tree))
    reach = [sum(node_value(node, per_rank) for node in tree if len(node) == d)
             for d in range(1, depth + 1)]
    length = batch_tokens_per_pass(reach, batch)
    rate = length / (cost(branches * (1 + budget)) + draft_s(depth))
    if rate > best_rate:
      best_rate = rate
      best = Choice(budget=budget, depth=depth, top_k=0, tokens_per_pass=length,
                    speedup=rate / plain, cost=cost)
  return best


def dynamic_tree(accuracy, cost: PassCost, draft_s: Callable[[int, int], float], *,
                 depths: Sequence[int], top_ks: Sequence[int], batch: Batch = Batch(),
                 allow_plain: bool = True) -> Choice:
  """The best EAGLE-2 tree (module docstring) of a depth D in `depths`, a top-k K in
  `top_ks` and any budget M, drafted for `draft_s(D, K)` seconds, for a batch of `batch`."""
  plain = 1 / cost(1)
  best, best_rate = _plain(cost), plain * MIN_GAIN if allow_plain else 0.0
  for depth in depths:
    for top_k in top_ks:
      nodes = drafted_values(hashable(accuracy), depth, top_k)
      draft, reach = draft_s(depth, top_k), [0.0] * depth
      for budget, (value, level) in enumerate(nodes[:_max_nodes(1)], start=1):
        reach[level - 1] += value
        length = batch_tokens_per_pass(reach, batch)
        rate = length / (cost(1 + budget) + draft)
        if rate > best_rate:
          best_rate = rate
          best = Choice(budget=budget, depth=depth, top_k=top_k, tokens_per_pass=length,
                        speedup=rate / plain, cost=cost)
  return best


@functools.lru_cache(maxsize=256)
def chosen_static_tree(accuracy: tuple, cost: PassCost, fractions: tuple[float, ...],
                       branches: int, batch: Batch, allow_plain: bool) -> Choice:
  """`static_tree` for a request shape (Medusa's `auto`), a tree of depth d drafting for
  `fractions[d - 1]` passes of its branches x d rows. Remembered, keyed on these inputs
  alone (no strategy is kept alive): the search costs a request tens of milliseconds on
  a CPU, and plain decoding, when it wins, must cost what greedy costs."""
  return static_tree(accuracy, cost, lambda depth: fractions[depth - 1] * cost(branches * depth),
                     branches=branches, batch=batch, allow_plain=allow_plain)


@functools.lru_cache(maxsize=256)
def chosen_dynamic_tree(accuracy: tuple, cost: PassCost, fraction: float,
                        catch_up_widths: tuple[int, ...], depths: tuple[int, ...],
                        top_ks: tuple[int, ...], batch: Batch, allow_plain: bool) -> Choice:
  """`dynamic_tree` for a request shape (`eagle`'s and `speculative_tree`'s `auto`): the
  drafter's pass costs `fraction` of the target's, its first pass of a tree d deep is
  `catch_up_widths[d - 1]` columns wide. Remembered as `chosen_static_tree` is."""
  return dynamic_tree(
      accuracy, cost,
      lambda depth, top_k: fraction * (cost(catch_up_widths[depth - 1]) + (depth - 1) * cost(top_k)),
      depths=depths, top_ks=top_ks, batch=batch, allow_plain=allow_plain)


def plain_decoding(strategy: Sampled, params, prompt: Prompt, capacity: int,
                   choice: Choice) -> OnTarget:
  """`strategy`'s target decoding one token per pass with its sampling options, for
  `choice` (no tree; its stats in `request_stats`). The target hands out no hidden
  states (`ModelFn.hidden_layers`): nothing drafts from them."""
  plain = OnTarget(model=dataclasses.replace(strategy.model, hidden_layers=()),
                   **{name: getattr(strategy, name) for name in SAMPLING_OPTIONS})
  return dataclasses.replace(plain.for_request(params["target"], prompt, capacity),
                             request_stats=choice.stats(strategy.greedy))


@functools.lru_cache(maxsize=4096)
def best_static_tree(accuracy: tuple, budget: int) -> tuple:
  """`build_tree(accuracy, budget)` (memoised: every request of the same heads searches
  the same trees)."""
  return build_tree(accuracy, budget)


@functools.lru_cache(maxsize=4096)
def drafted_values(accuracy: tuple, depth: int, top_k: int) -> tuple[tuple[float, int], ...]:
  """(value, depth) of every node EAGLE-2's loop drafts with `depth` levels and `top_k`
  (value: `node_value`), when the values are its scores, best first (memoised): level 1
  is ranks 0 .. K-1; each further level, the K children of the K best nodes of the level
  above (ties: the first)."""
  per_rank = rank_accuracy(accuracy)
  level = [(rank,) for rank in range(top_k)]
  drafted = list(level)
  for _ in range(depth - 1):
    front = sorted(level, key=lambda node: -node_value(node, per_rank))[:top_k]
    level = [node + (rank,) for node in front for rank in range(top_k)]
    drafted += level
  return tuple(sorted(((node_value(node, per_rank), len(node)) for node in drafted),
                      key=lambda pair: -pair[0]))


def hashable(accuracy) -> tuple[tuple[float, ...], ...]:
  return tuple(tuple(float(a) for a in row) for row in accuracy)


def _largest_normal(count: int) -> float:
  """The expected largest of `count` standard normal draws (Blom's approximation; 0 for 1)."""
  return statistics.NormalDist().inv_cdf((count - 0.375) / (count + 0.25))


def _max_nodes(branches: int) -> int:
  """The most nodes a branch's tree may have for the pass to stay within the profile."""
  return max(1, WIDTHS[-1] // branches - 1)


def _plain(cost: PassCost) -> Choice:
  return Choice(budget=0, depth=0, top_k=0, tokens_per_pass=1.0, speedup=1.0, cost=cost)
