"""Attention of a few new tokens over one layer of the cache in one TPU kernel (Pallas,
lowered to Mosaic) that reads only each row's filled slots: what the "fused" attention
runs on a TPU for passes of at most `MAX_TOKENS` tokens (a decoded token, a draft, a
small tree). The new tokens' K/V are already in the cache (`mdjax.cache.write_layer`);
the visibility mask is `mdjax.topology.visible`'s, computed by XLA.

XLA:TPU holds the cache slots-minor (`[L, B, S, K, H]` laid out as `[L, B, K, H, S]`:
a head dim of 64 minor would be padded to 128 lanes), so the kernel reads K and V
through that transposed view, a bitcast, and their blocks come as `[K, H, X]` (keys
transposed: the scores are one product `q [R Tp, H] x k [H, X]`). They are pinned to
HBM: a cache that fits in VMEM (a 1B llama's at 1-2 rows of 1,024 slots) was otherwise
moved there whole, written and moved back at every layer of passes of 4 tokens or more,
compiled for a v5e::

    grid (row b, key block j), j = 0 .. S / X - 1, the blocks of a row in order
      q     [K, R Tp, H]   row b's queries per KV head: query head k R + r of token t at
                           row r Tp + t (T padded to Tp, a multiple of 8 sublanes)
      k, v  [K, H, X]      block j of layer `layer`, or of the row's last filled block
                           when j is past it: an unchanged block index, which the
                           pipeline does not fetch again, so a row reads
                           ceil(length / X) blocks and the rest is never read
      mask  [Tp, X]        what token t sees of the block (repeated for the R heads)
      out   [K, R Tp, H]   online softmax over the row's filled blocks

A float cache only: compiled for a v5e, an int8 cache read by such a kernel was copied
at every layer between the tiles XLA:TPU's selects write int8 arrays in, (8, 128), and
those Mosaic reads them in, (32, 128); an int8 cache keeps the fused product.

Einsum letters as in `mdjax.models.attention`: B batch, T new tokens, S slots, K kv
heads, R query heads per kv head (N = K R), H head dim, L layers, X slots per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from mdjax import platform

MAX_TOKENS = 32  # tokens per pass up to which the kernel replaces the fused product
KERNEL_NAME = "mdjax_tpu_decode_attention"  # the kernel's name in a compiled program
BLOCKS = (512, 256, 128)  # slots per block: the largest that divides the cache (a TPU
#                           step costs ~0.35 us, so a block of 512 slots, 256 KiB of K/V
#                           at a 1B llama's 8 KV heads of 64, keeps the steps' overhead
#                           small against the bytes they read)
SUBLANES = 8  # the tokens of a pass are padded to a multiple of it
# A smaller cache XLA:TPU may keep in VMEM, where reading every slot costs little; a
# kernel that reads it from HBM then made XLA write it back there at every layer.
# Compiled for a v5e at the 1B shape: whole-generation programs over 8 MiB of K and V
# (256 slots) copied ~1 GiB per 8 steps that way, those over 40 MiB (1,280 slots) and
# `decode_step` over 32 MiB (1,024) nothing.
MIN_CACHE_BYTES = 32 * 2**20


def block_size(num_slots: int) -> int | None:
  """Slots per block for a cache of `num_slots`: the largest of `BLOCKS` that divides
  it, the whole cache when it is shorter than a block, else None (no kernel)."""
  if num_slots < BLOCKS[-1]:
    return num_slots
  return next((size for size in BLOCKS if num_slots % size == 0), None)


def applies(tokens: int, num_slots: int, kv_bytes: int, cache_dtype) -> bool:
  """Whether a pass of `tokens` tokens over a cache of `num_slots` slots, `kv_bytes` of
  K and V and `cache_dtype` runs the kernel: built for a TPU, on one device (a kernel is
  not partitioned over a mesh), few tokens, slots in whole blocks, a float cache (see
  the module), and a cache of at least `MIN_CACHE_BYTES`."""
  return (platform.current() == "tpu" and jax.sharding.get_abstract_mesh().empty
          and tokens <= MAX_TOKENS and block_size(num_slots) is not None
          and kv_bytes >= MIN_CACHE_BYTES and jnp.dtype(cache_dtype) != jnp.int8)


def last_block(length: Int[Array, ""], j: Int[Array, ""], block: int) -> Int[Array, ""]:
  """The block a row of `length` filled slots reads at step `j`: block j while j is
  filled, then its last filled block again (no fetch). Truncating division: Mosaic
  lowers no floor division without a TPU to ask which one it is."""
  return jnp.minimum(j, jax.lax.div(jnp.maximum(length - 1, 0), block))


@jax.custom_batching.custom_vmap
def _in_hbm(x: Array) -> Array:
  """`x`, a kernel's operand, held in HBM (under `jax.vmap` too: MTP heads' passes)."""
  return pltpu.with_memory_space_constraint(x, pltpu.HBM)


@_in_hbm.def_vmap
def _in_hbm_batched(axis_size: int, in_batched: list[bool], x: Array):
  del axis_size
  return _in_hbm(x), in_batched[0]


def _kernel(length_ref, layer_ref, q_ref, k_ref, v_ref, mask_ref, out_ref, peak_ref,
            total_ref, acc_ref, *, group: int, block: int, softcap: float | None, precision):
  """Row `b`, block `j`: folds the block into the online softmax of every KV head's
  queries when the block holds filled slots; writes the outputs after the last block.
  Scratch: `peak`, `total` ([K, R Tp, 128], lanes alike) and `acc` ([K, R Tp, H])."""
  b, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _():
    peak_ref[...] = jnp.full(peak_ref.shape, -jnp.inf, jnp.float32)
    total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(j * block < length_ref[b])
  def _():
    seen = jnp.concatenate([mask_ref[...]] * group, axis=0) > 0  # [R Tp, X]
    for head in range(q_ref.shape[0]):
      q = q_ref[head]  # [R Tp, H]
      keys, values = k_ref[head].astype(q.dtype), v_ref[head].astype(q.dtype)  # [H, X]
      scores = jnp.dot(q, keys, precision=precision,
                       preferred_element_type=jnp.float32)  # [R Tp, X]
      if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
      scores = jnp.where(seen, scores, -jnp.inf)
      peak = peak_ref[head]  # [R Tp, 128]
      new_peak = jnp.maximum(peak, scores.max(axis=1, keepdims=True))
      base = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)
      rescale = jnp.exp(peak - base)
      weights = jnp.exp(scores - base[:, :1])  # [R Tp, X]
      total_ref[head] = total_ref[head] * rescale + weights.sum(axis=1, keepdims=True)
      summed = jax.lax.dot_general(weights.astype(q.dtype), values, (((1,), (1,)), ((), ())),
                                   precision=precision,
                                   preferred_element_type=jnp.float32)  # [R Tp, H]
      acc_ref[head] = acc_ref[head] * rescale[:, :1] + summed
      peak_ref[head] = new_peak

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    total = total_ref[...][..., :1]
    out_ref[...] = (acc_ref[...] / jnp.where(total > 0, total, 1.0)).astype(out_ref.dtype)


def attention(q: Float[Array, "B T N H"], mask: Bool[Array, "B T S"], length: Int[Array, "B"],
              layer, k: Float[Array, "L B S K H"], v: Float[Array, "L B S K H"], *,
              scale: float, softcap: float | None = None,
              interpret: bool = False) -> Float[Array, "B T N H"]:
  """The queries' attention over layer `layer` (an int, or a traced int32 scalar) of
  `cache`, K and V `[L, B, S, K, H]` (a per-layer cache's layer as a stack of one:
  `mdjax.cache.at_layer`), reading each row's slots below `length` only; `mask`: what
  each query sees (`mdjax.topology.visible`). Queries that see nothing give 0. The
  products take the cache's dtype (bfloat16: what XLA:TPU's products of float32 at the
  default precision take too; float32 at the highest precision), scores and sums in
  float32."""
  b, t, n, h = q.shape
  num_slots, num_kv = k.shape[2], k.shape[3]
  r, tp, block = n // num_kv, -(-t // SUBLANES) * SUBLANES, block_size(num_slots)
  dtype = jnp.float32 if k.dtype == jnp.float32 else jnp.bfloat16  # the products'
  grouped = (q.astype(jnp.float32) * scale).astype(dtype)
  grouped = jnp.pad(grouped, [(0, 0), (0, tp - t), (0, 0), (0, 0)]).reshape(b, tp, num_kv, r, h)
  grouped = grouped.transpose(0, 2, 3, 1, 4).reshape(b, num_kv, r * tp, h)  # row r Tp + t
  seen = jnp.pad(mask, [(0, 0), (0, tp - t), (0, 0)]).astype(jnp.bfloat16)  # [B, Tp, S]
  per_row = pl.BlockSpec((None, num_kv, r * tp, h), lambda i, j, *_: (i, 0, 0, 0))
  cache_block = pl.BlockSpec((None, None, num_kv, h, block), lambda i, j, length_ref, layer_ref: (
      layer_ref[0], i, 0, 0, last_block(length_ref[i], j, block)))  # layer and row squeezed
  mask_block = pl.BlockSpec((None, tp, block), lambda i, j, length_ref, _: (
      i, 0, last_block(length_ref[i], j, block)))
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
  out = pl.pallas_call(
      functools.partial(_kernel, group=r, block=block, softcap=softcap, precision=precision),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, num_slots // block),
          in_specs=[per_row, cache_block, cache_block, mask_block], out_specs=per_row,
          scratch_shapes=[pltpu.VMEM((num_kv, r * tp, 128), jnp.float32),
                          pltpu.VMEM((num_kv, r * tp, 128), jnp.float32),
                          pltpu.VMEM((num_kv, r * tp, h), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((b, num_kv, r * tp, h), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret, name=KERNEL_NAME,
  )(length.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1), grouped,
    *(_in_hbm(x.transpose(0, 1, 3, 4, 2)) for x in (k, v)),
    seen)  # [L, B, K, H, S]: bitcasts, kept in HBM (see the module)
  out = out.reshape(b, num_kv, r, tp, h).transpose(0, 3, 1, 2, 4).reshape(b, tp, n, h)
  return out[:, :t]
