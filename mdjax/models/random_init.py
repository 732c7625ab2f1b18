"""Seeded random weights for a `ModelConfig` (tests, benchmarks, the random default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mdjax.models.config import ModelConfig
from mdjax.models.transformer import Params


def init_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> Params:
  """Normal(0, std) matrices, identity norms (weight 1, or 0 where norms scale by
  `1 + weight`), small random biases; layout of `transformer`."""
  c = config
  d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
  qkv_width = (c.num_heads + 2 * c.num_kv_heads) * h
  keys = iter(jax.random.split(jax.random.key(seed), 3 + 10 * c.num_layers))
  identity = 0.0 if c.gemma_norms else 1.0

  def normal(*shape):
    return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  def norm(size):
    return jnp.full((size,), identity, dtype)

  def layer():
    lp = {"attn_norm": norm(d), "wqkv": normal(d, qkv_width),
          "wo": normal(c.num_heads * h, d), "mlp_norm": norm(d),
          "w_gate_up": normal(d, 2 * f), "w_down": normal(f, d)}
    if c.gemma_norms:
      lp["post_attn_norm"] = norm(d)
      lp["post_mlp_norm"] = norm(d)
    if c.qkv_bias:
      lp["bqkv"] = normal(qkv_width)
    if c.o_bias:
      lp["bo"] = normal(d)
    if c.mlp_bias:
      lp["b_gate_up"] = normal(2 * f)
      lp["b_down"] = normal(d)
    if c.qk_norm:
      lp["q_norm"] = identity + normal(h)
      lp["k_norm"] = identity + normal(h)
    return lp

  params = {"embed": normal(c.vocab_size, d), "layers": [layer() for _ in range(c.num_layers)],
            "final_norm": norm(d)}
  if not c.tie_word_embeddings:
    params["lm_head"] = normal(d, c.vocab_size)
  return params
