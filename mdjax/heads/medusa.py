"""Medusa heads (Cai et al. 2024): K residual heads on the last hidden state.

Head k (k = 1..K) reads the target's final-norm hidden state h_t and guesses token
t + 1 + k (the target's own head guesses t + 1)::

    h_t ─┬─ [x + SiLU(x W_k1 + b_k1)] ... [x + SiLU(x W_kL + b_kL)] ─ lm_head ─> token t + 1 + k
         └─ the target's lm_head ─> token t + 1

`w` starts at zero, so an untrained head repeats the target's next-token guess. The
unembedding is the target's (shared, frozen) unless the heads carry their own
(`own_unembedding`: FasterDecoding's layout, one `[D, V]` per head).

As a family (`MedusaFamily`): decoded by `medusa` and `blockwise`, read from and
written to the "medusa" (FasterDecoding) and "vllm-medusa" layouts
(`mdjax.heads.formats.medusa`), trained on windows of K + 2 tokens around one position
(`mdjax.heads.objective.parallel_loss`), drafting from the target's hidden state at
the last committed token (`MedusaGuess`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from mdjax.heads import family
from mdjax.heads.base import HeadsConfig
from mdjax.heads.module import hold, params_of
from mdjax.heads.objective import Objective, parallel_loss
from mdjax.models.config import ModelConfig
from mdjax.models.numerics import full_float32, linear
from mdjax.models.transformer import Params, lm_head


class MedusaHeads(nnx.Module):
  """K Medusa heads (the module docstring). State, as `mdjax.heads.module` keeps it::

      blocks             w [K, L, D, D], b [K, L, D]
      lm_head            [K, D, V_d]   their own unembeddings, if any
      draft_ids          int32 [V_d]   a draft vocabulary, if any (`mdjax.heads.vocab`)
      draft_unembedding  [D, V_d]      the target's draft columns, gathered per request
  """

  def __init__(self, params: Params):
    hold(self, params)

  @classmethod
  def init(cls, config: HeadsConfig, seed: int = 0, dtype=jnp.float32,
           std: float = 0.02) -> "MedusaHeads":
    """Zero `w` (each block the identity at first), zero biases, a small random own
    unembedding when `config.own_unembedding`."""
    k, layers, d = config.num_heads, config.num_layers, config.hidden_size
    _, key_head = jax.random.split(jax.random.key(seed))
    params = {"blocks": {"w": jnp.zeros((k, layers, d, d), dtype),
                         "b": jnp.zeros((k, layers, d), dtype)}}
    if config.own_unembedding:
      params["lm_head"] = (std * jax.random.normal(key_head, (k, d, config.vocab_size))
                           ).astype(dtype)
    return cls(params)

  @full_float32
  def features(self, hidden: Float[Array, "... D"]) -> Float[Array, "... K D"]:
    """Every head's residual blocks over `hidden`: what its unembedding reads."""
    w, b = self.blocks["w"][...], self.blocks["b"][...]  # [K, L, D, D], [K, L, D]
    x = jnp.broadcast_to(hidden[..., None, :], (*hidden.shape[:-1], w.shape[0],
                                                hidden.shape[-1]))  # [..., K, D]
    for layer in range(w.shape[1]):
      x = x + jax.nn.silu(jnp.einsum("...kd,kde->...ke", x, w[:, layer],
                                     preferred_element_type=jnp.float32)
                          .astype(x.dtype) + b[:, layer])  # float32 sums: see `linear`
    return x

  @full_float32
  def __call__(self, target_params: Params, hidden: Float[Array, "... D"], *,
               model_config: ModelConfig) -> Float[Array, "... K V"]:
    """Head k's logits (float32) for token t + 1 + k from the target's hidden state at
    t: over the whole vocabulary, or over the heads' draft vocabulary (their own
    lm_head, or `draft_unembedding`)."""
    x = self.features(hidden)  # [..., K, D]
    if hasattr(self, "lm_head"):  # their own, over the draft vocabulary if they have one
      return jnp.einsum("...kd,kdv->...kv", x, self.lm_head[...],
                        preferred_element_type=jnp.float32)
    if hasattr(self, "draft_unembedding"):  # the target's draft columns [D, V_d]
      return linear(x, self.draft_unembedding[...], jnp.float32)
    return lm_head(target_params, x, config=model_config)


