"""Passes only as wide as their fed columns need: a strategy that feeds a varying
number of columns (live branches, a chain's drafted prefix, a tree's real nodes) runs
the narrowest of a few compiled widths that holds them (on the CPU, where a pass costs
its columns' compute; elsewhere the widest, which asks the host nothing)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from mdjax import platform
from mdjax.cache import KVCache
from mdjax.strategies.base import ModelFn
from mdjax.topology import Topology


def run_narrowest(widths: tuple[int, ...], need, pass_at, carry, *operands):
  """`(pass_at(w)(carry, *operands), w)` for the narrowest `w` in `widths` (widest
  first) that holds `need` (a traced count) columns. On the CPU every width is
  compiled and only the one taken runs, in place (`switch_in_place`): a pass costs
  its columns' compute there. Elsewhere the widest runs: choosing on the device is a
  while loop or a conditional, whose predicate the host reads (a GPU waits for it),
  and a memory-bound pass of a few more columns costs little more."""
  if not platform.is_cpu():
    return pass_at(widths[0])(carry, *operands), jnp.asarray(widths[0], jnp.int32)
  level = sum((need <= w).astype(jnp.int32) for w in widths[1:])
  carry = switch_in_place(level, [pass_at(w) for w in widths], carry, *operands)
  return carry, jnp.asarray(widths, jnp.int32)[level]


def narrowest_width(widths: tuple[int, ...], need: int) -> int:
  """(host) The columns `run_narrowest` runs with `widths` when `need` columns are fed:
  the narrowest that holds them on the CPU, the widest elsewhere."""
  if not platform.is_cpu():
    return widths[0]
  return min(w for w in widths if w >= need)


def switch_in_place(index, branches, carry, *operands):
  """`branches[index](carry, *operands)` for a traced `index`, each branch returning
  a tree shaped like `carry` (e.g. `(logits, cache)`): what `lax.switch` gives, run
  as one while loop per branch that iterates once when taken, never otherwise.

  Inside a `lax.switch` or `lax.cond` branch, XLA:CPU copies the KV cache between
  layer writes (the attention loops take the whole cache as an operand): at
  multi_question N = 16, context 1024, 4 copies of 55 MB per pass, a third of the
  step. A while loop's body updates it in place.
  """
  for i, branch in enumerate(branches):
    def once(taken_carry, branch=branch):
      return False, branch(taken_carry[1], *operands)
    _, carry = jax.lax.while_loop(lambda taken_carry: taken_carry[0], once, (index == i, carry))
  return carry


def chain_widths(width: int) -> tuple[int, ...]:
  """The columns a verify pass may run on, widest first: the whole chain, half of it
  (chains of 6 or more), or only the last emitted token (nothing drafted). Each width
  is one more compiled pass."""
  half = (-(-width // 2),) if width >= 6 else ()
  return tuple(sorted({width, *half, 1}, reverse=True))


def decode_chains(model: ModelFn, params, cache: KVCache, tokens: Int[Array, "B N C"],
                  positions: Int[Array, "B N C"], segments: Int[Array, "B N C"],
                  topology: Topology) -> tuple[Float[Array, "B N C V"], KVCache, Int[Array, ""]]:
  """`model` over N chains of C columns per row, each chain's scored tokens a
  prefix (segment -1 after it), run only as wide as the longest prefix needs::

      chains   c d0 d1 d2 d3 d4 | c d0 .  .  .  .     longest prefix 3 -> W = 3
      fed      c d0 d1          | c d0 .              (W from `chain_widths(C)`)

  Padding takes no cache slot, so the cache is the same at any W; the logits of the
  columns not fed are zeros (past every prefix: never read). Saves the pass its
  unused columns when chains come out short (no n-gram match, a low-confidence stop,
  a small heuristic budget). Returns the logits, the cache and W.
  """
  batch, branches, width = tokens.shape
  def feed(fed: int, carry):
    def cut(x):
      return x[..., :fed].reshape(batch, branches * fed)
    logits, _, cache = model(params, carry[1], cut(tokens), cut(positions), cut(segments),
                             topology)
    logits = logits.reshape(batch, branches, fed, -1)
    return jnp.pad(logits, ((0, 0), (0, 0), (0, width - fed), (0, 0))), cache

  unfed = jnp.zeros((batch, branches, width, model.vocab_size), jnp.float32)
  (logits, cache), fed_width = run_narrowest(
      chain_widths(width), (segments >= 0).sum(axis=-1).max(),
      lambda w: functools.partial(feed, w), (unfed, cache))
  return logits, cache, fed_width
