"""Attention of a few new tokens over one layer of the cache in one GPU kernel (Pallas,
lowered to Triton), for passes of at most `MAX_TOKENS` tokens (a decoded token, a
draft chain, a small tree) under the "fused" attention on a GPU: what a layer does
between its q|k|v product and its output product is this one kernel.

The kernel takes the q|k|v product as its partial sums over slices of D (`parts`,
`mdjax.models.numerics.linear_parts`: what XLA:GPU's split-K product writes) and adds
them itself, applies the attention norm's row scale and RoPE (angles from the tokens'
positions), reads the cache as it was before the pass, and only up to each row's
length, with the T new tokens beside it, and writes the new tokens' K/V into their
slots of this layer in place (the cache arrays are its outputs, aliased)::

    program (row b, kv head k, new token t):
      q   [Rt, H]   t's R query heads of kv head k (rows past R masked), scaled, RoPE'd
      walk          cache blocks of `BLOCK` slots of layer l, 0 .. length[b]
                    (mask [b, t, block]: what the topology lets t see)
      then          the T new keys of head k [P, H] (mask [b, t, S:])
      out           online softmax, [Rt, H] -> out[b, t, k R .. k R + R]
      write         t's key and value of head k -> cache k, v [l, b, slot[b, t], k]

An int8 cache (`mdjax.cache.quantize_kv`) comes as four arrays, and the kernel reads
and writes each slot's values with their scale, computing in the model's dtype::

      walk          k, v int8 [BLOCK, H] x k_scale, v_scale [BLOCK] -> [BLOCK, H]
      then          the new keys and values quantized and dequantized [P, H]: what
                    the cache gives back (what XLA's attention reads after its write)
      write         t's key and value quantized -> k, v int8 [l, b, slot[b, t], k, :],
                    their scales -> k_scale, v_scale [l, b, slot[b, t], k]

The mask (`pass_mask`) is computed once per pass; slots the pass writes are invisible
in the cache part (the new tokens' part shows what lands there), so a program that
reads a slot another program writes ignores it. Queries that see nothing give 0. Off a
GPU, `reference` computes the same with jnp.

Einsum letters as in `mdjax.models.attention`: B batch, T new tokens (P: padded to a
Triton tile), S slots, K kv heads, R query heads per kv head (N = K R; Rt: R padded),
H head dim, L layers, D model width, Q the product's parts, M its rows. `cache`: the
cache's `(k, v)` `[L, B, S, K, H]`, or an int8 cache's `(k, v, k_scale, v_scale)`
(`mdjax.cache.KVCache.slot_fields`; a per-layer cache's layer as a stack of one:
`mdjax.cache.at_layer`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from mdjax import platform
from mdjax.cache import KV_STEP, KVCache, read_kv, write_layer
from mdjax.models.attention import masked_attention
from mdjax.models.rope import apply_rope
from mdjax.topology import visible

MAX_TOKENS = 32  # tokens per pass up to which `decode_attention` replaces the fused product
KERNEL_NAME = "mdjax_decode_attention"  # the kernel's name in a compiled program (op_name)
#                 (a tree of 16 nodes and its root, lookahead's 24; checked against its
#                 reference at 24 tokens, and compiled for an H200, not timed on one)
BLOCK = 128  # cache slots per step of the kernel's walk
TILE = 16  # the smallest side of a Triton product
PARTS = 4  # the q|k|v product's parts: compiled for an H200, XLA:GPU splits q|k|v-shaped
#            products (F > D) in K in 4, at widths 576 to 4,096 and 8 to 128 rows (from 2,048
#            wide, 2 rows too)


def fits(tokens: int, num_slots: int, head_dim: int) -> bool:
  """Whether a pass of `tokens` over `num_slots` slots can run the kernel: few tokens,
  slots in whole blocks of a power of two (Triton's tiles: a cache of 96 slots is one
  block of 96, which Triton cannot lower), a head dim Triton tiles (a power of two of at
  least 32: each RoPE half is a product's side)."""
  block = min(BLOCK, num_slots)
  return (tokens <= MAX_TOKENS and num_slots >= TILE and num_slots % block == 0
          and block & (block - 1) == 0 and head_dim >= 2 * TILE and head_dim & (head_dim - 1) == 0)


def parts(width: int) -> int:
  """How many parts (`PARTS`, or 1) the q|k|v product of a model `width` wide comes in."""
  return PARTS if width % (PARTS * TILE) == 0 else 1


def parts_of(q: Float[Array, "B T N H"], k: Float[Array, "B T K H"],
             v: Float[Array, "B T K H"]) -> Float[Array, "1 M N+2K H"]:
  """Projections computed apart, as the kernel takes a q|k|v product: one part, M = B T."""
  qkv = jnp.concatenate([q, k, v], axis=2)  # [B, T, N + 2K, H]
  return qkv.reshape(1, -1, *qkv.shape[2:])


def tile(n: int) -> int:
  """`n` rounded up to a power of two of at least `TILE`."""
  return max(TILE, 1 << (n - 1).bit_length())


def pass_mask(limit: Int[Array, "B G G"], positions: Int[Array, "B T"],
              segments: Int[Array, "B T"], slots: Int[Array, "B T"], seg: Int[Array, "B S"],
              pos: Int[Array, "B S"], *, window: int | None) -> Int[Array, "B T S+P"]:
  """What each of a pass's T tokens (`positions`, `segments`, going to `slots`: past the
  end, dropped) sees: int8 `[B, T, S + P]`, the cache's S slots (`seg`, `pos`, with this
  pass's slots claimed; those, never), then the P new tokens (p < T; padding sees
  nothing). The same for every layer of a pass (one per sliding window)."""
  t = segments.shape[1]
  num_slots = seg.shape[1]
  written = (slots[:, :, None] == jnp.arange(num_slots)).any(1)  # [B, S]
  cache = visible(limit, segments, positions, seg, pos, window) & ~written[:, None]  # [B, T, S]
  kept = (segments >= 0) & (slots < num_slots)  # [B, T]: the new tokens the cache will hold
  new = visible(limit, segments, positions, segments, positions, window) & kept[:, None]
  padding = jnp.zeros((*new.shape[:2], tile(t) - t), jnp.bool_)
  return jnp.concatenate([cache, new, padding], axis=2).astype(jnp.int8)  # [B, T, S + P]


def _row_scales(rows_ref, b, tokens: int, size: int, eps: float | None):
  """1 / rms of each token's residual row `rows_ref[b, t]` ([D]) as a [size] vector
  (entries past T: 1); all 1 when `eps` is None (the projections came in scaled)."""
  scales = jnp.ones((size,), jnp.float32)
  if eps is None:
    return scales
  width = rows_ref.shape[2]
  padded = tile(width)
  for t in range(tokens):
    row = plgpu.load(rows_ref.at[b, jnp.int32(t), pl.ds(0, padded)],
                     mask=jnp.arange(padded) < width, other=0).astype(jnp.float32)
    scales = jnp.where(jnp.arange(size) == t, jax.lax.rsqrt((row * row).sum() / width + eps),
                       scales)
  return scales


def _rounded_quotient(x: Float[Array, "..."], y: Float[Array, "..."],
                      interpret: bool) -> Float[Array, "..."]:
  """round(x / y), ties to even, in float32, as XLA computes `quantize_kv`'s: on a GPU by
  PTX (Triton divides approximately, `div.full.f32`, and has no rounding op; `div.rn` is
  XLA:GPU's IEEE division); interpreted, jnp's (XLA:CPU multiplies by 1 / y)."""
  y = jnp.broadcast_to(y, x.shape)
  if interpret:
    return jnp.round(x / y)
  [out] = plgpu.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;\n\tcvt.rni.f32.f32 $0, $0;", args=[x, y], constraints="=f,f,f",
      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return out


def _quantized(parts, interpret: bool):
  """`mdjax.cache.quantize_kv` of keys or values that come as `parts` along H (halves, or
  whole), `[..., X]` each: the int8 values as float32 parts, and the scales `[...]`."""
  parts = [part.astype(jnp.float32) for part in parts]
  peak = functools.reduce(jnp.maximum, [jnp.abs(part).max(axis=-1) for part in parts])
  scale = peak * (1 / KV_STEP)  # max / 127 as XLA computes it (by the constant's inverse)
  safe = jnp.where(scale == 0, 1.0, scale)[..., None]
  return [_rounded_quotient(part, safe, interpret) for part in parts], scale


def _kernel(qkv_ref, rows_ref, positions_ref, freqs_ref, slot_ref, length_ref, layer_ref,
            mask_ref, *refs, tokens: int, group: int, block: int, scale: float,
            eps: float | None, dtype, precision, interpret: bool):
  """One (row b, kv head k, token t) program: t's R query heads, a tile of rows [Rt, H]
  (rows past R masked), attend over the row's filled cache blocks of layer
  `layer_ref[0]`, then over the T new keys [P, H]; an online softmax. The projections
  are the sum of the product's parts, multiplied by their token's norm scale
  (`_row_scales`) and rounded to `dtype`, then RoPE'd by halves as
  `mdjax.models.rope.apply_rope` does; t's own key and value go to its slot. `refs`: the
  cache's arrays (`cache`), `out_ref`, then the same arrays again as outputs (aliased)."""
  count = (len(refs) - 1) // 2
  cache, out_ref, cache_out = refs[:count], refs[count], refs[count + 1:]
  k_ref, v_ref, k_scale_ref, v_scale_ref = (*cache, None, None)[:4]
  k_out_ref, v_out_ref, k_scale_out_ref, v_scale_out_ref = (*cache_out, None, None)[:4]
  b, head, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = layer_ref[0]
  num_q = out_ref.shape[2]
  half = out_ref.shape[3] // 2
  num_slots, num_kv = k_ref.shape[2], k_ref.shape[3]
  rows = tile(group)
  keys_new = mask_ref.shape[2] - num_slots
  row_ok = (jnp.arange(rows) < group)[:, None]  # [Rt, 1]
  token_ok = jnp.arange(keys_new) < tokens  # [P]
  lo, hi, whole = pl.ds(0, half), pl.ds(half, half), pl.ds(0, 2 * half)
  by = _row_scales(rows_ref, b, tokens, keys_new, eps)  # [P]
  mine = jnp.where(jnp.arange(keys_new) == t, by, 0).sum()  # this token's scale
  freqs = freqs_ref[jax.lax.rem(layer, freqs_ref.shape[0]), :]  # [H/2]

  def summed(at, mask=None):  # the parts' sum, float32: `at(part)` a view of qkv_ref
    masked = {} if mask is None else dict(mask=mask, other=0)
    load = lambda part: plgpu.load(at(jnp.int32(part)), **masked)
    total = load(0).astype(jnp.float32)
    for part in range(1, qkv_ref.shape[0]):
      total = total + load(part).astype(jnp.float32)
    return total

  def rotated(first, second, angles):  # halves [..., H/2] in `dtype` -> RoPE'd
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = first.astype(jnp.float32), second.astype(jnp.float32)
    return (first * cos - second * sin).astype(dtype), (second * cos + first * sin).astype(dtype)

  def cached(ref, scale_ref, window, columns):  # slots `window` of head `head`: [X, ...] each
    at = (layer, b, window, head)
    if scale_ref is None:
      return tuple(ref[(*at, column)] for column in columns)
    scales = scale_ref[at][:, None]  # [X, 1]
    return tuple((ref[(*at, column)].astype(jnp.float32) * scales).astype(dtype)
                 for column in columns)

  def read_back(parts, scale_ref):  # the new tokens' [P, X] parts as the cache gives them back
    if scale_ref is None:
      return parts
    ints, scales = _quantized(parts, interpret)
    return tuple((part * scales[:, None]).astype(dtype) for part in ints)

  row = b * tokens + t  # t's row of the product
  angles = positions_ref[b, t].astype(jnp.float32) * freqs  # [H/2]
  query = lambda part: (summed(lambda p: qkv_ref.at[p, row, pl.ds(head * group, rows), part],
                               row_ok) * mine).astype(dtype)  # [Rt, H/2]
  q1, q2 = rotated(query(lo), query(hi), angles[None, :])  # [Rt, H/2] x2

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
    [values] = cached(v_ref, v_scale_ref, window, (whole,))
    return absorb(carry, cached(k_ref, k_scale_ref, window, (lo, hi)), values,
                  mask_ref[b, t, window])

  empty = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, 2 * half), jnp.float32))
  filled = jax.lax.div(length_ref[b] + block - 1, block)  # cache blocks the row has filled
  carry = jax.lax.fori_loop(0, filled, visit, empty)
  new = lambda column, part: (summed(
      lambda p: qkv_ref.at[p, pl.ds(b * tokens, keys_new), column, part], token_ok[:, None])
      * by[:, None]).astype(dtype)  # [P, X]
  new_positions = plgpu.load(positions_ref.at[b, pl.ds(0, keys_new)], mask=token_ok, other=0)
  keys = read_back(rotated(new(num_q + head, lo), new(num_q + head, hi),
                           new_positions.astype(jnp.float32)[:, None] * freqs[None, :]),
                   k_scale_ref)  # [P, H/2] x2
  [values] = read_back((new(num_q + num_kv + head, whole),), v_scale_ref)  # [P, H]
  _, total, acc = absorb(carry, keys, values, mask_ref[b, t, pl.ds(num_slots, keys_new)])
  out = acc / jnp.where(total > 0, total, 1.0)[:, None]
  plgpu.store(out_ref.at[b, t, pl.ds(head * group, rows), :], out.astype(out_ref.dtype),
              mask=row_ok)

  slot = slot_ref[b, t]
  slot = jnp.where(slot < 0, slot + num_slots, slot)  # as jnp's indexing reads it

  def write(ref, scale_ref, parts, columns):  # t's key or value of head `head` -> its slot
    if scale_ref is not None:
      parts, step = _quantized(parts, interpret)
      plgpu.store(scale_ref.at[layer, b, slot, head], step)
    for part, column in zip(parts, columns):
      plgpu.store(ref.at[layer, b, slot, head, column], part.astype(ref.dtype))

  @pl.when((slot >= 0) & (slot < num_slots))  # else dropped: padding, or past the end
  def _():
    own = lambda column, part: (summed(lambda p: qkv_ref.at[p, row, column, part])
                                * mine).astype(dtype)  # [X]
    write(k_out_ref, k_scale_out_ref,
          rotated(own(num_q + head, lo), own(num_q + head, hi), angles), (lo, hi))
    write(v_out_ref, v_scale_out_ref, (own(num_q + num_kv + head, whole),), (whole,))