def init_medusa(config: HeadsConfig, seed: int = 0, dtype=jnp.float32) -> Params:
  """`MedusaHeads.init`'s params pytree."""
  return params_of(MedusaHeads.init(config, seed, dtype))


def medusa_features(heads_params: Params, hidden: Float[Array, "... D"]) -> Float[Array, "... K D"]:
  """`MedusaHeads.features` of the heads `heads_params`."""
  return MedusaHeads(heads_params).features(hidden)


def medusa_logits(heads_params: Params, target_params: Params, hidden: Float[Array, "... D"], *,
                  model_config: ModelConfig) -> Float[Array, "... K V"]:
  """`MedusaHeads(heads_params)`'s logits: a pure function of the pytrees (jit it)."""
  return MedusaHeads(heads_params)(target_params, hidden, model_config=model_config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaGuess:
  """How Medusa heads draft (`family.Guess`): from the target's hidden state at the
  last committed token, the prefill's at first, then each verify's along the
  accepted path; no pass of their own. `params`: `{"target", "heads"}`."""

  model_config: ModelConfig
  passes: ClassVar[int] = 0  # head passes per step besides the target's

  def start(self, params, hidden: Float[Array, "B P H"], last: Int[Array, "B N"], feed: family.Feed,
            slots: int, cache_dtype) -> Float[Array, "R H"]:
    at_last = jnp.take_along_axis(hidden, last[..., None], axis=1)  # [B, N, H]
    return at_last.reshape(-1, hidden.shape[-1])

  def logits(self, params, read: Float[Array, "R H"]) -> Float[Array, "R K V"]:
    return medusa_logits(params["heads"], params["target"], read, model_config=self.model_config)

  def advance(self, params, read, hidden: Float[Array, "R D+1 H"], accepted: Int[Array, "R"],
              feed: family.Feed) -> Float[Array, "R H"]:
    return jnp.take_along_axis(hidden, accepted[:, None, None], axis=1)[:, 0]


@family.register
@dataclasses.dataclass(frozen=True)
class MedusaFamily(family.HeadFamily):
  """Medusa heads (the module docstring)."""

  name = "medusa"
  strategies = ("medusa", "blockwise")
  owns_unembedding = True
  draft_vocabulary = True

  def init(self, config: HeadsConfig, model_config: ModelConfig, seed: int, dtype) -> Params:
    return init_medusa(config, seed, dtype)

  def window(self, num_heads: int) -> int:
    """x[p .. p + 1 + K], h[p .. p + K]: head k's target at p is x[p + 1 + k]."""
    return num_heads + 2

  def describe(self, config: HeadsConfig) -> str:
    return f"{config.num_heads} Medusa heads of {config.num_layers} residual block(s)"

  def restrict(self, params: Params, draft_ids: jax.Array, target_params: Params) -> Params:
    """Own unembeddings cut to the draft columns (shared ones: `draft_unembedding`)."""
    if "lm_head" not in params:
      return params
    return {**params, "lm_head": jnp.take(params["lm_head"], jnp.asarray(draft_ids), axis=-1)}

  def guesser(self, config: HeadsConfig, model_config: ModelConfig, attention: str,
              num_heads: int) -> MedusaGuess:
    return MedusaGuess(model_config=model_config)

  def loss(self, objective: Objective, params: Params, batch: dict, target: Params,
           ks: tuple[int, ...]):
    shared = {k: target[k] for k in ("draft_unembedding",) if k in target}  # frozen, not trained
    logits = lambda params, hidden, target: medusa_logits(
        {**params, **shared}, target, hidden, model_config=objective.model_config)
    return parallel_loss(logits, objective, params, batch, target, ks)
