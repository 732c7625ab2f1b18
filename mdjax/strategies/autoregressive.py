"""`greedy` and `sample`: one token per row per model pass (the baseline).

Cache of each row: the prompt in segment 0 at positions 0..len-1, then one
generated token per step at the next position; a finished row feeds padding
(segment -1), which takes no slot.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mdjax.cache import KVCache
from mdjax.models.config import ModelConfig
from mdjax.sampling import SamplingParams, choose, row_keys
from mdjax.step import decode_step
from mdjax.strategies.base import Limits, OutputBuffer, Prompt, emit, prefill


@dataclasses.dataclass(frozen=True, kw_only=True)
class Autoregressive:
  config: ModelConfig
  sampling: SamplingParams = SamplingParams(temperature=0.0)
  attention: str = "block_sparse"

  def cache_slots(self, prompt_len: int, max_new_tokens: int) -> int:
    """Slots per row: the padded prompt, then one per generated token."""
    return prompt_len + max_new_tokens

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits, capacity: int) -> dict:
    batch = prompt.tokens.shape[0]
    logits, cache, topology = prefill(params, prompt, cache, self.config, self.attention)
    state = dict(cache=cache, topology=topology, limits=limits,
                 buffer=OutputBuffer.empty(batch, capacity), next_pos=prompt.lengths,
                 last=jnp.zeros((batch,), jnp.int32), passes=jnp.zeros((), jnp.int32))
    return self._commit(state, logits)

  def step(self, params, state: dict) -> dict:
    segments = jnp.where(state["buffer"].done, -1, 0)[:, None]  # [B, 1]
    logits, _, cache = decode_step(params, state["cache"], state["last"][:, None],
                                   state["next_pos"][:, None], segments, state["topology"],
                                   config=self.config, attention=self.attention)  # [B, 1, V]
    state = dict(state, cache=cache, next_pos=state["next_pos"] + 1, passes=state["passes"] + 1)
    return self._commit(state, logits[:, 0])

  def _commit(self, state: dict, logits) -> dict:
    buffer = state["buffer"]
    keys = row_keys(state["limits"].key, jnp.arange(buffer.count.shape[0]), buffer.count)
    token = choose(keys, logits, self.sampling)  # [B]
    buffer, _ = emit(buffer, token[:, None], jnp.ones_like(token), state["limits"])
    return dict(state, buffer=buffer, last=token)

  def done(self, state: dict):
    return state["buffer"].done

  def result(self, state: dict):
    return state["buffer"], {"target_passes": state["passes"]}
