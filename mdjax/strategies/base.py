"""What every strategy shares: the prompt batch, run limits and the output buffer.

A strategy is a frozen dataclass of static options (hashable: it is a static jit
argument, and the key of the compiled-program cache) with pure functions over its
own state pytree::

    cache_slots(prompt_len, capacity) -> int          (static: how big a cache it needs)
    init(params, prompt, cache, limits, capacity) -> state   (prefill + first tokens)
    step(params, state) -> state                      (propose -> decode_step -> commit)
    done(state) -> bool[rows]
    result(state) -> (OutputBuffer, stats: dict of int32 scalars)

`mdjax.generate` runs `step` inside one `lax.while_loop`, so a whole generation is
one compiled program with no host sync per token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mdjax.cache import KVCache
from mdjax.models.config import ModelConfig
from mdjax.step import decode_step
from mdjax.topology import Topology


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompt:
  """Right-padded prompts: `tokens` int32[B, P] (padding ignored), `lengths` int32[B]."""

  tokens: Int[Array, "B P"]
  lengths: Int[Array, "B"]

  def segments(self) -> Int[Array, "B P"]:
    """Segment 0 for real tokens, -1 for padding (takes no cache slot)."""
    return jnp.where(jnp.arange(self.tokens.shape[1]) < self.lengths[:, None], 0, -1)

  def positions(self) -> Int[Array, "B P"]:
    return jnp.broadcast_to(jnp.arange(self.tokens.shape[1], dtype=jnp.int32), self.tokens.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Limits:
  """Run-time (traced) limits: changing them does not recompile."""

  max_new_tokens: Int[Array, ""]
  eos_ids: Int[Array, "E"]  # -1 entries never match
  key: jax.Array  # PRNG key of the whole run


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutputBuffer:
  """Generated tokens per output row: `tokens` int32[R, N] (-1 past `count`)."""

  tokens: Int[Array, "R N"]
  count: Int[Array, "R"]
  done: Bool[Array, "R"]

  @classmethod
  def empty(cls, rows: int, capacity: int) -> "OutputBuffer":
    return cls(tokens=jnp.full((rows, capacity), -1, jnp.int32),
               count=jnp.zeros((rows,), jnp.int32), done=jnp.zeros((rows,), jnp.bool_))


def emit(buffer: OutputBuffer, new: Int[Array, "R A"], num_new: Int[Array, "R"],
         limits: Limits) -> tuple[OutputBuffer, Bool[Array, "R A"]]:
  """Appends the first `num_new[r]` tokens of `new[r]` to row r.

  A row stops at its first EOS (kept) or at `max_new_tokens`; a done row takes
  nothing. Returns the buffer and which of the offered tokens were taken.
  """
  offered = jnp.arange(new.shape[1])[None, :] < num_new[:, None]  # [R, A]
  is_eos = (new[..., None] == limits.eos_ids).any(-1) & offered  # [R, A]
  eos_before = (jnp.cumsum(is_eos, axis=1) - is_eos) > 0
  index = buffer.count[:, None] + jnp.arange(new.shape[1])[None, :]  # [R, A]
  taken = offered & ~eos_before & (index < limits.max_new_tokens) & ~buffer.done[:, None]
  rows = jnp.arange(new.shape[0])[:, None]
  tokens = buffer.tokens.at[rows, jnp.where(taken, index, buffer.tokens.shape[1])].set(
      new, mode="drop")
  count = buffer.count + taken.sum(axis=1, dtype=jnp.int32)
  done = buffer.done | (taken & is_eos).any(axis=1) | (count >= limits.max_new_tokens)
  return OutputBuffer(tokens=tokens, count=count, done=done), taken


def prefill(params, prompt: Prompt, cache: KVCache, config: ModelConfig, attention: str
            ) -> tuple[Float[Array, "B V"], KVCache, Topology]:
  """The prompts into segment 0 of their rows: the logits after each row's last
  prompt token, the cache, and the one-segment causal topology."""
  topology = Topology.causal(prompt.tokens.shape[0])
  logits, _, cache = decode_step(params, cache, prompt.tokens, prompt.positions(),
                                 prompt.segments(), topology, config=config,
                                 logits_at=(prompt.lengths - 1)[:, None],
                                 attention=attention)  # [B, 1, V]
  return logits[:, 0], cache, topology
