"""The llama-family transformer as pure functions over a params pytree.

Params::

    embed          [V, D]
    layers         L per-layer dicts (a list), or one dict of them stacked [L, ...]:
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

On a mesh with tensor > 1 (`mdjax.sharding`) each fused projection is stored split,
so no shard boundary falls inside q|k|v or gate|up: `wq [D, N*H]`, `wk`/`wv [D, K*H]`
(`bq`, `bk`, `bv`) and `w_gate`/`w_up [D, F]` (`b_gate`, `b_up`); and `embed`/`lm_head`
are padded to a multiple of the tensor size in V (the logits are cut back to V).

Norm weights are stored as checkpoints hold them: gemma3's RMSNorms scale by
`1 + weight`, the others by `weight`. One gemma3 layer::

    x ─┬─ attn_norm ─ attention ─ post_attn_norm ─(+)─┬─ mlp_norm ─ GeGLU ─ post_mlp_norm ─(+)─>
       └───────────────────────────────────────────┘  └─────────────────────────────────────┘

Gemma3 also scales the embeddings by sqrt(D) (rounded to the weights' dtype), and its
layers mix sliding-window and full attention, each kind with its own RoPE
(`ModelConfig.layer_window`, `ModelConfig.inv_freq(layer)`).

`layers` is a list walked by a Python loop ("unrolled"), or the same leaves stacked
`[L, ...]` in one dict and walked by `lax.scan` ("scan", see `mdjax.models.layer_loop`:
compile time flat in depth; on CPU slower per token, so "unrolled" is CPU's default).
Both run each layer through `_layer`. The KV cache is stacked `[L, ...]`, or per layer
under "unrolled" (`mdjax.cache`): each layer writes its new K/V in place, then attends.
On a GPU a pass of a few tokens under the fused attention runs kernels of mdjax's own
(`_layers_beside_cache`): the attention reads the cache as it was, with the new tokens
beside it, and writes their K/V in place; an RMSNorm and the product after it are one
kernel (`mdjax.models.decode_products`), or split by `_normed`.

The model knows no strategy: tokens at explicit positions and segments, over a cache, to logits.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from mdjax import cache as cache_ops
from mdjax import platform
from mdjax.cache import CacheRegions, KVCache
from mdjax.errors import MdjaxError
from mdjax.models import decode_attention, decode_products
from mdjax.models.attention import (ATTENTION_BLOCK, LayerAttention, Queries, attention_fn,
                                    masked_attention)
from mdjax.models.config import ModelConfig
from mdjax.models.layer_loop import count_layers, layer_loop_of, layer_scope
from mdjax.models.numerics import full_float32, linear, linear_parts
from mdjax.models.quantized import is_quantized, splits, take_rows
from mdjax.models.rope import apply_rope
from mdjax.sharding import constrain, constrain_cache
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


def _normed(config: ModelConfig, x: Float[Array, "B T D"], weight: Float[Array, "D"]
            ) -> tuple[Float[Array, "B T D"], Float[Array, "B T 1"] | None]:
  """The RMSNorm of `x` as the products after it take it: `(normed, None)`; on a GPU
  `(x * weight, 1 / rms(x))`, each product's output then multiplied by the second
  (`_product`): x * weight is fused into the product's operand and the row scale into
  what reads its output, so the norm is one reduction fused with the residual add
  before it, not a reduction and a multiply of its own (the same value up to rounding:
  the scale is applied to the float32 sum instead of the rounded input)."""
  if platform.current() != "gpu":
    return _norm(config, x, weight), None
  x32 = x.astype(jnp.float32)
  scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + config.rms_norm_eps)
  if config.gemma_norms:
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype), scale
  return weight * x, scale


def _product(h: Float[Array, "B T D"], scale: Float[Array, "B T 1"] | None,
             weight: Float[Array, "D F"]) -> Float[Array, "B T F"]:
  """`linear(h, weight)` of an `_normed` input: times its row scale when it has one."""
  if scale is None:
    return linear(h, weight)
  return (linear(h, weight, jnp.float32) * scale).astype(h.dtype)


def _attention_scales(config: ModelConfig, lp: Params, scale) -> bool:
  """Whether a layer hands its attention the fused q|k|v product (float weights) before
  the norm's row `scale` (`_normed`), for the attention to apply it: one product, no
  bias, no q/k norm between the product and RoPE."""
  return (scale is not None and "wqkv" in lp and not config.qkv_bias and not config.qk_norm
          and splits(lp["wqkv"], decode_attention.parts(config.hidden_size)))


def _split_heads(config: ModelConfig, qkv: Float[Array, "B T Q"]):
  """A fused q|k|v product `[B, T, (N + 2K) * H]` as q `[B, T, N, H]`, k and v `[B, T, K, H]`."""
  n, k, hd = config.num_heads, config.num_kv_heads, config.head_dim
  b, t, _ = qkv.shape
  q, key, value = jnp.split(qkv, [n * hd, (n + k) * hd], axis=-1)
  return q.reshape(b, t, n, hd), key.reshape(b, t, k, hd), value.reshape(b, t, k, hd)


def _project_qkv(config: ModelConfig, lp: Params, h: Float[Array, "B T D"], scale, positions,
                 layer: int, rope: bool = True):
  if "wqkv" in lp:  # fused (one device)
    qkv = _product(h, scale, lp["wqkv"])  # [B, T, (N + 2K) * H]
    if config.qkv_bias:
      qkv = qkv + lp["bqkv"]
    q, key, value = _split_heads(config, qkv)
  else:  # split (a mesh: see `mdjax.sharding`)
    q, key, value = (_product(h, scale, lp["w" + x]) for x in "qkv")
    if config.qkv_bias:
      q, key, value = q + lp["bq"], key + lp["bk"], value + lp["bv"]
    q, key, value = (x.reshape(*h.shape[:2], -1, config.head_dim) for x in (q, key, value))
  q = constrain(q, "batch", None, "heads", None)
  key = constrain(key, "batch", None, "kv_heads", None)
  value = constrain(value, "batch", None, "kv_heads", None)
  if config.qk_norm:
    q = _norm(config, q, lp["q_norm"])
    key = _norm(config, key, lp["k_norm"])
  if not rope:
    return q, key, value
  inv_freq = jnp.asarray(config.inv_freq(layer))
  return apply_rope(q, positions, inv_freq), apply_rope(key, positions, inv_freq), value


def _mlp(config: ModelConfig, lp: Params, h: Float[Array, "B T D"], scale) -> Float[Array, "B T D"]:
  if "w_gate_up" in lp:  # fused (one device)
    gate_up = _product(h, scale, lp["w_gate_up"])  # [B, T, 2F]
    if config.mlp_bias:
      gate_up = gate_up + lp["b_gate_up"]
    gate, up = jnp.split(gate_up, 2, axis=-1)
  else:  # split (a mesh)
    gate, up = _product(h, scale, lp["w_gate"]), _product(h, scale, lp["w_up"])  # [B, T, F] each
    if config.mlp_bias:
      gate, up = gate + lp["b_gate"], up + lp["b_up"]
  # gemma3: GeGLU with the tanh-approximated GELU (HF's gelu_pytorch_tanh)
  act = jax.nn.gelu(gate, approximate=True) if config.family == "gemma3" else jax.nn.silu(gate)
  inner = constrain(act * up, "batch", None, "mlp")  # [B, T, F]
  out = linear(inner, lp["w_down"])
  return constrain(out + lp["b_down"] if config.mlp_bias else out, "batch", None, None)


def decoder_layers(config: ModelConfig, params: Params, x: Float[Array, "B T D"],
                   positions: Int[Array, "B T"], attend: Callable, carry,
                   aux_layers: tuple[int, ...] = (), rope_in_attention: bool = False,
                   final_norm: bool = True):
  """The decoder layers, shared by the cached and the training forward, in either
  layout of `params["layers"]` (`mdjax.models.layer_loop`).

  `attend(q, k, v, layer, spec, carry) -> (out, carry)` maps the new tokens' q
  `[B, T, N, H]` and k, v `[B, T, K, H]` (RoPE applied) to the attention output
  `[B, T, N, H]`, threading `carry` (the cache) from layer to layer; `layer` is the
  layer's index (an int, or a traced int32 scalar under scan), `spec` its static
  `LayerAttention`. Returns the final-norm hidden states `[B, T, D]` (without
  `final_norm`: the residual stream after the last layer, for `head_of_residual`), the residual
  stream after each layer of `aux_layers` `[B, T, A, D]` (None when A = 0) and the
  last carry. With `rope_in_attention`, `attend(qkv, layer, spec, carry)` takes the
  q|k|v product as the parts `mdjax.models.decode_attention` reads, before RoPE, which
  it applies itself; where a layer can (`_attention_scales`), that is the product's
  float32 partial sums (`linear_parts`) before the attention norm's row scale, and
  `attend` gets the residual rows the scale is computed from as `norm_input`.
  """
  aux = _aux_buffer(count_layers(params), x, aux_layers)
  if layer_loop_of(params) == "scan":
    x, carry, aux = _scanned_layers(config, params["layers"], x, positions, attend, carry,
                                    aux_layers, aux, rope_in_attention)
  else:
    for index, lp in enumerate(params["layers"]):
      with jax.named_scope(layer_scope(index)):
        x, carry = _layer(config, lp, x, positions, attend, carry, index, index, rope_in_attention)
      aux = _keep(aux, aux_layers, index, x)
  hidden = _norm(config, x, params["final_norm"]) if final_norm and "final_norm" in params else x
  return hidden, (None if aux is None else jnp.moveaxis(aux, 0, 2)), carry


def _check_aux_layers(num_layers: int, aux_layers: tuple[int, ...]) -> None:
  """`MdjaxError` naming the first of `aux_layers` that is not a layer of the model."""
  bad = [layer for layer in aux_layers
         if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers]
  if bad:
    raise MdjaxError(f"aux_layers {aux_layers!r}: {bad[0]!r} is not a layer of this "
                     f"{num_layers}-layer model (0 to {num_layers - 1})")


def _aux_buffer(num_layers: int, x: Float[Array, "B T D"],
                aux_layers: tuple[int, ...]) -> Float[Array, "A B T D"] | None:
  """Zeros for the residual stream after each of `aux_layers` (checked), or None."""
  _check_aux_layers(num_layers, aux_layers)
  return jnp.zeros((len(aux_layers), *x.shape), x.dtype) if aux_layers else None


def _keep(aux: Float[Array, "A B T D"] | None, aux_layers: tuple[int, ...], index,
          x: Float[Array, "B T D"]) -> Float[Array, "A B T D"] | None:
  """`aux` with `x` (the output of layer `index`) at every k where `aux_layers[k] == index`:
  chosen at trace time when `index` is an int, by a select when it is traced (scan)."""
  if aux is None:
    return None
  if isinstance(index, int):
    for k in (k for k, layer in enumerate(aux_layers) if layer == index):
      aux = aux.at[k].set(x)
    return aux
  hit = jnp.asarray(aux_layers, jnp.int32) == index  # [A]
  return jnp.where(hit[:, None, None, None], x[None], aux)


def _layer(config: ModelConfig, lp: Params, x: Float[Array, "B T D"],
           positions: Int[Array, "B T"], attend: Callable, carry, layer, like: int,
           rope_in_attention: bool = False):
  """One decoder layer: `(x, carry)` after it. `layer` is its index, handed to `attend`
  (traced under scan); `like` is the static index of a layer with the same static
  settings (sliding window, score scale, soft-cap, RoPE): itself when unrolled.
  `rope_in_attention`: see `decoder_layers`."""
  # (EAGLE-1's first layer has no attn_norm)
  h, scale = _normed(config, x, lp["attn_norm"]) if "attn_norm" in lp else (x, None)
  spec = layer_attention(config, like)
  if rope_in_attention and _attention_scales(config, lp, scale):  # no row scale yet
    qkv = linear_parts(h, lp["wqkv"], decode_attention.parts(h.shape[-1]))  # [Q, M, (N + 2K) H]
    qkv = qkv.reshape(*qkv.shape[:2], -1, config.head_dim)  # --> [Q, M, N + 2K, H]
    out, carry = attend(qkv, layer, spec, carry, norm_input=x)  # [B, T, N, H]
  elif rope_in_attention:
    qkv = decode_attention.parts_of(*_project_qkv(config, lp, h, scale, positions, like,
                                                     rope=False))
    out, carry = attend(qkv, layer, spec, carry)  # [B, T, N, H]
  else:
    q, k, v = _project_qkv(config, lp, h, scale, positions, like)
    out, carry = attend(q, k, v, layer, spec, carry)  # [B, T, N, H]
  out = linear(out.reshape(*out.shape[:2], -1), lp["wo"])  # --> [B, T, D]
  out = out + lp["bo"] if config.o_bias else out
  if config.gemma_norms:
    out = _norm(config, out, lp["post_attn_norm"])
  x = x + out
  out = _mlp(config, lp, *_normed(config, x, lp["mlp_norm"]))
  if config.gemma_norms:
    out = _norm(config, out, lp["post_mlp_norm"])
  return x + out, carry


def layer_period(config: ModelConfig, num_layers: int) -> int:
  """The smallest P such that every layer i has the static settings of layer i % P
  (sliding window, score scale, soft-cap, RoPE frequencies): 1 when all layers are
  alike (llama), 6 for gemma3's five sliding layers then one full layer."""
  settings = [(layer_attention(config, i), tuple(config.inv_freq(i).tolist()))
              for i in range(num_layers)]
  return next(p for p in range(1, num_layers + 1)
              if all(settings[i] == settings[i % p] for i in range(num_layers)))


