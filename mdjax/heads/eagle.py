"""The EAGLE-style sequential head (Li et al. 2024): a one-layer decoder that drafts in
feature space with its own small KV cache.

At token t it reads the token's embedding (the model's, frozen) and a feature f_t
(the model's final-norm hidden state at t - 1 for text the model has seen, its own
output for tokens it drafted), fuses them, and predicts the feature at t, which the
model's `lm_head` turns into a guess of token t + 1::

    embed(x_t) ──┐
                 concat ─ fc [2D, D] ─ decoder layer(s) over its cache ─ final_norm ─> f̂_{t+1} ─ lm_head ─> x_{t+1}
    f_t ─────────┘                      (RoPE at t, the same topology)

The decoder layers are the model's own layer type (`mdjax.models.transformer`, config
`eagle_config`), so the head runs at explicit positions and segments like the model
does and verification trees need nothing new. Params::

    fc          [2D, D]    on concat(embedding, feature)
    fc_bias     [D]
    layers      a list of decoder-layer dicts (`transformer`'s layout); EAGLE-1's
                first layer has no attn_norm
    final_norm  [D]        absent in EAGLE-1 (its output goes to lm_head as it is)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from mdjax import programs
from mdjax.cache import KVCache
from mdjax.heads.base import HeadsConfig
from mdjax.models.config import ModelConfig
from mdjax.models.numerics import full_float32
from mdjax.models.random_init import init_params
from mdjax.models.transformer import Params, embed, forward, forward_causal, lm_head
from mdjax.topology import Topology


def eagle_config(model_config: ModelConfig, num_layers: int) -> ModelConfig:
  """The head's decoder: the model's layer type, `num_layers` deep, full attention."""
  layer_types = None if model_config.layer_types is None else ("full_attention",) * num_layers
  return dataclasses.replace(model_config, num_layers=num_layers, layer_types=layer_types)


def init_eagle(config: HeadsConfig, model_config: ModelConfig, seed: int = 0, dtype=jnp.float32,
               std: float = 0.02) -> Params:
  """Random decoder layers (`init_params`' scheme), a small random fc, a zero bias
  and an identity final norm."""
  decoder = init_params(eagle_config(model_config, config.num_layers), seed, dtype, std)
  d = config.hidden_size
  fc = std * jax.random.normal(jax.random.key(seed + 1), (2 * d, d), jnp.float32)
  return {"fc": fc.astype(dtype), "fc_bias": jnp.zeros((d,), dtype), "layers": decoder["layers"],
          "final_norm": decoder["final_norm"]}


@full_float32
def eagle_inputs(heads_params: Params, model_params: Params, tokens: Int[Array, "B T"],
                 features: Float[Array, "B T D"], *, model_config: ModelConfig
                 ) -> Float[Array, "B T D"]:
  """fc(concat(embedding of each token, its feature)): what the decoder layers read."""
  x = jnp.concatenate([embed(model_config, model_params, tokens),
                       features.astype(heads_params["fc"].dtype)], axis=-1)  # [B, T, 2D]
  return x @ heads_params["fc"] + heads_params["fc_bias"]


@functools.partial(programs.jit, static_argnames=("model_config", "num_layers", "attention"),
                   donate_argnames=("cache",))
def eagle_step(heads_params: Params, model_params: Params, cache: KVCache,
               tokens: Int[Array, "B T"], features: Float[Array, "B T D"],
               positions: Int[Array, "B T"], segments: Int[Array, "B T"], topology: Topology, *,
               model_config: ModelConfig, num_layers: int, attention: str = "block_sparse",
               logits_at: Int[Array, "B R"] | None = None
               ) -> tuple[Float[Array, "B R V"], Float[Array, "B T D"], KVCache]:
  """One head pass over its cache (`KVCache.create(eagle_config(...), ...)`), like
  `decode_step`: `(logits of the token after each fed one, predicted features, cache)`;
  with `logits_at`, the logits after those fed tokens only (R of them; none: R = 0)."""
  inputs = eagle_inputs(heads_params, model_params, tokens, features, model_config=model_config)
  hidden, cache = forward(heads_params, cache, tokens, positions, segments, topology,
                          config=eagle_config(model_config, num_layers), attention=attention,
                          inputs=inputs)
  picked = hidden if logits_at is None else jnp.take_along_axis(
      hidden, logits_at[..., None], axis=1)  # [B, R, D]
  return lm_head(model_params, picked, config=model_config), hidden, cache


def eagle_causal(heads_params: Params, model_params: Params, tokens: Int[Array, "B T"],
                 features: Float[Array, "B T D"], *, model_config: ModelConfig,
                 num_layers: int) -> Float[Array, "B T D"]:
  """Training forward without a cache: the predicted feature after every token of
  whole sequences (`features[:, t]` is the model's hidden state at t - 1)."""
  inputs = eagle_inputs(heads_params, model_params, tokens, features, model_config=model_config)
  return forward_causal(heads_params, tokens, config=eagle_config(model_config, num_layers),
                        inputs=inputs)
