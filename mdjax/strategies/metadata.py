"""Per-token metadata of the propose-and-verify strategies (`return_metadata=True`).

For every emitted token of every output row, aligned with `OutputBuffer.tokens`:

    target_prob  float32[R, N]  the target's probability of the token (after the
                                logits processors when sampling)
    drafted      bool[R, N]     a proposed token the target accepted (False: the
                                target's own choice: a correction, a bonus token or
                                the first token)
    rejected     int32[R, N]    at a correction, the proposed token it replaced
                                (-1 elsewhere)

One verify step emits `accepted` drafted tokens and then one token of the target::

    proposal   d0 d1 d2 d3          (count 4)        target picks  d0 d1 x ...
    emitted    d0 d1 x              drafted  T T F    rejected  -1 -1 d2

so the acceptance length of each step is a run of True before a False.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenMetadata:
  target_prob: Float[Array, "R N"]
  drafted: Bool[Array, "R N"]
  rejected: Int[Array, "R N"]

  @classmethod
  def empty(cls, rows: int, capacity: int) -> "TokenMetadata":
    return cls(target_prob=jnp.zeros((rows, capacity), jnp.float32),
               drafted=jnp.zeros((rows, capacity), jnp.bool_),
               rejected=jnp.full((rows, capacity), -1, jnp.int32))

  def record(self, count_before: Int[Array, "R"], taken: Bool[Array, "R A"],
             target_prob: Float[Array, "R A"], drafted: Bool[Array, "R A"],
             rejected: Int[Array, "R A"]) -> "TokenMetadata":
    """Writes the values of the tokens `emit` took, at the buffer positions they took."""
    index = count_before[:, None] + jnp.arange(taken.shape[1])[None, :]  # [R, A]
    index = jnp.where(taken, index, self.target_prob.shape[1])  # not taken: dropped
    rows = jnp.arange(taken.shape[0])[:, None]
    put = lambda buffer, values: buffer.at[rows, index].set(values, mode="drop")
    return TokenMetadata(target_prob=put(self.target_prob, target_prob),
                         drafted=put(self.drafted, drafted), rejected=put(self.rejected, rejected))


def verified(probs: Float[Array, "R A V"], emitted: Int[Array, "R A"], proposal: Int[Array, "R D"],
             count: Int[Array, "R"], accepted: Int[Array, "R"]):
  """(target_prob, drafted, rejected) `[R, A]` (A = D + 1) of one verify step that
  emits `emitted[:, :accepted + 1]` after checking `proposal[:, :count]`."""
  column = jnp.arange(emitted.shape[1])[None, :]  # [1, A]
  target_prob = jnp.take_along_axis(probs, emitted[..., None], axis=-1)[..., 0]
  corrected = (column == accepted[:, None]) & (accepted < count)[:, None]
  rejected = jnp.where(corrected, jnp.pad(proposal, ((0, 0), (0, 1))), -1)
  return target_prob, column < accepted[:, None], rejected


def first(capacity: int, probs: Float[Array, "R V"], token: Int[Array, "R"]) -> TokenMetadata:
  """The metadata buffer holding the prefill's token (the target's own choice)."""
  ones = jnp.ones((token.shape[0], 1), jnp.bool_)
  return TokenMetadata.empty(token.shape[0], capacity).record(
      jnp.zeros_like(token), ones, jnp.take_along_axis(probs, token[:, None], axis=1),
      ~ones, jnp.full((token.shape[0], 1), -1, jnp.int32))


def per_row(metadata: TokenMetadata, counts: np.ndarray, rows: list[int]) -> list[dict]:
  """Host lists per output row, cut at its count, with the acceptance length of every
  verify step (the drafted tokens before each target token, the first token excluded)."""
  target_prob, drafted, rejected = jax.device_get(
      (metadata.target_prob, metadata.drafted, metadata.rejected))
  result = []
  for r in rows:
    n = int(counts[r])
    flags = drafted[r, :n].tolist()
    runs, run = [], 0
    for flag in flags[1:]:
      if flag:
        run += 1
      else:
        runs.append(run)
        run = 0
    if run:  # the last step stopped inside its accepted block (EOS or the budget)
      runs.append(run)
    result.append(dict(target_prob=target_prob[r, :n].tolist(), drafted=flags,
                       rejected=rejected[r, :n].tolist(), accepted_per_step=runs))
  return result
