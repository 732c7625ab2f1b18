"""The EAGLE-style sequential head (Li et al. 2024): a one-layer decoder that drafts in
feature space with its own small KV cache.

At token t it reads the token's embedding (the model's, frozen) and a feature f_t
(the model's final-norm hidden state at t - 1 for text the model has seen, its own
output for tokens it drafted), fuses them, and predicts the feature at t, which the
target's `lm_head` turns into a guess of token t + 1::

    embed(x_t) ──┐
                 concat ─ fc [2D, D] ─ decoder layer(s) over its cache ─ final_norm ─> f̂_{t+1} ─ lm_head ─> x_{t+1}
    f_t ─────────┘                      (RoPE at t, the same topology)

The decoder layers are the model's own layer type (`mdjax.models.transformer`, config
`decoder_config`), so the head runs at explicit positions and segments like the model
does and verification trees need nothing new. Params::

    fc          [2D, D]    on concat(embedding, feature)
    fc_bias     [D]
    layers      a list of decoder-layer dicts (`transformer`'s layout); EAGLE-1's
                first layer has no attn_norm
    final_norm  [D]        absent in EAGLE-1 (its output goes to lm_head as it is)

As a family (`EagleFamily`): decoded by `eagle`, read from and written to the "eagle"
(SafeAILab) layout, keeping a KV cache of `num_layers` layers, trained on whole rows
with the head unrolled on its own predictions (`eagle_loss`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from mdjax import programs
from mdjax.cache import KVCache
from mdjax.heads import family
from mdjax.heads.base import HeadsConfig
from mdjax.heads.decoder import decoder_config
from mdjax.heads.module import hold, params_of
from mdjax.heads.objective import Objective, masked_mean, top_k_hits
from mdjax.models.config import ModelConfig
from mdjax.models.numerics import full_float32, linear
from mdjax.models.random_init import init_params
from mdjax.models.transformer import Params, embed, forward, forward_causal, lm_head
from mdjax.topology import Topology


class EagleHead(nnx.Module):
  """The EAGLE-style head (the module docstring): `fc`, `fc_bias`, `layers`,
  `final_norm` (absent in EAGLE-1), as `mdjax.heads.module` keeps them."""

  def __init__(self, params: Params):
    hold(self, params)

  @classmethod
  def init(cls, config: HeadsConfig, model_config: ModelConfig, seed: int = 0,
           dtype=jnp.float32, std: float = 0.02) -> "EagleHead":
    """Random decoder layers (`init_params`' scheme), a small random fc, a zero bias
    and an identity final norm."""
    decoder = init_params(decoder_config(model_config, config.num_layers), seed, dtype, std)
    d = config.hidden_size
    fc = std * jax.random.normal(jax.random.key(seed + 1), (2 * d, d), jnp.float32)
    return cls({"fc": fc.astype(dtype), "fc_bias": jnp.zeros((d,), dtype),
                "layers": decoder["layers"], "final_norm": decoder["final_norm"]})

  @full_float32
  def inputs(self, target_params: Params, tokens: Int[Array, "B T"],
             features: Float[Array, "B T D"], *, model_config: ModelConfig
             ) -> Float[Array, "B T D"]:
    """fc(concat(embedding of each token, its feature)): what the decoder layers read."""
    fc = self.fc[...]
    x = jnp.concatenate([embed(model_config, target_params, tokens),
                         features.astype(fc.dtype)], axis=-1)  # [B, T, 2D]
    return linear(x, fc) + self.fc_bias[...]

  def __call__(self, target_params: Params, cache: KVCache, tokens: Int[Array, "B T"],
               features: Float[Array, "B T D"], positions: Int[Array, "B T"],
               segments: Int[Array, "B T"], topology: Topology, *, model_config: ModelConfig,
               attention: str = "block_sparse", logits_at: Int[Array, "B R"] | None = None
               ) -> tuple[Float[Array, "B R V"], Float[Array, "B T D"], KVCache]:
    """One head pass over its cache (`KVCache.create(decoder_config(...), ...)`), like
    `decode_step`: `(logits of the token after each fed one, predicted features, cache)`;
    with `logits_at`, the logits after those fed tokens only (R of them; none: R = 0)."""
    inputs = self.inputs(target_params, tokens, features, model_config=model_config)
    hidden, cache = forward(params_of(self), cache, tokens, positions, segments, topology,
                            config=decoder_config(model_config, len(self.layers)),
                            attention=attention, inputs=inputs)
    picked = hidden if logits_at is None else jnp.take_along_axis(
        hidden, logits_at[..., None], axis=1)  # [B, R, D]
    return lm_head(target_params, picked, config=model_config), hidden, cache

  def causal(self, target_params: Params, tokens: Int[Array, "B T"],
             features: Float[Array, "B T D"], *, model_config: ModelConfig
             ) -> Float[Array, "B T D"]:
    """Training forward without a cache: the predicted feature after every token of
    whole sequences (`features[:, t]` is the target's hidden state at t - 1)."""
    inputs = self.inputs(target_params, tokens, features, model_config=model_config)
    return forward_causal(params_of(self), tokens,
                          config=decoder_config(model_config, len(self.layers)), inputs=inputs)


def init_eagle(config: HeadsConfig, model_config: ModelConfig, seed: int = 0,
               dtype=jnp.float32) -> Params:
  """`EagleHead.init`'s params pytree."""
  return params_of(EagleHead.init(config, model_config, seed, dtype))


def eagle_inputs(heads_params: Params, target_params: Params, tokens: Int[Array, "B T"],
                 features: Float[Array, "B T D"], *, model_config: ModelConfig
                 ) -> Float[Array, "B T D"]:
  """`EagleHead.inputs` of the head `heads_params` (its `fc` and `fc_bias` suffice)."""
  return EagleHead(heads_params).inputs(target_params, tokens, features,
                                        model_config=model_config)


@functools.partial(programs.jit, static_argnames=("model_config", "attention"),
                   donate_argnames=("cache",))
def eagle_step(heads_params: Params, target_params: Params, cache: KVCache,
               tokens: Int[Array, "B T"], features: Float[Array, "B T D"],
               positions: Int[Array, "B T"], segments: Int[Array, "B T"], topology: Topology, *,
               model_config: ModelConfig, attention: str = "block_sparse",
               logits_at: Int[Array, "B R"] | None = None
               ) -> tuple[Float[Array, "B R V"], Float[Array, "B T D"], KVCache]:
  """`EagleHead(heads_params)`'s pass over `cache`: a pure, jitted function of the pytrees."""
  return EagleHead(heads_params)(target_params, cache, tokens, features, positions, segments,
                                 topology, model_config=model_config, attention=attention,
                                 logits_at=logits_at)


def eagle_causal(heads_params: Params, target_params: Params, tokens: Int[Array, "B T"],
                 features: Float[Array, "B T D"], *, model_config: ModelConfig
                 ) -> Float[Array, "B T D"]:
  """`EagleHead.causal` of the head `heads_params`."""
  return EagleHead(heads_params).causal(target_params, tokens, features,
                                        model_config=model_config)


def eagle_targets(batch: dict) -> dict[str, jax.Array]:
  """What the head reads and learns at p = 0..n - 3 of rows of n tokens (W = n - 2)::

      tokens    x[p + 1]    [B, W]     read, with
      features  h[p]        [B, W, D]
      wanted    h[p + 1]    [B, W, D]  the feature to predict
      targets   x[p + 2]    [B, W]     the token lm_head(wanted) guesses, and its
      mask                  [B, W]     may x[p + 2] be a target?
      greedy                [B, W]     the model's greedy guess of x[p + 2]
  """
  hidden = batch["hidden"].astype(jnp.float32)  # [B, n - 1, D]
  return {"tokens": batch["tokens"][:, 1:-1], "features": hidden[:, :-1], "wanted": hidden[:, 1:],
          "targets": batch["tokens"][:, 2:], "mask": batch["ok"][:, 2:],
          "greedy": batch["greedy"][:, 1:]}


def eagle_loss(objective: Objective, params: Params, batch: dict, target: Params,
               ks: tuple[int, ...]):
  """At each p of `eagle_targets`: smooth L1 from the predicted to the wanted feature
  (`regression_weight`), plus `token_weight` x the token loss of its lm_head logits.
  Unrolled step i (weight decay^(i - 1)) feeds the head, in place of h[p], its own step
  i - 1 prediction at p - 1 (h[0] stays): a cheap training-time test. Unlike drafting,
  where the prefix keeps the model's own features, every earlier position then holds
  predicted features too."""
  t = eagle_targets(batch)
  features, loss, hits, counts = t["features"], 0.0, [], []
  for step in range(objective.depth):
    predicted = eagle_causal(params, target, t["tokens"], features,
                             model_config=objective.model_config)  # [B, W, D]
    logits = lm_head(target, predicted, config=objective.model_config)  # [B, W, V]
    regression = jnp.mean(optax.huber_loss(predicted, t["wanted"], delta=1.0), axis=-1)  # [B, W]
    token = objective.token_losses(logits, t["targets"], t["wanted"], target)  # [B, W]
    loss += objective.decay ** step * masked_mean(
        objective.regression_weight * regression + objective.token_weight * token, t["mask"])
    hits.append(top_k_hits(logits, t["greedy"], t["mask"], ks))
    counts.append(jnp.sum(t["mask"]))
    features = jnp.concatenate([features[:, :1], predicted[:, :-1]], axis=1)
  return loss, {"hits": jnp.stack(hits), "count": jnp.stack(counts)}


@family.register
@dataclasses.dataclass(frozen=True)
class EagleFamily(family.HeadFamily):
  """The EAGLE-style sequential head (the module docstring)."""

  name = "eagle"
  strategies = ("eagle",)
  sequential = True
  step_label = "draft step"

  def init(self, config: HeadsConfig, model_config: ModelConfig, seed: int, dtype) -> Params:
    return init_eagle(config, model_config, seed, dtype)

  def cache_config(self, config: HeadsConfig, model_config: ModelConfig) -> ModelConfig:
    return decoder_config(model_config, config.num_layers)

  def draft_step(self, config: HeadsConfig, heads_params: Params, target_params: Params,
                 cache: KVCache, tokens, features, positions, segments, topology, *,
                 model_config: ModelConfig, attention: str, logits_at=None):
    return eagle_step(heads_params, target_params, cache, tokens, features, positions,
                      segments, topology, model_config=model_config, attention=attention,
                      logits_at=logits_at)

  def describe(self, config: HeadsConfig) -> str:
    return f"An EAGLE-style head of {config.num_layers} decoder layer(s)"

  def loss(self, objective: Objective, params: Params, batch: dict, target: Params,
           ks: tuple[int, ...]):
    return eagle_loss(objective, params, batch, target, ks)
