"""Medusa heads (Cai et al. 2024): K residual heads on the last hidden state.

Head k (k = 1..K) reads the model's final-norm hidden state h_t and guesses token
t + 1 + k (the model's own head guesses t + 1)::

    h_t ─┬─ [x + SiLU(x W_k1 + b_k1)] ... [x + SiLU(x W_kL + b_kL)] ─ lm_head ─> token t + 1 + k
         └─ the model's lm_head ─> token t + 1

`w` starts at zero, so an untrained head repeats the model's next-token guess. The
unembedding is the model's (shared, frozen) unless the heads carry their own
(`own_unembedding`: FasterDecoding's layout, one `[D, V]` per head).

As a family (`MedusaFamily`): decoded by `medusa` and `blockwise`, read from and
written to the "medusa" (FasterDecoding) and "vllm-medusa" layouts, trained on windows
of K + 2 tokens around one position (`mdjax.heads.objective.parallel_loss`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from mdjax.heads import family
from mdjax.heads.base import HeadsConfig
from mdjax.heads.objective import Objective, parallel_loss
from mdjax.models.config import ModelConfig
from mdjax.models.numerics import full_float32, linear
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
    x = x + jax.nn.silu(jnp.einsum("...kd,kde->...ke", x, w, preferred_element_type=jnp.float32)
                        .astype(x.dtype) + b)  # float32 sums: see `linear`
  return x


@full_float32
def medusa_logits(heads_params: Params, model_params: Params, hidden: Float[Array, "... D"], *,
                  model_config: ModelConfig) -> Float[Array, "... K V"]:
  """Head k's logits (float32) for token t + 1 + k from the model's hidden state at t:
  over the whole vocabulary, or over the heads' draft vocabulary (their own lm_head,
  or `draft_unembedding`, the model's columns `mdjax.heads.vocab.unembedding_columns`
  gathered once per request)."""
  x = medusa_features(heads_params, hidden)  # [..., K, D]
  if "lm_head" in heads_params:  # their own, over the draft vocabulary if they have one
    return jnp.einsum("...kd,kdv->...kv", x, heads_params["lm_head"],
                      preferred_element_type=jnp.float32)
  if "draft_unembedding" in heads_params:  # the model's draft columns [D, V_d]
    return linear(x, heads_params["draft_unembedding"], jnp.float32)
  return lm_head(model_params, x, config=model_config)


@family.register
@dataclasses.dataclass(frozen=True)
class MedusaFamily(family.HeadFamily):
  """Medusa heads (the module docstring)."""

  name = "medusa"
  strategies = ("medusa", "blockwise")
  layouts = ("medusa", "vllm-medusa")
  owns_unembedding = True
  draft_vocabulary = True

  def init(self, config: HeadsConfig, model_config: ModelConfig, seed: int, dtype) -> Params:
    return init_medusa(config, seed, dtype)

  def window(self, num_heads: int) -> int:
    """x[p .. p + 1 + K], h[p .. p + K]: head k's target at p is x[p + 1 + k]."""
    return num_heads + 2

  def describe(self, config: HeadsConfig) -> str:
    return f"{config.num_heads} Medusa heads of {config.num_layers} residual block(s)"

  def restrict(self, params: Params, draft_ids: jax.Array, model_params: Params) -> Params:
    """Own unembeddings cut to the draft columns (shared ones: `draft_unembedding`)."""
    if "lm_head" not in params:
      return params
    return {**params, "lm_head": jnp.take(params["lm_head"], jnp.asarray(draft_ids), axis=-1)}

  def loss(self, objective: Objective, params: Params, batch: dict, base: Params,
           ks: tuple[int, ...]):
    shared = {k: base[k] for k in ("draft_unembedding",) if k in base}  # frozen, not trained
    logits = lambda params, hidden, base: medusa_logits({**params, **shared}, base, hidden,
                                                         model_config=objective.model_config)
    return parallel_loss(logits, objective, params, batch, base, ks)