def _dtype(cache_k: Array, dtype) -> jnp.dtype:
  """What the kernel computes in: a float cache's dtype, an int8 one's `dtype`."""
  if cache_k.dtype != jnp.int8:
    return cache_k.dtype
  if dtype is None:
    raise ValueError("the attention over an int8 cache needs the model's dtype")
  return jnp.dtype(dtype)


def decode_attention(qkv: Float[Array, "Q M N+2K H"], rows: Float[Array, "B T D"] | None,
                     positions: Int[Array, "B T"], freqs: Float[Array, "F H/2"],
                     slot: Int[Array, "B T"], length: Int[Array, "B"], layer,
                     mask: Int[Array, "B T S+P"], *cache: Array, scale: float,
                     eps: float | None = None, dtype=None, interpret: bool = False):
  """The new tokens' attention over layer `layer` (an int, or a traced int32 scalar) of
  the cache before this pass and over themselves: `(out [B, T, N, H], *cache)`, the
  cache with the new tokens' K/V (and an int8 cache's scales) written into layer `layer`
  at `slot` (in place: donate the cache; a slot past the end writes nothing).

  `qkv`: Q parts of the q|k|v product (their sum is the product; row b T + t is token
  t of row b), each row the token's query heads, then its K keys, then its K values,
  before RoPE; with `eps`, also before the RMSNorm's row scale, which the kernel takes
  from the residual `rows` (`mdjax.models.transformer._normed`). RoPE's angles are
  `positions` times `freqs[layer % F]` (F tables: one per layer of a period, as
  `mdjax.models.transformer.layer_period`); `length`: the rows' lengths (the walk's end:
  before the pass or after it, as the slots it writes are masked); `mask`: `pass_mask`;
  `dtype`: an int8 cache's, the model's (what XLA's path rounds the projections to and
  computes in; a float cache's kernel computes in the cache's dtype)."""
  b, t = positions.shape
  num_kv, h = cache[0].shape[3], cache[0].shape[4]
  num_q = qkv.shape[2] - 2 * num_kv
  dtype = _dtype(cache[0], dtype)
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  kernel = functools.partial(_kernel, tokens=t, group=num_q // num_kv,
                             block=min(BLOCK, cache[0].shape[2]), scale=scale,
                             eps=None if rows is None else eps, dtype=dtype,
                             precision=precision, interpret=interpret)
  whole = pl.BlockSpec()  # the whole array: each program indexes its part
  return pl.pallas_call(
      kernel, grid=(b, num_kv, t), in_specs=[whole] * (8 + len(cache)),
      out_specs=[whole] * (1 + len(cache)),
      out_shape=[jax.ShapeDtypeStruct((b, t, num_q, h), dtype),
                 *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in cache)],
      input_output_aliases={8 + i: 1 + i for i in range(len(cache))},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name=KERNEL_NAME,
  )(qkv, qkv if rows is None else rows,  # no rows: never read (qkv stands in, not a kernel
    positions, jnp.asarray(freqs, jnp.float32), slot, length,  # writing zeros)
    jnp.asarray(layer, jnp.int32).reshape(1), mask, *cache)


