"""`self_speculative`: the draft is the target's own first `draft_layers` layers + its
final norm and head (Draft & Verify, LayerSkip's self-speculation) — no second model.

The draft needs no cache of its own. A layer's K/V for a token depend only on the
tokens before it through the layers below, so the target's cache already holds, in
its first `draft_layers` layers, exactly what the truncated model would have
written for every committed token. The draft runs its passes on the target's cache
(writing only those layers), the drafted slots are rolled back, and the target's
verify pass writes all layers for the same tokens::

    cache slots      committed ... | c  d0 d1 d2       (c: last emitted token)
    draft passes     layers 0..k-1 write c, d0, d1 -> propose d0 d1 d2
    rollback         committed ... |                   (drafted slots forgotten)
    verify pass      all layers write c d0 d1 d2, keep the accepted prefix

Everything else (greedy or sampling acceptance, schedules, statistics) is
`Speculative`'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.transformer import Params
from mdjax.step import decode_step
from mdjax.strategies.base import Limits, Prompt
from mdjax.strategies.speculative import Speculative


def draft_config(config: ModelConfig, draft_layers) -> ModelConfig:
  """The target's architecture cut after `draft_layers` layers."""
  if (not isinstance(draft_layers, int) or isinstance(draft_layers, bool)
      or not 1 <= draft_layers < config.num_layers):
    raise MdjaxError(f"draft_layers must be an integer in [1, {config.num_layers - 1}] "
                     f"(the target has {config.num_layers} layers), got {draft_layers!r}")
  return dataclasses.replace(config, num_layers=draft_layers)


def draft_params(params: Params, draft_layers: int) -> Params:
  """The target's params with only its first `draft_layers` layers (no copy)."""
  return dict(params, layers=params["layers"][:draft_layers])


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelfSpeculative(Speculative):

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits, capacity: int) -> dict:
    return self._start_target(params["target"], prompt, cache, limits, capacity)

  def _propose(self, params, state: dict, keys: jax.Array):
    """The chain from the first layers, drafted on the target's cache, then rolled back."""
    cache, done = state["cache"], state["buffer"].done
    logits, _, drafting = decode_step(
        params["draft"], cache, state["last"][:, None], state["next_pos"][:, None],
        jnp.where(done, -1, 0)[:, None], state["topology"], config=self.draft_config,
        attention=self.attention)  # [B, 1, V]
    chain, length, q, drafting, passes = self._chain(params["draft"], state, keys, logits[:, 0],
                                                     drafting)
    return chain, length, q, dict(state, cache=cache_ops.rollback(drafting, cache.length)), passes

  def _after_verify(self, before: dict, state: dict, chain, length, accepted) -> dict:
    return state
