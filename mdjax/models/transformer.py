"""The llama-family transformer as pure functions over a params pytree.

Params::

    embed          [V, D]
    layers         a list of L per-layer dicts:
      attn_norm      [D]
      wqkv           [D, (N + 2K) * H]   q, k, v projections fused (one matmul)
      bqkv           [(N + 2K) * H]      qwen2 / llama attention_bias only
      q_norm         [H]                 qwen3, gemma3 only (RMSNorm per head, before RoPE)
      k_norm         [H]                 qwen3, gemma3 only
      wo             [N * H, D]
      bo             [D]                 llama attention_bias only
      post_attn_norm [D]                 gemma3 only (on the attention output)
      mlp_norm       [D]
      w_gate_up      [D, 2F]             gate and up fused
      b_gate_up      [2F]                mlp_bias only
      w_down         [F, D]
      b_down         [D]                 mlp_bias only
      post_mlp_norm  [D]                 gemma3 only (on the MLP output)
    final_norm     [D]
    lm_head        [D, V]              absent when the embedding is tied

Norm weights are stored as checkpoints hold them: gemma3's RMSNorms scale by
`1 + weight`, the others by `weight`. One gemma3 layer::

    x ─┬─ attn_norm ─ attention ─ post_attn_norm ─(+)─┬─ mlp_norm ─ GeGLU ─ post_mlp_norm ─(+)─>
       └───────────────────────────────────────────┘  └─────────────────────────────────────┘

Gemma3 also scales the embeddings by sqrt(D) (rounded to the weights' dtype), and its
layers mix sliding-window and full attention, each kind with its own RoPE
(`ModelConfig.layer_window`, `ModelConfig.inv_freq(layer)`).

Layers are a list walked by a Python loop, not arrays stacked for `lax.scan`:
XLA on CPU copies a dynamic slice of stacked weights before every matmul, which
tripled the bytes a decode step reads (measured: 10.8 ms vs 7.2 ms per step for
the 31M `random-llama` at batch 1). The KV cache stays stacked `[L, ...]`: each
layer writes its new K/V into its slots in place, then attends over the cache.

The model knows nothing of strategies: it maps tokens at explicit positions, in
explicit segments, over an explicit cache, to logits.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from mdjax import cache as cache_ops
from mdjax.cache import CacheRegions, KVCache
from mdjax.models.attention import LayerAttention, Queries, attention_fn, masked_attention
from mdjax.models.config import ModelConfig
from mdjax.topology import Topology, visibility_limits, visible

Params = dict


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, "D"], eps: float,
             plus_one: bool = False) -> Float[Array, "... D"]:
  """RMSNorm over the last axis. `plus_one` (gemma): scales by `1 + weight`, in float32
  before the cast back (llama casts first, then scales by `weight`)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if plus_one:
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
  return weight * normed.astype(x.dtype)


def _norm(config: ModelConfig, x: Float[Array, "... D"], weight: Float[Array, "D"]):
  return rms_norm(x, weight, config.rms_norm_eps, plus_one=config.gemma_norms)


def apply_rope(x: Float[Array, "B T N H"], positions: Int[Array, "B T"],
               inv_freq: Float[Array, "H/2"]) -> Float[Array, "B T N H"]:
  """Rotary embedding in Hugging Face's half-split layout (rotate_half)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def _project_qkv(config: ModelConfig, lp: Params, h: Float[Array, "B T D"], positions,
                 layer: int):
  n, k, hd = config.num_heads, config.num_kv_heads, config.head_dim
  qkv = h @ lp["wqkv"]  # [B, T, (N + 2K) * H]
  if config.qkv_bias:
    qkv = qkv + lp["bqkv"]
  b, t, _ = qkv.shape
  q = qkv[..., :n * hd].reshape(b, t, n, hd)
  key = qkv[..., n * hd:(n + k) * hd].reshape(b, t, k, hd)
  value = qkv[..., (n + k) * hd:].reshape(b, t, k, hd)
  if config.qk_norm:
    q = _norm(config, q, lp["q_norm"])
    key = _norm(config, key, lp["k_norm"])
  inv_freq = jnp.asarray(config.inv_freq(layer))
  return apply_rope(q, positions, inv_freq), apply_rope(key, positions, inv_freq), value


def _mlp(config: ModelConfig, lp: Params, h: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
  gate_up = h @ lp["w_gate_up"]  # [B, T, 2F]
  if config.mlp_bias:
    gate_up = gate_up + lp["b_gate_up"]
  gate, up = jnp.split(gate_up, 2, axis=-1)
  # gemma3: GeGLU with the tanh-approximated GELU (HF's gelu_pytorch_tanh)
  act = jax.nn.gelu(gate, approximate=True) if config.family == "gemma3" else jax.nn.silu(gate)
  out = (act * up) @ lp["w_down"]
  return out + lp["b_down"] if config.mlp_bias else out


def _layers(config: ModelConfig, params: Params, x: Float[Array, "B T D"],
            positions: Int[Array, "B T"], attend: Callable, carry):
  """The decoder layers, shared by the cached and the training forward.

  `attend(q, k, v, layer, carry) -> (out, carry)` maps the new tokens' q
  `[B, T, N, H]` and k, v `[B, T, K, H]` (RoPE applied) to the attention output
  `[B, T, N, H]`, threading `carry` (the cache) from layer to layer. Returns the
  final-norm hidden states `[B, T, D]` and the last carry.
  """
  for index, lp in enumerate(params["layers"]):
    h = _norm(config, x, lp["attn_norm"]) if "attn_norm" in lp else x  # (EAGLE-1 has none)
    q, k, v = _project_qkv(config, lp, h, positions, index)
    out, carry = attend(q, k, v, index, carry)  # [B, T, N, H]
    out = out.reshape(*out.shape[:2], -1) @ lp["wo"]
    if config.o_bias:
      out = out + lp["bo"]
    if config.gemma_norms:
      out = _norm(config, out, lp["post_attn_norm"])
    x = x + out
    out = _mlp(config, lp, _norm(config, x, lp["mlp_norm"]))
    if config.gemma_norms:
      out = _norm(config, out, lp["post_mlp_norm"])
    x = x + out
  return (_norm(config, x, params["final_norm"]) if "final_norm" in params else x), carry


def embed(config: ModelConfig, params: Params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
  """The tokens' embeddings; gemma3 scales them by sqrt(D), a float32 rounded to the
  embedding's dtype as transformers does (in bfloat16, sqrt(640) = 25.298 becomes 25.25)."""
  x = params["embed"][tokens]  # [B, T, D]
  if config.family != "gemma3":
    return x
  return x * jnp.asarray(np.float32(config.hidden_size**0.5), x.dtype)


