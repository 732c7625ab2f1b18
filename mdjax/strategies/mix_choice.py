r"""How many nodes each draft source of `mixed` contributes: per request (which sources
run at all, or plain decoding) and per step and row (how long each source's chain is).

A source s proposes a chain; its token d is right, given the tokens before it were,
with probability a[s, d], so the chain reaches depth k with probability
r[s, k] = a[s, 1] ... a[s, k]. The chains are merged into one trie
(`trees.merge_chains`) and the target accepts the longest right path, so with chain
lengths n = (n_1, ..., n_S), taking the sources as independent::

    P(A >= k)   = 1 - prod_s (1 - r[s, k] [k <= n_s])     A: tokens accepted
    E(n)        = 1 + sum_k P(A >= k)                      tokens per pass
    cost(n)     = t(1 + sum_s n_s) + fixed + sum_s c_s n_s
    rate(n)     = E(n) / cost(n)

t is the target's pass cost (`mdjax.strategies.pass_cost`; a trie of fewer nodes is
a pass that many columns wide), `fixed` what drafting costs every step whatever the
lengths (a draft model's or a sequential head's catch-up pass, parallel heads' one
pass), c_s what each further drafted token costs (one pass of a draft model or of a
sequential head; nothing for prompt lookup or parallel heads), all as passes of the
drafter's weights (`tree_choice.draft_fraction`), in units of t(1).

**Per step and row** (`choose_lengths`, in the compiled step), the estimate of
a[s, d] is the source's prior updated by what this row has seen so far in this
request: (w prior + accepted) / (w + tried), with w = `PRIOR_WEIGHT` pseudo-counts,
where `tried` counts the steps in which depth d of the source's chain was verified
with the depths before it right, `accepted` those in which it was right too. Every
length vector with sum_s n_s <= the tree's width is scored (`length_grid`; a prompt
lookup chain is never longer than the match found) and the best rate wins (ties: the
fewer nodes); lengths all 0 is plain decoding for that step and row.

**Per request** (`request_choice`): the same rate with the priors, at the request's
batch (`tree_choice.batch_tokens_per_pass`: the batch waits for its slowest row).
When no lengths promise `tree_choice.MIN_GAIN` more than plain decoding (1 / t(1), no
drafting at all), the request runs plain decoding. A source that costs passes and whose
best lengths on its own promise less than that is left out (its passes saved; `out.stats`
says so): the priors are rough (prompt lookup's above all), so a source that pays
alone stays, and each step gives it the nodes its own acceptance earns.

The priors (per depth, the chance a chain's token d is right when the ones before are):
heads, their `top_accuracy` top-1 per head (parallel) or per unrolled step
(sequential), else `tree_choice.DRAFT_ACCURACY`; a draft model, `DRAFT_ACCURACY`
(0.6 at every depth); prompt lookup, `LOOKUP_ACCURACY` (a stated default, not a
measurement: a match's first token is right half the time, each further one 0.8 when
the ones before were: copied text goes on being copied).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from mdjax.strategies import tree_choice
from mdjax.strategies.pass_cost import WIDTHS, PassCost

LOOKUP_ACCURACY = (0.5,) + (0.8,) * (tree_choice.MAX_DEPTH - 1)  # conditional, per depth
PRIOR_WEIGHT = 4.0  # pseudo-counts of a source's prior against this request's own counts
MAX_NODES = WIDTHS[-1] - 1  # the widest trie: c and its nodes within the measured profile


@dataclasses.dataclass(frozen=True)
class StepCost:
  """What a step costs, in units of t(1), as static numbers: `width[w]` the target's
  pass over w columns (w = 0 .. 1 + the trie's nodes; `width[0]` unused), `fixed` the
  drafting every step pays, `per_token[s]` each further token source s drafts."""

  width: tuple[float, ...]
  fixed: float
  per_token: tuple[float, ...]

  @classmethod
  def of(cls, cost: PassCost, nodes: int, fixed_s: float, per_token_s: Sequence[float]
         ) -> "StepCost":
    """From t(n) (`cost`) and drafting costs in seconds."""
    one = cost(1)
    return cls(width=tuple(cost(max(w, 1)) / one for w in range(nodes + 2)),
               fixed=fixed_s / one, per_token=tuple(c / one for c in per_token_s))


def conditional(reach: Sequence[float], depth: int) -> tuple[float, ...]:
  """Per depth 1 .. `depth`, the chance token d is right when the ones before are,
  from a profile's top-1 accuracy per depth (`reach`, each independent; past its end
  the last value)."""
  values = [reach[min(d, len(reach) - 1)] for d in range(depth)]
  return tuple(min(max(float(v), 1e-3), 0.999) for v in values)


def length_grid(caps: Sequence[int], nodes: int) -> np.ndarray:
  """Every length vector `[C, S]` with n_s <= caps[s] and sum n_s <= `nodes`, fewest
  nodes first (so a tie goes to the smaller trie)."""
  grid = [n for n in itertools.product(*(range(c + 1) for c in caps)) if sum(n) <= nodes]
  return np.asarray(sorted(grid, key=sum), np.int32).reshape(len(grid), len(caps))


def expected_tokens(accuracy: Float[Array, "... S D"], lengths: Int[Array, "... C S"]
                    ) -> Float[Array, "... C"]:
  """E(n) (module docstring) of each length vector, from per-depth conditional
  accuracies (the reach is their running product)."""
  reach = jnp.cumprod(accuracy, axis=-1)[..., None, :, :]  # [..., 1, S, D]
  depth = jnp.arange(1, accuracy.shape[-1] + 1)
  offered = depth <= lengths[..., None]  # [..., C, S, D]
  missed = jnp.prod(1 - jnp.where(offered, reach, 0.0), axis=-2)  # [..., C, D]
  return 1 + (1 - missed).sum(axis=-1)


def step_rate(accuracy: Float[Array, "... S D"], lengths: Int[Array, "... C S"],
              cost: StepCost) -> Float[Array, "... C"]:
  """rate(n) (module docstring) per length vector, in tokens per t(1)."""
  width = jnp.asarray(cost.width)[1 + lengths.sum(axis=-1)]
  drafting = cost.fixed + (lengths * jnp.asarray(cost.per_token)).sum(axis=-1)
  return expected_tokens(accuracy, lengths) / (width + drafting)


def estimate(prior: Float[Array, "S D"], tried: Int[Array, "R S D"],
             accepted: Int[Array, "R S D"]) -> Float[Array, "R S D"]:
  """Each row's accuracy per source and depth: the prior updated by its own counts."""
  return (PRIOR_WEIGHT * prior + accepted) / (PRIOR_WEIGHT + tried)