def _scanned_layers(config: ModelConfig, layers: Params, x: Float[Array, "B T D"],
                    positions: Int[Array, "B T"], attend: Callable, carry,
                    aux_layers: tuple[int, ...], aux: Float[Array, "A B T D"] | None,
                    rope_in_attention: bool = False):
  """Stacked layers `[L, ...]`: one `lax.scan` over the L // P whole groups of P
  consecutive layers (P = `layer_period`), each group's P layers unrolled with their
  static settings; then the L % P layers after the last whole group, unrolled. The
  compiled program holds P + L % P layers, whatever L. A gemma3 of 26 layers::

      layer   0 ......... 5 | 6 ........ 11 | ... | 18 ....... 23 | 24 25
      kind    s s s s s f   | s s s s s f   | ... | s s s s s f   | s  s
              scan step 0   | step 1        | ... | step 3        | unrolled

  Each layer reads its weights out of the stacked arrays by its index inside the
  loop, never from a `[L // P, P, ...]` view scanned over: when P does not divide L
  that view is a slice, which XLA copies whole, every step (5x slower forward in a
  micro-benchmark); the price is a backward pass that accumulates the weights'
  gradients in the loop (1.6x slower backward there, same result). The cache in
  `carry` is threaded through the loop and written in place, and so is `aux`, the
  residual stream after each of `aux_layers` (`_keep`).
  """
  count = jax.tree.leaves(layers)[0].shape[0]
  period = layer_period(config, count)
  groups = count // period

  def run(x, carry, aux, index, like):
    lp = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, index, keepdims=False), layers)
    x, carry = _layer(config, lp, x, positions, attend, carry, index, like, rope_in_attention)
    return x, carry, _keep(aux, aux_layers, index, x)

  def group(state, g):
    for j in range(period):
      state = run(*state, g * period + j, j)
    return state, None

  state, _ = jax.lax.scan(group, (x, carry, aux), jnp.arange(groups, dtype=jnp.int32))
  for index in range(groups * period, count):
    state = run(*state, index, index)
  return state


