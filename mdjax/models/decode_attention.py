"""Attention of a few new tokens over one layer of the cache in one GPU kernel (Pallas,
lowered to Triton), for passes of at most `MAX_TOKENS` tokens (a decoded token, a
draft chain, a small tree) under the "fused" attention on a GPU: what a layer does
between its q|k|v product and its output product is this one kernel.

The cache is read as it was before the pass, and only up to each row's length; the T
new tokens' K/V come in beside it (from the product, RoPE and the attention norm's
row scale applied in the kernel) and go out for `mdjax.cache.write_layers`, which
writes every layer's at once after the last layer::

    program (row b, kv head k, new token t):
      q   [Rt, H]   t's R query heads of kv head k (rows past R masked), scaled, RoPE'd
      walk          cache blocks of `BLOCK` slots of layer l, 0 .. length[b]
                    (masks.cache [b, t, block]: what the topology lets t see)
      then          the T new keys of head k [P, H] (masks.new [b, t, :])
      out           online softmax, [Rt, H] -> out[b, t, k R .. k R + R]
    programs of t = 0: the T new keys and values of head k -> k_out, v_out [b, :, k]

The masks (`PassMasks`) are computed once per pass; slots the pass writes are
invisible in the cache part (the new tokens' block shows what lands there). Queries
that see nothing give 0. Off a GPU, `reference` computes the same with jnp.

Einsum letters as in `mdjax.models.attention`: B batch, T new tokens (P: padded to a
Triton tile), S slots, K kv heads, R query heads per kv head (N = K R; Rt: R padded),
H head dim, L layers, D model width.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from mdjax import platform
from mdjax.models.attention import masked_attention
from mdjax.topology import visible

MAX_TOKENS = 16  # tokens per pass up to which `decode_attention` replaces the fused product
BLOCK = 128  # cache slots per step of the kernel's walk
TILE = 16  # the smallest side of a Triton product


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PassMasks:
  """What every layer's kernel reads besides its projections: the same for all layers
  of a pass (one per sliding window).

  cache: int8[B, T, S]  token t sees cache slot s (the slots this pass writes: never)
  new:   int8[B, T, P]  token t sees new token p (p < T; padding sees nothing)
  blocks: int32[B]      cache blocks of `BLOCK` slots the row's walk visits
  """

  cache: Int[Array, "B T S"]
  new: Int[Array, "B T P"]
  blocks: Int[Array, "B"]


def fits(tokens: int, num_slots: int, head_dim: int) -> bool:
  """Whether a pass of `tokens` over `num_slots` slots can run the kernel: few tokens,
  slots in whole blocks, a head dim Triton tiles (a power of two of at least 32: each
  RoPE half is a product's side)."""
  return (tokens <= MAX_TOKENS and num_slots >= TILE and num_slots % min(BLOCK, num_slots) == 0
          and head_dim >= 2 * TILE and head_dim & (head_dim - 1) == 0)


def _tile(n: int) -> int:
  """`n` rounded up to a power of two of at least `TILE`."""
  return max(TILE, 1 << (n - 1).bit_length())


def pass_masks(limit: Int[Array, "B G G"], positions: Int[Array, "B T"],
               segments: Int[Array, "B T"], slots: Int[Array, "B T"], seg: Int[Array, "B S"],
               pos: Int[Array, "B S"], length: Int[Array, "B"], *,
               window: int | None) -> PassMasks:
  """The masks of a pass whose T tokens (`positions`, `segments`) go to `slots` (past
  the end: dropped); `seg`, `pos` are the cache's slots with this pass's already
  claimed, `length` the rows' lengths before it."""
  t = segments.shape[1]
  num_slots = seg.shape[1]
  written = (slots[:, :, None] == jnp.arange(num_slots)).any(1)  # [B, S]
  cache = visible(limit, segments, positions, seg, pos, window) & ~written[:, None]  # [B, T, S]
  kept = (segments >= 0) & (slots < num_slots)  # [B, T]: the new tokens the cache will hold
  new = visible(limit, segments, positions, segments, positions, window) & kept[:, None]
  new = jnp.pad(new, ((0, 0), (0, 0), (0, _tile(t) - t)))  # [B, T, P]
  block = min(BLOCK, num_slots)
  return PassMasks(cache=cache.astype(jnp.int8), new=new.astype(jnp.int8),
                   blocks=((length + block - 1) // block).astype(jnp.int32))


def _row_scales(rows_ref, b, tokens: int, size: int, eps: float | None):
  """1 / rms of each token's residual row `rows_ref[b, t]` ([D]) as a [size] vector
  (entries past T: 1); all 1 when `eps` is None (the projections came in scaled)."""
  scales = jnp.ones((size,), jnp.float32)
  if eps is None:
    return scales
  width = rows_ref.shape[2]
  padded = _tile(width)
  for t in range(tokens):
    row = plgpu.load(rows_ref.at[b, jnp.int32(t), pl.ds(0, padded)],
                     mask=jnp.arange(padded) < width, other=0).astype(jnp.float32)
    scales = jnp.where(jnp.arange(size) == t, jax.lax.rsqrt((row * row).sum() / width + eps),
                       scales)
  return scales


def _kernel(qkv_ref, rows_ref, cos_ref, sin_ref, k_ref, v_ref, mask_ref, mask_new_ref, blocks_ref,
            layer_ref, out_ref, k_out_ref, v_out_ref, *, tokens: int, group: int, block: int,
            scale: float, eps: float | None, precision):
  """One (row b, kv head k, token t) program: t's R query heads, a tile of rows [Rt, H]
  (rows past R masked), attend over the row's filled cache blocks of layer
  `layer_ref[0]`, then over the T new keys [P, H]; an online softmax. The projections
  are multiplied by their token's norm scale (`_row_scales`) and rounded to the cache's
  dtype, then RoPE'd by halves (rotate_half: x1 cos - x2 sin | x2 cos + x1 sin); the
  programs of token 0 also write the new keys and values out, for the cache."""
  b, head, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = layer_ref[0]
  num_q = out_ref.shape[2]
  half = out_ref.shape[3] // 2
  num_kv = k_ref.shape[3]
  rows = _tile(group)
  keys_new = mask_new_ref.shape[2]
  row_ok = (jnp.arange(rows) < group)[:, None]  # [Rt, 1]
  token_ok = (jnp.arange(keys_new) < tokens)[:, None]  # [P, 1]
  lo, hi, whole = pl.ds(0, half), pl.ds(half, half), pl.ds(0, 2 * half)
  dtype = k_ref.dtype
  by = _row_scales(rows_ref, b, tokens, keys_new, eps)  # [P]

  def rotated(first, second, cos, sin):  # halves [X, H/2], as the cache holds them -> RoPE'd
    first, second = first.astype(jnp.float32), second.astype(jnp.float32)
    return (first * cos - second * sin).astype(dtype), (second * cos + first * sin).astype(dtype)

  mine = jnp.where(jnp.arange(keys_new) == t, by, 0).sum()  # this token's scale
  query = lambda part: (plgpu.load(qkv_ref.at[b, t, pl.ds(head * group, rows), part],
                                   mask=row_ok, other=0).astype(jnp.float32) * mine).astype(dtype)
  cos, sin = (table[b, t, :][None, :] for table in (cos_ref, sin_ref))  # [1, H/2]
  q1, q2 = rotated(query(lo), query(hi), cos, sin)  # [Rt, H/2] x2

  def absorb(carry, keys, values, mask):  # halves [X, H/2] x2, [X, H], [X]
    peak, total, acc = carry  # [Rt], [Rt], [Rt, H]
    scores = (plgpu.dot(q1, keys[0], trans_b=True, precision=precision)
              + plgpu.dot(q2, keys[1], trans_b=True, precision=precision)) * scale  # [Rt, X]
    scores = jnp.where(mask[None, :] != 0, scores, -jnp.inf)
    new_peak = jnp.maximum(peak, scores.max(axis=1))
    base = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)
    rescale = jnp.exp(peak - base)
    weights = jnp.exp(scores - base[:, None])  # [Rt, X]
    weighed = plgpu.dot(weights.astype(values.dtype), values, precision=precision)  # [Rt, H]
    return new_peak, total * rescale + weights.sum(axis=1), acc * rescale[:, None] + weighed

  def visit(index, carry):
    window = pl.ds(pl.multiple_of(index * block, block), block)
    keys = (k_ref[layer, b, window, head, lo], k_ref[layer, b, window, head, hi])
    return absorb(carry, keys, v_ref[layer, b, window, head, :], mask_ref[b, t, window])

  empty = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, 2 * half), jnp.float32))
  carry = jax.lax.fori_loop(0, blocks_ref[b], visit, empty)
  tokens_at = lambda ref, column, part: ref.at[b, pl.ds(0, keys_new), column, part]  # [P, X]
  new = lambda column, part: (plgpu.load(tokens_at(qkv_ref, column, part), mask=token_ok,
                                         other=0).astype(jnp.float32) * by[:, None]).astype(dtype)
  angle = lambda table: plgpu.load(table.at[b, pl.ds(0, keys_new), :], mask=token_ok, other=0)
  keys = rotated(new(num_q + head, lo), new(num_q + head, hi), angle(cos_ref), angle(sin_ref))
  values = new(num_q + num_kv + head, whole)  # [P, H]
  _, total, acc = absorb(carry, keys, values, mask_new_ref[b, t, :])
  out = acc / jnp.where(total > 0, total, 1.0)[:, None]
  plgpu.store(out_ref.at[b, t, pl.ds(head * group, rows), :], out.astype(out_ref.dtype),
              mask=row_ok)

  @pl.when(t == 0)
  def _():
    for key, part in zip(keys, (lo, hi)):
      plgpu.store(tokens_at(k_out_ref, head, part), key, mask=token_ok)
    plgpu.store(tokens_at(v_out_ref, head, whole), values, mask=token_ok)


