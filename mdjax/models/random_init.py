"""Seeded random weights for a `ModelConfig` (tests, benchmarks, the random default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mdjax.models.config import ModelConfig
from mdjax.models.transformer import Params


def init_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> Params:
  """Normal(0, std) matrices, unit norms, small random biases; layout of `transformer`."""
  c = config
  d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
  qkv_width = (c.num_heads + 2 * c.num_kv_heads) * h
  keys = iter(jax.random.split(jax.random.key(seed), 3 + 10 * c.num_layers))

  def normal(*shape):
    return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  def layer():
    lp = {"attn_norm": jnp.ones((d,), dtype), "wqkv": normal(d, qkv_width),
          "wo": normal(c.num_heads * h, d), "mlp_norm": jnp.ones((d,), dtype),
          "w_gate_up": normal(d, 2 * f), "w_down": normal(f, d)}
    if c.qkv_bias:
      lp["bqkv"] = normal(qkv_width)
    if c.o_bias:
      lp["bo"] = normal(d)
    if c.mlp_bias:
      lp["b_gate_up"] = normal(2 * f)
      lp["b_down"] = normal(d)
    if c.qk_norm:
      lp["q_norm"] = 1 + normal(h)
      lp["k_norm"] = 1 + normal(h)
    return lp

  params = {"embed": normal(c.vocab_size, d), "layers": [layer() for _ in range(c.num_layers)],
            "final_norm": jnp.ones((d,), dtype)}
  if not c.tie_word_embeddings:
    params["lm_head"] = normal(d, c.vocab_size)
  return params
