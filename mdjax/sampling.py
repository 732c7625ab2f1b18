"""Logits processors and token choice, shared by every strategy.

Processors run in Hugging Face's order: temperature, top-k, top-p, min-p. A
removed token gets logit -inf, so `jax.nn.softmax(process_logits(...))` is the
distribution a strategy samples from (and the `p`/`q` of speculative acceptance).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from mdjax.errors import MdjaxError


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """temperature 0 means greedy (argmax); top_k 0, top_p 1 and min_p 0 disable a filter."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    for name in ("temperature", "top_p", "min_p"):
      value = getattr(self, name)
      if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise MdjaxError(f"{name} must be a finite number, got {value!r}")
    if not self.temperature >= 0:
      raise MdjaxError(f"temperature must be >= 0, got {self.temperature}")
    if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
      raise MdjaxError(f"top_k must be an integer >= 0, got {self.top_k!r}")
    if not 0 < self.top_p <= 1:
      raise MdjaxError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0 <= self.min_p <= 1:
      raise MdjaxError(f"min_p must be in [0, 1], got {self.min_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def process_logits(logits: Float[Array, "... V"], params: SamplingParams) -> Float[Array, "... V"]:
  """Temperature-scaled float32 logits with filtered-out tokens at -inf."""
  logits = logits.astype(jnp.float32)
  if params.greedy:
    return logits
  logits = logits / params.temperature
  if params.top_k and params.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]  # [..., 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if params.top_p < 1:
    logits = _top_p(logits, params.top_p)
  if params.min_p > 0:
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = params.min_p * probs.max(axis=-1, keepdims=True)
    logits = jnp.where(probs < threshold, -jnp.inf, logits)
  return logits


def _top_p(logits: Float[Array, "... V"], top_p: float) -> Float[Array, "... V"]:
  """Keeps the smallest most-likely set whose probability reaches top_p (at least one)."""
  order = jnp.argsort(-logits, axis=-1)  # [..., V] most likely first
  sorted_probs = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), order, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # exclusive cumsum
  keep_sorted = mass_before < top_p  # the most likely token always: 0 < top_p
  keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1,
                            inplace=False)
  return jnp.where(keep, logits, -jnp.inf)


def choose(keys: jax.Array, logits: Float[Array, "B V"], params: SamplingParams) -> Int[Array, "B"]:
  """Argmax when greedy, else one sample per row from its own key (`keys`: [B])."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  processed = process_logits(logits, params)
  return jax.vmap(jax.random.categorical)(keys, processed).astype(jnp.int32)


def row_keys(key: jax.Array, rows: Int[Array, "B"], steps: Int[Array, "B"]) -> jax.Array:
  """Independent keys per (row, step): a row's randomness does not depend on the batch."""
  return jax.vmap(lambda r, s: jax.random.fold_in(jax.random.fold_in(key, r), s))(rows, steps)


def greedy_accept(proposal: Int[Array, "B D"], count: Int[Array, "B"],
                  choice: Int[Array, "B D+1"]) -> Int[Array, "B"]:
  """How many leading proposed tokens equal the target's argmax `choice` (the
  target's choice after the last emitted token, then after each proposed token).

  The tokens to emit are then `choice[:, :accepted + 1]`: the accepted proposal
  (equal to the target's choices) and the target's own next token, which is
  exactly what greedy decoding would have produced.
  """
  agree = (proposal == choice[:, :-1]) & (jnp.arange(proposal.shape[1]) < count[:, None])
  return jnp.cumprod(agree, axis=1).sum(axis=1, dtype=jnp.int32)
