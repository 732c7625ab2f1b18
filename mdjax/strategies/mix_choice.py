r"""How many nodes each draft source of `mixed` gives the trie: per request (which
sources run at all, or plain decoding) and per step and row.

A source proposes its nodes in its own order, parents first, best first: a chain
(a draft model's) token by token; prompt lookup its matches one after the other; heads
their tree (`mdjax.heads.tree` / EAGLE-2's), the best node first. It gives the trie its
first n. Its *reach table* V[n, k] is the chance that its first n nodes hold the
right token at depth k with every one above it (the target would accept k of them).
The trees are merged into one trie (`trees.merge_trees`: a path two sources propose is
one path) and the target accepts the longest right path, so with node counts
n = (n_1, ..., n_S), taking the sources as independent::

    P(A >= k)   = 1 - prod_s (1 - V_s[n_s, k])             A: tokens accepted
    E(n)        = 1 + sum_k P(A >= k)                      tokens per pass
    cost(n)     = t(1 + sum_s n_s) + fixed + sum_s c_s n_s
    rate(n)     = E(n) / cost(n)

t is the target's pass cost (`mdjax.strategies.pass_cost`) at the columns the verify
runs: the narrowest of `trees.tree_widths` that holds c and the nodes on the CPU
(`trees.verify_width`), the trie's whole width elsewhere; `fixed` what drafting costs
every step whatever the counts (a draft model's or a sequential head's passes,
parallel heads' one pass),
c_s what each further node costs (one pass of a draft model; nothing for prompt lookup
or heads, whose whole tree is drafted every step), all as passes of the drafter's
weights (`tree_choice.draft_fraction`), in units of t(1).

The tables (`chain_table`, `matches_table`, `tree_table`): a chain whose token d is
right with probability a_d when the ones before are has V[n, k] = a_1 ... a_k for
k <= n; prompt lookup's match m (m = 0, 1, ...) is such a chain right
`LOOKUP_FURTHER`^m as often as the first (measured, below), the matches
independent; a tree's V[n, k] is the summed value (`mdjax.heads.tree.node_value`,
or EAGLE-2's scores as `tree_choice.drafted_values` gives them) of its depth-k nodes
among its first n.

**Per step and row** (`choose_counts`, in the compiled step), each table is scaled by
what the row has seen in this request: per source and depth d, `expected` sums the
table's chance that depth d is right when d - 1 was (V[n, d] / V[n, d - 1] at the
count n used), over the steps in which the source had a node at depth d in the trie
and the accepted path ran through its nodes down to d - 1, and `hits` counts those in
which it was right at d too. The row's factor at d is (w + hits) / (w + expected),
w = `PRIOR_WEIGHT` pseudo-counts, and its reach at k is V[n, k] times the factors at
depths 1 .. k (at most 0.999). Every count vector of `count_grid` (per source the
counts of `COUNTS` its tree holds, at most the trie's width in all) is scored and the
best rate wins (ties: the fewer nodes); all 0 is plain decoding for that step and row.

**Per request** (`request_choice`): the same rate with the tables as they are, at the
request's batch (`tree_choice.batch_tokens_per_pass`: the batch waits for its slowest
row). When no counts promise `tree_choice.MIN_GAIN` more than plain decoding (1 / t(1),
no drafting at all), the request runs plain decoding.

The priors: heads, their `top_accuracy` (parallel heads: per head and rank; a sequential
head: per unrolled step and rank), else `tree_choice`'s defaults; a draft model,
`tree_choice.DRAFT_ACCURACY` (0.6 at every depth); prompt lookup, `LOOKUP_ACCURACY`: a
match's first token right half the time, each further one 0.8 when the ones before
were (copied text goes on being copied), a later match's first token 0.3 as often as the
first's where no earlier one was right. `experiments.bench.lookup_prior` measured these
on SmolLM2-135M-Instruct's greedy answers to the 26 held-out Spec-Bench questions: 0.52,
0.79-0.86 and 0.29 overall, but 0.20 (coding) to 0.87 (translation) per kind, so the
per-step factors above carry the request. The prompt cannot tell which kind it is: its own
positions, looked up the same way, are right 0.09-0.33 of the time, unrelated to its
answer's rate (summarization's prompt 0.09, its answer 0.76).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from mdjax.strategies import tree_choice, trees
from mdjax.strategies.pass_cost import WIDTHS, PassCost

LOOKUP_ACCURACY = (0.5,) + (0.8,) * (tree_choice.MAX_DEPTH - 1)  # conditional, per depth
LOOKUP_FURTHER = 0.3  # how often a further lookup match is right, against the first
PRIOR_WEIGHT = 4.0  # pseudo-counts of a source's prior against this request's own counts
MAX_NODES = WIDTHS[-1] - 1  # the widest trie: c and its nodes within the measured profile
COUNTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, MAX_NODES)
MAX_REACH = 0.999


@dataclasses.dataclass(frozen=True)
class StepCost:
  """What a step costs, in units of t(1), as static numbers: `width[w]` the target's
  pass when w columns are fed (w = 0 .. 1 + the trie's nodes; `width[0]` unused), `fixed`
  the drafting every step pays, `per_token[s]` each further node source s drafts."""

  width: tuple[float, ...]
  fixed: float
  per_token: tuple[float, ...]

  @classmethod
  def of(cls, cost: PassCost, nodes: int, fixed_s: float, per_token_s: Sequence[float]
         ) -> "StepCost":
    """From t(n) (`cost`) and drafting costs in seconds. A trie of `nodes` is verified
    by the narrow pass (`trees.verify`): w fed columns run `trees.verify_width` columns."""
    one = cost(1)
    return cls(width=tuple(cost(trees.verify_width(nodes + 1, max(w, 1))) / one
                           for w in range(nodes + 2)),
               fixed=fixed_s / one, per_token=tuple(c / one for c in per_token_s))


def conditional(reach: Sequence[float], depth: int) -> tuple[float, ...]:
  """Per depth 1 .. `depth`, the chance token d is right when the ones before are,
  from a profile's top-1 accuracy per depth (`reach`, each independent; past its end
  the last value)."""
  values = [reach[min(d, len(reach) - 1)] for d in range(depth)]
  return tuple(min(max(float(v), 1e-3), 0.999) for v in values)


def chain_table(accuracy: Sequence[float], size: int, depth: int) -> np.ndarray:
  """`[size + 1, depth]` V[n, k] of a chain of `size` tokens whose token d is right
  with probability `accuracy[d - 1]` when the ones before are."""
  reach = np.cumprod(np.asarray(conditional(accuracy, depth), np.float64))  # [D]
  return np.where(np.arange(1, depth + 1) <= np.arange(size + 1)[:, None], reach, 0.0)


def matches_table(matches: int, length: int, depth: int) -> np.ndarray:
  """`[matches x length + 1, depth]` V[n, k] of prompt lookup's `matches` chains of
  `length` tokens, one after the other (module docstring)."""
  chain = np.cumprod(np.asarray(conditional(LOOKUP_ACCURACY, depth), np.float64))  # [D]
  n = np.arange(matches * length + 1)[:, None, None]  # [N, 1, 1]
  m, k = np.arange(matches)[:, None], np.arange(1, depth + 1)  # [M, 1], [D]
  offered = (k <= length) & (m * length + k <= n)  # [N, M, D]
  right = LOOKUP_FURTHER ** m * chain  # [M, D]
  return 1 - np.prod(1 - np.where(offered, right, 0.0), axis=1)


def tree_table(values: Sequence[tuple[float, int]], depth: int) -> np.ndarray:
  """`[len(values) + 1, depth]` V[n, k] of a tree whose nodes, in the order it gives
  them, are `(value, depth)`: the summed values of the depth-k nodes among the first n."""
  table = np.zeros((len(values) + 1, depth))
  for n, (value, level) in enumerate(values, start=1):
    table[n] = table[n - 1]
    table[n, level - 1] += value
  return np.minimum(table, MAX_REACH)


def step_conditional(table: np.ndarray) -> np.ndarray:
  """`[N + 1, D]` V[n, d] / V[n, d - 1] (V[n, 0] = 1): the chance depth d is right
  when d - 1 was, with the first n nodes."""
  above = np.pad(table, ((0, 0), (1, 0)), constant_values=1.0)[:, :-1]
  return np.divide(table, above, out=np.zeros_like(table), where=above > 0)


def stacked(tables: Sequence[np.ndarray]) -> np.ndarray:
  """`[S, N + 1, D]` the tables, each padded with its last row to the largest."""
  rows = max(t.shape[0] for t in tables)
  return np.stack([np.pad(t, ((0, rows - t.shape[0]), (0, 0)), mode="edge") for t in tables]
                  ).astype(np.float32)


def count_grid(sizes: Sequence[int], nodes: int) -> np.ndarray:
  """Every count vector `[C, S]` with n_s among `COUNTS` (or its whole tree) up to
  sizes[s], and sum n_s <= `nodes`, fewest nodes first (so a tie goes to the smaller
  trie)."""
  options = [sorted({c for c in COUNTS if c <= size} | {size}) for size in sizes]
  grid = [n for n in itertools.product(*options) if sum(n) <= nodes]
  return np.asarray(sorted(grid, key=sum), np.int32).reshape(len(grid), len(sizes))


def factor(expected: Float[Array, "R S D"], hits: Int[Array, "R S D"]) -> Float[Array, "R S D"]:
  """Each row's correction of the tables per source and depth (module docstring)."""
  return (PRIOR_WEIGHT + hits) / (PRIOR_WEIGHT + expected)


