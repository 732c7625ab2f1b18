"""Seeded random weights for a `ModelConfig` (tests, benchmarks, the random default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mdjax.models.config import ModelConfig
from mdjax.models.transformer import Params


def init_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> Params:
  """Normal(0, std) matrices, unit norms, small random biases; layout of `transformer`."""
  c = config
  l, d, f, h = c.num_layers, c.hidden_size, c.intermediate_size, c.head_dim
  qkv_width = (c.num_heads + 2 * c.num_kv_heads) * h
  keys = iter(jax.random.split(jax.random.key(seed), 16))

  def normal(*shape):
    return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  layers = {
      "attn_norm": jnp.ones((l, d), dtype),
      "wqkv": normal(l, d, qkv_width),
      "wo": normal(l, c.num_heads * h, d),
      "mlp_norm": jnp.ones((l, d), dtype),
      "w_gate_up": normal(l, d, 2 * f),
      "w_down": normal(l, f, d),
  }
  if c.qkv_bias:
    layers["bqkv"] = normal(l, qkv_width)
  if c.o_bias:
    layers["bo"] = normal(l, d)
  if c.mlp_bias:
    layers["b_gate_up"] = normal(l, 2 * f)
    layers["b_down"] = normal(l, d)
  if c.qk_norm:
    layers["q_norm"] = 1 + normal(l, h)
    layers["k_norm"] = 1 + normal(l, h)
  params = {"embed": normal(c.vocab_size, d), "layers": layers, "final_norm": jnp.ones((d,), dtype)}
  if not c.tie_word_embeddings:
    params["lm_head"] = normal(d, c.vocab_size)
  return params