def choose_lengths(accuracy: Float[Array, "R S D"], available: Int[Array, "R S"],
                   grid: np.ndarray, cost: StepCost) -> Int[Array, "R S"]:
  """Each row's chain lengths of the best rate (at most what each source has)."""
  lengths = jnp.minimum(jnp.asarray(grid)[None], available[:, None, :])  # [R, C, S]
  best = jnp.argmax(step_rate(accuracy, lengths, cost), axis=1)  # [R]
  return jnp.take_along_axis(lengths, best[:, None, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class RequestChoice:
  """What `auto` chose for a request: the `lengths` of the best rate with the priors
  (all 0: plain decoding), its expected tokens per pass and speedup over plain decoding."""

  lengths: tuple[int, ...]
  tokens_per_pass: float
  speedup: float

  @property
  def plain(self) -> bool:
    return not any(self.lengths)


def request_choice(prior: np.ndarray, caps: Sequence[int], nodes: int, cost: StepCost,
                   batch: tree_choice.Batch, allow_plain: bool = True) -> RequestChoice:
  """The lengths of the best rate (module docstring) with the `prior` accuracies
  `[S, D]` at `batch`, against plain decoding (rate 1, no drafting) with its margin."""
  grid = length_grid(caps, nodes)
  reach = np.cumprod(np.asarray(prior, np.float64), axis=-1)  # [S, D]
  best, best_rate = RequestChoice(lengths=(0,) * len(caps), tokens_per_pass=1.0, speedup=1.0), (
      tree_choice.MIN_GAIN if allow_plain else 0.0)
  for lengths in grid[1:]:
    offered = np.arange(1, reach.shape[1] + 1) <= lengths[:, None]
    at_least = 1 - np.prod(1 - np.where(offered, reach, 0.0), axis=0)  # [D] P(A >= k)
    tokens = tree_choice.batch_tokens_per_pass(at_least, batch)
    rate = tokens / (cost.width[1 + int(lengths.sum())] + cost.fixed
                     + float(np.dot(lengths, cost.per_token)))
    if rate > best_rate and math.isfinite(rate):
      best_rate = rate
      best = RequestChoice(lengths=tuple(int(n) for n in lengths), tokens_per_pass=tokens,
                           speedup=rate)
  return best