def expected_tokens(reach: Float[Array, "... S D"]) -> Float[Array, "..."]:
  """E(n) (module docstring) from each source's reach per depth."""
  return 1 + (1 - jnp.prod(1 - reach, axis=-2)).sum(axis=-1)


def step_rate(reach: Float[Array, "... C S D"], counts: Int[Array, "... C S"],
              cost: StepCost) -> Float[Array, "... C"]:
  """rate(n) (module docstring) per count vector, in tokens per t(1)."""
  width = jnp.asarray(cost.width)[1 + counts.sum(axis=-1)]
  drafting = cost.fixed + (counts * jnp.asarray(cost.per_token)).sum(axis=-1)
  return expected_tokens(reach) / (width + drafting)


def choose_counts(tables: np.ndarray, correction: Float[Array, "R S D"],
                  available: Int[Array, "R S"], grid: np.ndarray, cost: StepCost
                  ) -> Int[Array, "R S"]:
  """Each row's node counts of the best rate (at most what each source has), from the
  `stacked` tables `[S, N + 1, D]` and the rows' `factor`s."""
  counts = jnp.minimum(jnp.asarray(grid)[None], available[:, None, :])  # [R, C, S]
  sources = jnp.arange(tables.shape[0])
  reach = jnp.asarray(tables)[sources, counts]  # [R, C, S, D]
  reach = jnp.minimum(reach * jnp.cumprod(correction, axis=-1)[:, None], MAX_REACH)
  best = jnp.argmax(step_rate(reach, counts, cost), axis=1)  # [R]
  return jnp.take_along_axis(counts, best[:, None, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class RequestChoice:
  """What `auto` chose for a request: the `counts` of the best rate with the tables
  (all 0: plain decoding), its expected tokens per pass and speedup over plain decoding."""

  counts: tuple[int, ...]
  tokens_per_pass: float
  speedup: float

  @property
  def plain(self) -> bool:
    return not any(self.counts)


def request_choice(tables: Sequence[np.ndarray], grid: np.ndarray, cost: StepCost,
                   batch: tree_choice.Batch, allow_plain: bool = True) -> RequestChoice:
  """The counts of the best rate (module docstring) with the `tables` at `batch`,
  against plain decoding (rate 1, no drafting) with its margin."""
  best, best_rate = RequestChoice(counts=(0,) * len(tables), tokens_per_pass=1.0, speedup=1.0), (
      tree_choice.MIN_GAIN if allow_plain else 0.0)
  for counts in grid[1:]:
    reach = np.stack([table[n] for table, n in zip(tables, counts)])  # [S, D]
    at_least = 1 - np.prod(1 - reach, axis=0)  # [D] P(A >= k)
    tokens = tree_choice.batch_tokens_per_pass(at_least, batch)
    rate = tokens / (cost.width[1 + int(counts.sum())] + cost.fixed
                     + float(np.dot(counts, cost.per_token)))
    if rate > best_rate and math.isfinite(rate):
      best_rate = rate
      best = RequestChoice(counts=tuple(int(n) for n in counts), tokens_per_pass=tokens,
                           speedup=rate)
  return best