def decode_attention(qkv: Float[Array, "B T N+2K H"], rows: Float[Array, "B T D"] | None,
                     cos: Float[Array, "B T H/2"], sin: Float[Array, "B T H/2"],
                     cache_k: Float[Array, "L B S K H"], cache_v: Float[Array, "L B S K H"],
                     layer, masks: PassMasks, *, scale: float, eps: float | None = None,
                     interpret: bool = False):
  """The new tokens' attention over layer `layer` (an int, or a traced int32 scalar) of
  the cache before this pass and over themselves: `(out [B, T, N, H], k, v [B, T, K, H])`,
  `k` and `v` the new tokens' as the cache will hold them.

  `qkv` holds each token's query heads, then its K keys, then its K values, before RoPE;
  with `eps`, also before the RMSNorm's row scale, which the kernel takes from the
  residual `rows` (`mdjax.models.transformer._normed`). `cos`, `sin` are the tokens'
  RoPE angles (one half: rotate_half repeats them)."""
  b, t, heads, h = qkv.shape
  num_kv = cache_k.shape[3]
  num_q = heads - 2 * num_kv
  dtype = cache_k.dtype
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  kernel = functools.partial(_kernel, tokens=t, group=num_q // num_kv,
                             block=min(BLOCK, cache_k.shape[2]), scale=scale,
                             eps=None if rows is None else eps, precision=precision)
  whole = pl.BlockSpec()  # the whole array: each program indexes its part
  new = jax.ShapeDtypeStruct((b, t, num_kv, h), dtype)
  return pl.pallas_call(
      kernel, grid=(b, num_kv, t), in_specs=[whole] * 10, out_specs=[whole] * 3,
      out_shape=[jax.ShapeDtypeStruct((b, t, num_q, h), dtype), new, new],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="mdjax_decode_attention",
  )(qkv, jnp.zeros((b, t, 1), dtype) if rows is None else rows, cos, sin, cache_k, cache_v,
    masks.cache, masks.new, masks.blocks, jnp.asarray(layer, jnp.int32).reshape(1))


