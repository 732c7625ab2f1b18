r"""A draft vocabulary: heads that score only the V_d most frequent target tokens.

A small model's unembedding dominates its heads (SmolLM2: 49,152 tokens x 576, 21%
of a whole forward per token); heads that guess only among the tokens the model
actually writes pay V_d / V of that (FR-Spec, EAGLE-3). The heads carry the map::

    target ids   0  1  2  3  4  5  6  7  8  9 ...  V - 1
    in draft        x     x  x        x          (the V_d most frequent, ascending)
    draft_ids    [1, 3, 4, 7, ...]    int32 [V_d]   column j of the heads' logits is
                                                    target token draft_ids[j]

A target token outside the draft vocabulary is never proposed; verification is the
target's and unchanged, so decoding stays exact (greedy) and lossless (sampling: the
heads' candidates are a fixed set, whatever their law). EAGLE-3's files store the map
as offsets, `d2t[j] = draft_ids[j] - j`, and a mask over the target vocabulary,
`t2d[i] = i in draft_ids` (`to_offsets`, `from_offsets`, `target_mask`).
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from mdjax.errors import MdjaxError, check_count
from mdjax.models.quantized import take_columns, take_rows
from mdjax.models.transformer import Params


def choose(counts: np.ndarray, size: int) -> np.ndarray:
  """The `size` most frequent token ids of `counts` (int [V]: occurrences per target
  id), ascending (ties: the smaller id); `size` 0 or >= V: every id."""
  counts = np.asarray(counts)
  check_count("draft_vocab_size", size, 0)
  if size == 0 or size >= counts.size:
    return np.arange(counts.size, dtype=np.int32)
  order = np.lexsort((np.arange(counts.size), -counts))  # most frequent first, then by id
  return np.sort(order[:size]).astype(np.int32)


def coverage(draft_ids: np.ndarray, tokens: np.ndarray) -> float:
  """The fraction of `tokens` (target ids) inside the draft vocabulary."""
  tokens = np.asarray(tokens).ravel()
  return float(np.isin(tokens, draft_ids).mean()) if tokens.size else 0.0


def check(draft_ids: np.ndarray, vocab_size: int, what: str = "the heads") -> None:
  """Raises `MdjaxError` naming the value when `draft_ids` is not a strictly
  ascending list of target ids below `vocab_size`."""
  ids = np.asarray(draft_ids)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise MdjaxError(f"{what}: the draft vocabulary must be a non-empty list of token ids, got "
                     f"shape {ids.shape} of {ids.dtype}")
  if ids.min() < 0 or ids.max() >= vocab_size:
    bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
    raise MdjaxError(f"{what}: the draft vocabulary maps to token id {bad}, outside the model's "
                     f"vocabulary of {vocab_size} tokens")
  if np.any(np.diff(ids) <= 0):
    raise MdjaxError(f"{what}: the draft vocabulary's ids must be strictly ascending (no repeats)")


def to_offsets(draft_ids: np.ndarray) -> np.ndarray:
  """EAGLE-3's `d2t` (int64 [V_d]): target id minus draft id."""
  return np.asarray(draft_ids, np.int64) - np.arange(len(draft_ids), dtype=np.int64)


def from_offsets(d2t: np.ndarray) -> np.ndarray:
  """The inverse of `to_offsets`."""
  d2t = np.asarray(d2t)
  return (d2t + np.arange(len(d2t), dtype=d2t.dtype)).astype(np.int32)


def target_mask(draft_ids: np.ndarray, vocab_size: int) -> np.ndarray:
  """EAGLE-3's `t2d` (bool [V]): which target ids are in the draft vocabulary."""
  mask = np.zeros(vocab_size, bool)
  mask[np.asarray(draft_ids)] = True
  return mask


def to_target(draft_tokens: Int[Array, "..."], draft_ids: Int[Array, "Vd"] | None
              ) -> Int[Array, "..."]:
  """Draft-vocabulary indices -> target token ids (None: the full vocabulary)."""
  return draft_tokens if draft_ids is None else jnp.take(draft_ids, draft_tokens)


def column_of(draft_ids: Int[Array, "Vd"], vocab_size: int) -> Int[Array, "V"]:
  """Each target id's column in the draft vocabulary, -1 where it has none."""
  return jnp.full((vocab_size,), -1, jnp.int32).at[draft_ids].set(
      jnp.arange(draft_ids.shape[0], dtype=jnp.int32))


def unembedding_columns(target_params: Params, draft_ids: Int[Array, "Vd"]) -> Float[Array, "D Vd"]:
  """The target's unembedding restricted to the draft vocabulary, `[D, V_d]`: gathered
  once per request, not per step (`lm_head`, or the tied embedding's rows), as floats of
  the weights' dtype (a quantized target's columns dequantized, these alone)."""
  if "lm_head" in target_params:
    return take_columns(target_params["lm_head"], draft_ids)
  return take_rows(target_params["embed"], draft_ids).T