def layer_attention(config: ModelConfig, layer: int) -> LayerAttention:
  """`layer`'s static attention settings: its sliding window, score scale, soft-cap."""
  return LayerAttention(sliding_window=config.layer_window(layer), scale=config.attention_scale,
                        softcap=config.attn_logit_softcapping)


def forward(params: Params, cache: KVCache, tokens: Int[Array, "B T"] | None,
            positions: Int[Array, "B T"], segments: Int[Array, "B T"], topology: Topology, *,
            config: ModelConfig, attention: str = "block_sparse", block_size: int = 128,
            slots: Int[Array, "B T"] | None = None, regions: CacheRegions | None = None,
            inputs: Float[Array, "B T D"] | None = None):
  """Runs the T tokens through every layer over `cache`; returns the final hidden
  states `[B, T, D]` (after the final norm) and the cache with the T tokens added.
  `inputs`, when given, replaces the tokens' embeddings (an EAGLE head feeds its
  fused token-and-feature vectors; MTP heads, the model's hidden states with no
  tokens at all: `tokens` None).

  Tokens with segment -1 are padding: they see nothing, are seen by nothing and
  take no cache slot. The others take the next free slots, or `slots` when given;
  `regions` (see `mdjax.models.attention.cascade_attention`) says the cache is laid
  out in one region per branch and every query sees only the shared part and its own.
  """
  attention_impl = attention_fn(attention, cache.num_slots, block_size, regions)
  cache, slot = cache_ops.claim_slots(cache, positions, segments, slots)
  meta = dict(positions=positions, segments=segments, slots=slot,
              limit=visibility_limits(topology))

  def attend(q, k, v, index, cache):
    cache = cache_ops.write_layer(cache, index, slot, k, v)
    out = attention_impl(Queries(q=q, **meta), cache, index, layer_attention(config, index))
    return out, cache

  x = embed(config, params, tokens) if inputs is None else inputs
  return _layers(config, params, x, positions, attend, cache)


def forward_causal(params: Params, tokens: Int[Array, "B T"] | None, *, config: ModelConfig,
                   inputs: Float[Array, "B T D"] | None = None) -> Float[Array, "B T D"]:
  """Plain causal forward of whole sequences without a cache (training, evaluation);
  `tokens` and `inputs` as in `forward`.

  Every row is one segment at positions 0..T-1; the same layers and visibility rule
  as `forward` over an empty cache, minus the cache writes, so it is differentiable.
  """
  b, t = (tokens if inputs is None else inputs).shape[:2]
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
  segments = jnp.zeros((b, t), jnp.int32)  # [B, T]
  limits = visibility_limits(Topology.causal(b))
  masks = {window: visible(limits, segments, positions, segments, positions, window)
           for window in {config.layer_window(i) for i in range(config.num_layers)}}  # [B, T, T]

  def attend(q, k, v, index, carry):  # no cache: the keys are the sequence itself
    spec = layer_attention(config, index)
    return masked_attention(q, k, v, masks[spec.sliding_window], scale=spec.scale,
                            softcap=spec.softcap), carry

  x = embed(config, params, tokens) if inputs is None else inputs
  hidden, _ = _layers(config, params, x, positions, attend, None)
  return hidden


def causal_logits(params: Params, tokens: Int[Array, "B T"], *,
                  config: ModelConfig) -> Float[Array, "B T V"]:
  """Next-token logits (float32) at every position of whole sequences: `forward_causal`
  then `lm_head`."""
  return lm_head(params, forward_causal(params, tokens, config=config), config=config)


def lm_head(params: Params, hidden: Float[Array, "... D"], *,
            config: ModelConfig) -> Float[Array, "... V"]:
  """Logits in float32, soft-capped when the config says so; the tied head reuses the
  (unscaled) embedding."""
  weight = params["lm_head"] if "lm_head" in params else params["embed"].T
  logits = jnp.matmul(hidden, weight, preferred_element_type=jnp.float32)
  cap = config.final_logit_softcapping
  return logits if cap is None else cap * jnp.tanh(logits / cap)
