"""Medusa heads (Cai et al. 2024): K residual heads on the last hidden state.

Head k (k = 1..K) reads the model's final-norm hidden state h_t and guesses token
t + 1 + k (the model's own head guesses t + 1)::

    h_t ─┬─ [x + SiLU(x W_k1 + b_k1)] ... [x + SiLU(x W_kL + b_kL)] ─ lm_head ─> token t + 1 + k
         └─ the model's lm_head ─> token t + 1

`w` starts at zero, so an untrained head repeats the model's next-token guess. The
unembedding is the model's (shared, frozen) unless the heads carry their own
(`own_unembedding`: FasterDecoding's layout, one `[D, V]` per head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from mdjax.heads.base import HeadsConfig
from mdjax.models.config import ModelConfig
from mdjax.models.numerics import full_float32
from mdjax.models.transformer import Params, lm_head


def init_medusa(config: HeadsConfig, seed: int = 0, dtype=jnp.float32,
                std: float = 0.02) -> Params:
  """Zero `w` (each block the identity at first), small random biases: the layout of
  the module docstring."""
  k, layers, d = config.num_heads, config.num_layers, config.hidden_size
  key_b, key_head = jax.random.split(jax.random.key(seed))
  params = {"blocks": {"w": jnp.zeros((k, layers, d, d), dtype),
                       "b": jnp.zeros((k, layers, d), dtype)}}
  if config.own_unembedding:
    params["lm_head"] = (std * jax.random.normal(key_head, (k, d, config.vocab_size))).astype(dtype)
  return params


@full_float32
def medusa_features(heads_params: Params, hidden: Float[Array, "... D"]
                    ) -> Float[Array, "... K D"]:
  """Every head's residual blocks over `hidden`: what its unembedding reads."""
  blocks = heads_params["blocks"]
  x = jnp.broadcast_to(hidden[..., None, :], (*hidden.shape[:-1], *blocks["w"].shape[:1],
                                              hidden.shape[-1]))  # [..., K, D]
  for layer in range(blocks["w"].shape[1]):
    w, b = blocks["w"][:, layer], blocks["b"][:, layer]  # [K, D, D], [K, D]
    x = x + jax.nn.silu(jnp.einsum("...kd,kde->...ke", x, w) + b)
  return x


@full_float32
def medusa_logits(heads_params: Params, model_params: Params, hidden: Float[Array, "... D"], *,
                  model_config: ModelConfig) -> Float[Array, "... K V"]:
  """Head k's logits (float32) for token t + 1 + k from the model's hidden state at t."""
  x = medusa_features(heads_params, hidden)  # [..., K, D]
  if "lm_head" not in heads_params:
    return lm_head(model_params, x, config=model_config)
  return jnp.einsum("...kd,kdv->...kv", x, heads_params["lm_head"],
                    preferred_element_type=jnp.float32)