def rope(x: Float[Array, "... X H"], cos: Float[Array, "... H/2"],
         sin: Float[Array, "... H/2"]) -> Float[Array, "... X H"]:
  """RoPE by halves (the kernel's): `mdjax.models.transformer.apply_rope` up to rounding."""
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos[..., None, :], sin[..., None, :]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin],
                         axis=-1).astype(x.dtype)


def reference(qkv: Float[Array, "B T N+2K H"], rows: Float[Array, "B T D"] | None,
              cos: Float[Array, "B T H/2"], sin: Float[Array, "B T H/2"],
              cache_k: Float[Array, "L B S K H"], cache_v: Float[Array, "L B S K H"], layer,
              masks: PassMasks, *, scale: float, eps: float | None = None):
  """What `decode_attention` computes, as one masked softmax over the cache's slots
  followed by the new tokens (any platform: the kernel's stand-in off a GPU)."""
  t, num_kv = qkv.shape[1], cache_k.shape[3]
  dtype = cache_k.dtype
  by = 1.0
  if rows is not None and eps is not None:
    rows32 = rows.astype(jnp.float32)
    by = jax.lax.rsqrt(jnp.mean(rows32 * rows32, axis=-1) + eps)[..., None, None]  # [B, T, 1, 1]
  qkv = (qkv.astype(jnp.float32) * by).astype(dtype)
  q, k, v = jnp.split(qkv, [qkv.shape[2] - 2 * num_kv, qkv.shape[2] - num_kv], axis=2)
  k = rope(k, cos, sin)
  keys = jnp.concatenate([cache_k[layer], k], axis=1)  # [B, S + T, K, H]
  values = jnp.concatenate([cache_v[layer], v], axis=1)
  mask = jnp.concatenate([masks.cache, masks.new[..., :t]], axis=2) != 0  # [B, T, S + T]
  return masked_attention(rope(q, cos, sin), keys, values, mask, scale=scale), k, v


def attention(qkv, rows, cos, sin, cache_k, cache_v, layer, masks: PassMasks, *, scale: float,
              eps: float | None = None):
  """`decode_attention` where the program is lowered for an NVIDIA GPU, `reference`
  elsewhere (a program built for a GPU but run on this host: the tests)."""
  static = dict(scale=scale, eps=eps)
  return jax.lax.platform_dependent(
      qkv, rows, cos, sin, cache_k, cache_v, layer, masks,
      cuda=functools.partial(decode_attention, **static),
      default=functools.partial(reference, **static))


def applies(config, cache, tokens: int) -> bool:
  """Whether a pass of `tokens` tokens over `cache` runs `attention` (else the fused
  product): built for a GPU, on one device (no layout mesh), no soft-capped scores, and
  shapes the kernel tiles (`fits`)."""
  return (platform.current() == "gpu" and jax.sharding.get_abstract_mesh().empty
          and config.attn_logit_softcapping is None
          and fits(tokens, cache.num_slots, config.head_dim))