def embed(config: ModelConfig, params: Params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
  """The tokens' embeddings; gemma3 scales them by sqrt(D), a float32 rounded to the
  embedding's dtype as transformers does (in bfloat16, sqrt(640) = 25.298 becomes 25.25)."""
  x = constrain(take_rows(params["embed"], tokens), "batch", None, None)  # [B, T, D]
  if config.family != "gemma3":
    return x
  return x * jnp.asarray(np.float32(config.hidden_size**0.5), x.dtype)


def layer_attention(config: ModelConfig, layer: int) -> LayerAttention:
  """`layer`'s static attention settings: its sliding window, score scale, soft-cap."""
  return LayerAttention(sliding_window=config.layer_window(layer), scale=config.attention_scale,
                        softcap=config.attn_logit_softcapping)


@full_float32
def forward(params: Params, cache: KVCache, tokens: Int[Array, "B T"] | None,
            positions: Int[Array, "B T"], segments: Int[Array, "B T"], topology: Topology, *,
            config: ModelConfig, attention: str = "block_sparse", block_size: int = ATTENTION_BLOCK,
            slots: Int[Array, "B T"] | None = None, regions: CacheRegions | None = None,
            inputs: Float[Array, "B T D"] | None = None, aux_layers: tuple[int, ...] = (),
            final_norm: bool = True):
  """Runs the T tokens through every layer over `cache`; returns the final hidden
  states `[B, T, D]` (after the final norm; without `final_norm`, before it: what
  `head_of_residual` takes) and the cache with the T tokens added,
  then, only when `aux_layers` (static) names A layers, the residual stream after
  each of them `[B, T, A, D]` (what EAGLE-3 heads fuse):
  `(hidden, cache)` or `(hidden, cache, aux)`.
  `inputs`, when given, replaces the tokens' embeddings (an EAGLE head feeds its
  fused token-and-feature vectors; MTP heads, the model's hidden states with no
  tokens at all: `tokens` None).

  Tokens with segment -1 are padding: they see nothing, are seen by nothing and
  take no cache slot. The others take the next free slots, or `slots` when given;
  `regions` (see `mdjax.models.attention.cascade_attention`) says the cache is laid
  out in one region per branch and every query sees only the shared part and its own
  (a pass that runs the GPU's few-token kernel, `mdjax.models.decode_attention`, reads
  every filled slot under the mask instead: the same attention, one kernel a layer).
  """
  attention_impl = attention_fn(attention, cache.num_slots, block_size, regions)
  cache, slot = cache_ops.claim_slots(cache, positions, segments, slots)
  meta = dict(positions=positions, segments=segments, slots=slot,
              limit=visibility_limits(topology))
  x = embed(config, params, tokens) if inputs is None else inputs
  if attention == "fused" and decode_attention.applies(config, cache, x.shape[1]):
    hidden, aux, cache = _layers_beside_cache(config, params, x, cache, meta, aux_layers,
                                              final_norm)
    return (hidden, cache) if aux is None else (hidden, cache, aux)

  def attend(q, k, v, index, spec, cache):
    cache = cache_ops.write_layer(cache, index, slot, k, v)
    return attention_impl(Queries(q=q, **meta), cache, index, spec), cache

  hidden, aux, cache = decoder_layers(config, params, x, positions, attend,
                                      constrain_cache(cache), aux_layers, final_norm=final_norm)
  cache = constrain_cache(cache)
  return (hidden, cache) if aux is None else (hidden, cache, aux)


def _layers_beside_cache(config: ModelConfig, params: Params, x: Float[Array, "B T D"],
                         cache: KVCache, meta: dict, aux_layers: tuple[int, ...],
                         final_norm: bool):
  """The decoder layers of a few-token pass on a GPU (`mdjax.models.decode_attention`):
  each layer's attention (RoPE, and the q|k|v product's norm scale and parts' sum when
  they come unapplied) is one kernel over the cache as it was before the pass (this
  pass's slots claimed, their K/V not written yet) and the new tokens beside it, which
  writes their K/V in place; the mask is computed once per pass. Where
  `decode_products.applies`, its products that begin with a norm are kernels too."""
  num_layers, positions = count_layers(params), meta["positions"]
  masks = {window: decode_attention.pass_mask(
      meta["limit"], positions, meta["segments"], meta["slots"], cache.seg, cache.pos,
      window=window) for window in {config.layer_window(i) for i in range(num_layers)}}
  period = layer_period(config, num_layers)
  freqs = np.stack([config.inv_freq(i) for i in range(period)])  # [P, H/2]

  def attend(qkv, index, spec, kv, norm_input=None):  # qkv: [Q, M, N + 2K, H], before RoPE
    stacks, at = zip(*(cache_ops.at_layer(field, index) for field in kv))  # this layer's
    out, *written = decode_attention.attention(qkv, norm_input, positions, freqs, meta["slots"],
        cache.length, at[0], masks[spec.sliding_window], *stacks, scale=spec.scale,
        eps=config.rms_norm_eps, dtype=x.dtype)
    return out, tuple(cache_ops.with_layer(f, index, w) for f, w in zip(kv, written))

  fields = cache.slot_fields()  # k, v (and an int8 cache's scales): the kernel's carry
  if not decode_products.applies(config, params, x.shape[0] * x.shape[1]):
    hidden, aux, kv = decoder_layers(config, params, x, positions, attend, tuple(fields.values()),
                                     aux_layers, rope_in_attention=True, final_norm=final_norm)
    return hidden, aux, cache.replace(**dict(zip(fields, kv)))
  _check_aux_layers(num_layers, aux_layers)
  x, kept, kv = decode_products.layers(config, params, x, lambda qkv, i, kv: attend(
      qkv, i, layer_attention(config, i), kv), tuple(fields.values()), aux_layers)
  hidden = _norm(config, x, params["final_norm"]) if final_norm and "final_norm" in params else x
  aux = jnp.stack([kept[i] for i in aux_layers], axis=2) if aux_layers else None
  return hidden, aux, cache.replace(**dict(zip(fields, kv)))


@full_float32
def forward_causal(params: Params, tokens: Int[Array, "B T"] | None, *, config: ModelConfig,
                   inputs: Float[Array, "B T D"] | None = None, aux_layers: tuple[int, ...] = ()
                   ) -> Float[Array, "B T D"] | tuple[Float[Array, "B T D"],
                                                      Float[Array, "B T A D"]]:
  """Plain causal forward of whole sequences without a cache (training, evaluation);
  `tokens`, `inputs` and `aux_layers` as in `forward`: the final hidden states, or
  `(hidden, aux)` when `aux_layers` names layers.

  Every row is one segment at positions 0..T-1; the same layers and visibility rule
  as `forward` over an empty cache, minus the cache writes, so it is differentiable.
  """
  b, t = (tokens if inputs is None else inputs).shape[:2]
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
  segments = jnp.zeros((b, t), jnp.int32)  # [B, T]
  limits = visibility_limits(Topology.causal(b))
  masks = {window: visible(limits, segments, positions, segments, positions, window)
           for window in {config.layer_window(i) for i in range(config.num_layers)}}  # [B, T, T]

  def attend(q, k, v, index, spec, carry):  # no cache: the keys are the sequence itself
    return masked_attention(q, k, v, masks[spec.sliding_window], scale=spec.scale,
                            softcap=spec.softcap), carry

  x = embed(config, params, tokens) if inputs is None else inputs
  hidden, aux, _ = decoder_layers(config, params, x, positions, attend, None, aux_layers)
  return hidden if aux is None else (hidden, aux)


def causal_logits(params: Params, tokens: Int[Array, "B T"], *,
                  config: ModelConfig) -> Float[Array, "B T V"]:
  """Next-token logits (float32) at every position of whole sequences: `forward_causal`
  then `lm_head`."""
  return lm_head(params, forward_causal(params, tokens, config=config), config=config)


@full_float32
def lm_head(params: Params, hidden: Float[Array, "... D"], *, config: ModelConfig,
            scale: Float[Array, "... 1"] | None = None) -> Float[Array, "... V"]:
  """Logits in float32 (times each row's `scale` when given: an `_normed` input),
  soft-capped when the config says so; the tied head reuses the (unscaled) embedding. A
  vocabulary padded for a mesh (`mdjax.sharding`) is cut back to `vocab_size`."""
  embed = params["embed"]
  # a tied bfloat16 or quantized embedding is contracted in place (XLA:CPU's `E.T @` is 10x
  # slower: see `linear`); float32 keeps `E.T`, so an untied copy gives the same logits
  if "lm_head" in params:
    logits = linear(hidden, params["lm_head"], jnp.float32)
  else:
    transposed = embed.dtype == jnp.bfloat16 or is_quantized(embed)
    logits = linear(hidden, embed if transposed else embed.T, jnp.float32, transposed=transposed)
  logits = logits if scale is None else logits * scale
  logits = logits[..., :config.vocab_size]
  cap = config.final_logit_softcapping
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def head_of_residual(params: Params, x: Float[Array, "B T D"], *, config: ModelConfig,
                     logits_at: Int[Array, "B R"] | None = None
                     ) -> tuple[Float[Array, "B R V"], Float[Array, "B T D"]]:
  """`(logits, hidden)` from the residual stream after the last layer (`forward`
  without `final_norm`): the logits of the rows `logits_at` (every row when None) and
  the final-norm hidden states.

  On a GPU, logits of one row take the final norm as the layers' products take theirs
  (`_normed`): `x * weight` into the unembedding and the row scale on its float32
  output; XLA:GPU then runs the norm as one reduction (with `x * weight`) and no
  multiply of its own (the same logits up to rounding; `hidden`, a multiply, only when
  read). Compiled for an H200 at 8 rows it fuses neither, while the plain norm is one
  kernel there: more rows take the norm, then the head."""
  weight = params.get("final_norm")
  rows = x.shape[0] * (x.shape[1] if logits_at is None else logits_at.shape[1])
  if platform.current() == "gpu" and weight is not None and rows == 1:
    normed, scale = _normed(config, x, weight)
    logits = lm_head(params, _rows_at(normed, logits_at), config=config,
                     scale=_rows_at(scale, logits_at))
    return logits, _norm(config, x, weight)
  hidden = x if weight is None else _norm(config, x, weight)
  if platform.current() == "gpu":  # the head reads the hidden states returned: XLA:GPU
    hidden = jax.lax.optimization_barrier(hidden)  # would compute the final norm twice
  return lm_head(params, _rows_at(hidden, logits_at), config=config), hidden


def _rows_at(x: Float[Array, "B T F"], at: Int[Array, "B R"] | None) -> Float[Array, "B R F"]:
  """The rows `at` of each batch row of `x` (all of them when None)."""
  return x if at is None else jnp.take_along_axis(x, at[..., None], axis=1)