def reference(qkv: Float[Array, "Q M N+2K H"], rows: Float[Array, "B T D"] | None,
              positions: Int[Array, "B T"], freqs: Float[Array, "F H/2"],
              slot: Int[Array, "B T"], length: Int[Array, "B"], layer,
              mask: Int[Array, "B T S+P"], *cache: Array, scale: float,
              eps: float | None = None, dtype=None):
  """What `decode_attention` computes, as XLA's path does it: the new K/V written by
  `mdjax.cache.write_layer`, then one masked softmax over the cache's slots before the
  pass followed by the new tokens as the cache gives them back (`read_kv`) (any
  platform: the kernel's stand-in off a GPU). `length` is not needed: slots past it
  are never visible."""
  del length
  b, t = positions.shape
  num_slots, num_kv = cache[0].shape[2], cache[0].shape[3]
  dtype = _dtype(cache[0], dtype)
  qkv = jnp.sum(qkv.astype(jnp.float32), axis=0)[:b * t]  # [B T, N + 2K, H]
  qkv = qkv.reshape(b, t, *qkv.shape[1:])  # --> [B, T, N + 2K, H]
  if rows is not None and eps is not None:
    rows32 = rows.astype(jnp.float32)
    qkv = qkv * jax.lax.rsqrt(jnp.mean(rows32 * rows32, axis=-1) + eps)[..., None, None]
  q, k, v = jnp.split(qkv.astype(dtype), [qkv.shape[2] - 2 * num_kv, qkv.shape[2] - num_kv],
                      axis=2)
  inv_freq = jnp.asarray(freqs, jnp.float32)[layer % len(freqs)]  # [H/2]
  before = KVCache(*cache[:2], None, None, None, *cache[2:])  # K/V (and scales): all it reads
  after = write_layer(before, layer, slot, apply_rope(k, positions, inv_freq), v)
  rows_ = jnp.arange(b)[:, None]  # [B, 1]
  new = lambda x, at: x.at[at, rows_, slot].get(mode="clip")  # [B, T, K(, H)]: padding's unseen
  keys, values = (jnp.concatenate([old, written], axis=1) for old, written in zip(
      read_kv(before, layer), read_kv(after, layer, new)))  # [B, S + T, K, H]
  seen = mask[..., :num_slots + t] != 0  # [B, T, S + T] (dropped tokens' columns: unseen)
  out = masked_attention(apply_rope(q, positions, inv_freq), keys, values, seen, scale=scale)
  return (out, *after.slot_fields().values())


def attention(qkv, rows, positions, freqs, slot, length, layer, mask, *cache, scale: float,
              eps: float | None = None, dtype=None):
  """`decode_attention` where the program is lowered for an NVIDIA GPU, `reference`
  elsewhere (a program built for a GPU but run on this host: the tests)."""
  static = dict(scale=scale, eps=eps, dtype=dtype)
  return jax.lax.platform_dependent(
      qkv, rows, positions, freqs, slot, length, layer, mask, *cache,
      cuda=functools.partial(decode_attention, **static),
      default=functools.partial(reference, **static))


def applies(config, cache, tokens: int) -> bool:
  """Whether a pass of `tokens` tokens over `cache` runs `attention` (else the fused
  product): built for a GPU, on one device (no layout mesh), no soft-capped scores, and
  shapes the kernel tiles (`fits`)."""
  return (platform.current() == "gpu" and jax.sharding.get_abstract_mesh().empty
          and config.attn_logit_softcapping is None
          and fits(tokens, cache.num_slots, config.head_dim))
