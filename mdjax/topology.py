"""Segment topology: which cached tokens a query token may see.

Tokens belong to *segments*. Each segment `s` of a row has a parent segment
`parent[s]` (-1 for a root) and a fork position `fork[s]`: the position of its first
token. A query in segment `s` at position `p` sees a cached token `k` iff

    seg[k] == s                 and pos[k] <= p                  (causal in its own segment)
    seg[k] == a, a ancestor of s, and pos[k] <  fork(child of a on the path to s)

Both rules are one comparison against a table `limit[s, a]` (the exclusive upper
bound on positions of segment `a` that segment `s` sees; INF for `a == s`, 0 for a
segment that is not an ancestor), plus `pos[k] <= p`. Positions along any
root-to-leaf path are consecutive from 0, which is why a branch gets exactly the
logits it would get decoded alone.

Plain causal decoding, one segment (`parent = [-1]`)::

    slot  0 1 2 3 4        query at pos 4 sees slots 0..4
    seg   0 0 0 0 0
    pos   0 1 2 3 4

Two questions over one context (seg 0 = context, 1 and 2 = questions forked at 3)::

    slot  0 1 2 | 3 4 5 6 | 7 8            parent = [-1, 0, 0]
    seg   0 0 0 | 1 1 2 2 | 1 2            fork   = [ 0, 3, 3]
    pos   0 1 2 | 3 4 3 4 | 5 5
              q(seg 1, pos 5) sees ■ ■ ■ ■ ■ □ □ ■ □     (slots 0-4, 7)
              q(seg 2, pos 5) sees ■ ■ ■ □ □ ■ ■ □ ■     (slots 0-2, 5, 6, 8)

Both questions sit at positions 3, 4, ... : each sees the context exactly as if it
were alone, and never the other question.

A beam fork (beam 2 forked from beam 1 at pos 5, after beam 1 wrote pos 5 and 6)::

    slot  0 1 2 3 4 | 5 6 | 7              parent = [-1, 0, 1]
    seg   0 0 0 0 0 | 1 1 | 2              fork   = [ 0, 5, 6]
    pos   0 1 2 3 4 | 5 6 | 6
              q(seg 2, pos 7) sees ■ ■ ■ ■ ■ ■ □ ■       (context, beam 1's pos 5, itself)

A draft tree over a committed prefix (each node its own one-token segment;
node a at pos 3 with children b, c at pos 4, and d under b at pos 5)::

    slot  0 1 2 | 3 4 5 6                  segs: 0 = prefix, 1 = a, 2 = b, 3 = c, 4 = d
    seg   0 0 0 | 1 2 3 4                  parent = [-1, 0, 1, 1, 2]
    pos   0 1 2 | 3 4 4 5                  fork   = [ 0, 3, 4, 4, 5]
              q(d)  sees ■ ■ ■ ■ ■ □ ■     (prefix, a, b, itself; not its uncle c)

Segments of a row that are unused stay roots with no tokens; a killed segment's
tokens are marked dead in the cache (`seg = -1`), which no query sees.

A join (`joins[s, a]` set) also sees every token of segment `a` that is not after
it: a segment reading several sibling branches at once, which a tree cannot say.
E.g. two reasoning branches over a prompt, and a join placed after both::

    slot  0 1 | 2 3 | 4 5 6 | 7            parent = [-1, 0, 0, 0], fork = [0, 2, 2, 2]
    seg   0 0 | 1 1 | 2 2 2 | 3            joins[3, 1] = joins[3, 2] = True
    pos   0 1 | 2 3 | 2 3 4 | 8            (join at pos 8: a position gap after pos 4)
              q(seg 3, pos 8) sees ■ ■ ■ ■ ■ ■ ■ ■
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from mdjax import platform

UNBOUNDED = jnp.iinfo(jnp.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Topology:
  """The segment tree of every row: `parent`, `fork`: int32[batch, segments]; and,
  optionally, `joins` bool[batch, segments, segments]: segment s also sees all of a."""

  parent: Int[Array, "B G"]
  fork: Int[Array, "B G"]
  joins: Bool[Array, "B G G"] | None = None

  @classmethod
  def causal(cls, batch: int, num_segments: int = 1) -> "Topology":
    """Every segment a root forked at 0: segment 0 is plain causal decoding."""
    zeros = jnp.zeros((batch, num_segments), jnp.int32)
    return cls(parent=zeros - 1, fork=zeros)

  @classmethod
  def fan(cls, fork: Int[Array, "B"], branches: int) -> "Topology":
    """Segment 0 a root; segments 1..branches all forked from it at `fork[b]` (beams
    after the prompt, `entropy_branching`'s branches after the committed text)."""
    segment = jnp.arange(branches + 1)[None, :]  # [1, n+1]
    parent = jnp.broadcast_to(jnp.where(segment == 0, -1, 0), (fork.shape[0], branches + 1))
    fork = jnp.where(segment == 0, 0, fork[:, None])  # [B, n+1]
    return cls(parent=parent.astype(jnp.int32), fork=fork.astype(jnp.int32))

  def add_segment(self, segment: Int[Array, "B"], parent: Int[Array, "B"],
                  fork: Int[Array, "B"]) -> "Topology":
    """Sets `segment`'s parent and fork position in every row (pure)."""
    rows = jnp.arange(self.parent.shape[0])
    return dataclasses.replace(self, parent=self.parent.at[rows, segment].set(parent),
                               fork=self.fork.at[rows, segment].set(fork))


def visibility_limits(topology: Topology) -> Int[Array, "B G G"]:
  """`limit[b, s, a]`: segment `s` sees positions `< limit` of segment `a`.

  UNBOUNDED on the diagonal (the causal rule `pos <= p` bounds it), the fork
  position of the path's child for ancestors, 0 for every other segment.
  Walks up the tree `G` times, so any depth up to the table size is handled; off the
  CPU the walk is unrolled (a GPU runs each step of a loop as kernels of its own: 21 of
  the 205 kernels of a 1B one-token pass at G = 4, 4 once unrolled and fused).
  """
  parent, fork = topology.parent, topology.fork  # [B, G]
  batch, num_segments = parent.shape
  rows = jnp.arange(batch)[:, None]  # [B, 1]

  def climb(_, carry):
    limit, node, bound = carry  # [B, G, G], [B, G] (ancestor reached from s), [B, G]
    on_path = (node >= 0)[..., None] & (
        jax.nn.one_hot(node, num_segments, dtype=jnp.bool_))  # [B, G, G]
    limit = jnp.where(on_path, bound[..., None], limit)
    safe = jnp.maximum(node, 0)
    bound = jnp.minimum(bound, fork[rows, safe])
    node = jnp.where(node >= 0, parent[rows, safe], -1)
    return limit, node, bound

  limit = jnp.zeros((batch, num_segments, num_segments), jnp.int32)
  node = jnp.broadcast_to(jnp.arange(num_segments, dtype=jnp.int32), (batch, num_segments))
  bound = jnp.full((batch, num_segments), UNBOUNDED, jnp.int32)
  limit, _, _ = jax.lax.fori_loop(0, num_segments, climb, (limit, node, bound),
                                  unroll=not platform.is_cpu())
  return limit if topology.joins is None else jnp.where(topology.joins, UNBOUNDED, limit)


def visible(limit: Int[Array, "B G G"], q_seg: Int[Array, "B T"], q_pos: Int[Array, "B T"],
            k_seg: Int[Array, "B S"], k_pos: Int[Array, "B S"],
            sliding_window: int | None = None) -> Bool[Array, "B T S"]:
  """The visibility rule of the module docstring, for queries `T` against keys `S`
  (the same keys for every query, or each query its own: `k_seg`, `k_pos` [B, T, S]).

  A query or key with segment -1 (padding, dead slot) sees / is seen by nothing.
  """
  if k_seg.ndim == 2:
    k_seg, k_pos = k_seg[:, None, :], k_pos[:, None, :]  # [B, 1, S]
  num_segments = limit.shape[-1]
  q_limits = jnp.take_along_axis(limit, jnp.clip(q_seg, 0, num_segments - 1)[..., None],
                                 axis=1)  # [B, T, G]
  shape = (q_seg.shape[0], q_seg.shape[1], k_seg.shape[2])  # [B, T, S]
  key_limit = jnp.take_along_axis(
      q_limits, jnp.broadcast_to(jnp.clip(k_seg, 0, num_segments - 1), shape), axis=2)
  qp = q_pos[:, :, None]  # [B, T, 1]
  seen = (q_seg >= 0)[:, :, None] & (k_seg >= 0) & (k_pos <= qp) & (k_pos < key_limit)
  if sliding_window is not None:
    seen &= qp - k_pos < sliding_window
  return seen
