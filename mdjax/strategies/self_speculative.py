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
`speculative`'s, from `mdjax.strategies.drafting`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.layer_loop import take_layers
from mdjax.models.transformer import Params
from mdjax.strategies import drafting, prompt_layouts
from mdjax.strategies.base import Limits, ModelFn, Prompt, internal
from mdjax.strategies.drafting import ChainState
from mdjax.strategies.registry import register


def draft_config(config: ModelConfig, draft_layers) -> ModelConfig:
  """The target's architecture cut after `draft_layers` layers."""
  if (not isinstance(draft_layers, int) or isinstance(draft_layers, bool)
      or not 1 <= draft_layers < config.num_layers):
    raise MdjaxError(f"draft_layers must be an integer in [1, {config.num_layers - 1}] "
                     f"(the target has {config.num_layers} layers), got {draft_layers!r}")
  layer_types = None if config.layer_types is None else config.layer_types[:draft_layers]
  return dataclasses.replace(config, num_layers=draft_layers, layer_types=layer_types)


def draft_params(params: Params, draft_layers: int) -> Params:
  """The target's params with only its first `draft_layers` layers, in the target's
  layer layout (`mdjax.models.layer_loop.take_layers`)."""
  return take_layers(params, draft_layers)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SelfSpeculative(drafting.ChainDrafter):
  """A chain drafted by the target's first `draft_layers` layers on its own cache."""

  name: ClassVar[str] = "self_speculative"
  layout: ClassVar = prompt_layouts.Plain()

  draft_layers: int | None = None
  num_draft_tokens: int = 4
  draft_schedule: str = "constant"
  max_draft_tokens: int = 0  # 0: num_draft_tokens (constant) or twice it (heuristic)
  confidence_threshold: float = 0.0
  return_metadata: bool = False  # per-token metadata (`mdjax.strategies.metadata`)
  draft: ModelFn | None = internal()  # the target cut after `draft_layers` (set by `construct`)

  @classmethod
  def construct(cls, target: ModelFn, model, options: dict) -> tuple["SelfSpeculative", dict]:
    """The target, and the draft cut from it: `{"target": ..., "draft": ...}` share
    their first `draft_layers` layers' weights."""
    layers = options.get("draft_layers")
    if layers is None:
      raise MdjaxError("strategy 'self_speculative' needs draft_layers=<how many of the target's "
                       f"{model.config.num_layers} layers draft>")
    draft = ModelFn(config=draft_config(model.config, layers), attention=target.attention)
    return (cls(model=target, draft=draft, **options),
            {"target": model.params, "draft": draft_params(model.params, layers)})

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> ChainState:
    return drafting.start_chain(self.model, None, params, prompt, cache, limits, capacity,
                                limits.sampling, self.schedule, self.return_metadata)

  def step(self, params, state: ChainState) -> ChainState:
    """The chain from the first layers, drafted on the target's cache, rolled back,
    then verified by the whole target."""
    keys = drafting.step_keys(state)
    logits, _, cache = self.draft(params["draft"], state.cache, state.last[:, None],
                                  state.next_pos[:, None],
                                  jnp.where(state.buffer.done, -1, 0)[:, None],
                                  state.topology)  # [B, 1, V]
    chain = drafting.draft_chain(self.draft, params["draft"], cache, logits[:, 0], keys, state,
                                 self.schedule, state.limits.sampling)
    verified, _ = drafting.verify_chain(
        self.model, params["target"], state, cache_ops.rollback(chain.cache, state.cache.length),
        keys, chain, self.schedule, state.limits.sampling)
    return verified
