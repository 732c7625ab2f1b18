"""A weight as the product kernels of `mdjax.models.decode_products` read it, float or
quantized (`mdjax.models.quantized.QuantizedWeight`): each program its own column tile,
walked along the input in blocks; a quantized tile's integers converted to the
activations' dtype in registers, block by block, and each block's float32 product
scaled by its group's scale. No float copy of a quantized weight is ever written::

    a weight [D, F] as a kernel's operands, program j's tile (of F / tile):
      float      w       [D, F]                 -> [D, tile]   (columns j tile ..)
      quantized  q       [D, F] int8 or int4    -> [D, tile]
                 scale   [G, F] bf16 / f32      -> [G, tile]
                 offset  [G, F] as scale / none -> [G, tile]

    block k of the walk: operand a [Mt, block] (the activations' dtype), rows
    k block .. of the tile, in group g = k block / group (a block lies in one group)
      float      a @ w's block                                       [Mt, tile] float32
      quantized  (a @ q's block as a's dtype) * scale[g]  (+ rowsum(a) * offset[g])

Scaling each block's float32 sum, not the block's weights, keeps the converted q exact
(int8 and int4 values are exact in bfloat16): the kernel computes what XLA's product
with the conversion in its operand computes (`quantized.product`), up to float32
summation order, where a block scaled before the product would round every weight to
the activations' dtype. The cost is a block no longer than a group (int4: 64 inputs),
and per block a [Mt, tile] multiply beside the product (an offset: a product more).
Each array's tile is its own `BlockSpec`, so a program reads an int4 tile's whole
bytes (Pallas loads an int4 block of static, even start and width as bytes and splits
their halves).

Letters: D input width, F output width, G groups (one: int8's scale per column), Mt
rows padded to a Triton tile.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from mdjax.models.decode_attention import TILE  # the smallest side of a Triton product
from mdjax.models.quantized import QuantizedWeight, is_quantized


def operands(weight: Float[Array, "D F"] | QuantizedWeight) -> list[Array]:
  """The arrays a kernel takes for `weight`: `[w]`, or `[q, scale]` (and the offset)."""
  if not is_quantized(weight):
    return [weight]
  return [weight.q, weight.scale] + ([] if weight.offset is None else [weight.offset])


def specs(weight: Float[Array, "D F"] | QuantizedWeight, tile: int,
          first: int = 0) -> list[pl.BlockSpec]:
  """Each of `operands(weight)`'s column tiles `tile` wide, program j's the `first + j`th
  (`first`: where a gated product's up half begins, in tiles)."""
  return [pl.BlockSpec((a.shape[0], tile), lambda j: (0, first + j)) for a in operands(weight)]


def group(weight: Float[Array, "D F"] | QuantizedWeight) -> int | None:
  """Inputs per group of a quantized weight (a block of the walk divides it); None for a
  float weight (any block)."""
  return weight.group if is_quantized(weight) else None


def value_bytes(weight: Float[Array, "D F"] | QuantizedWeight) -> float:
  """The bytes of one of `weight`'s values as a program reads them (int4: half a byte)."""
  values = weight.q if is_quantized(weight) else weight
  return 0.5 if values.dtype == jnp.int4 else jnp.dtype(values.dtype).itemsize


def takes(weight: Float[Array, "D F"] | QuantizedWeight) -> bool:
  """Whether a kernel reads `weight`: a float `[D, F]` matrix, or a quantized one grouped
  along D (`axis` -2) in groups of whole Triton tiles."""
  return not is_quantized(weight) or (weight.axis == -2 and weight.q.ndim == 2
                                      and weight.group % TILE == 0)


def block_product(tile_refs, a: Float[Array, "Mt block"], start, *, group: int | None,
                  precision) -> Float[Array, "Mt tile"]:
  """`a` times the rows `start ..` (a multiple of `a`'s width) of one column tile's refs
  (`specs`), float32; quantized: converted and scaled as the module draws it."""
  block = a.shape[1]
  rows = pl.ds(pl.multiple_of(start, block), block)
  w = tile_refs[0][rows, :]
  if len(tile_refs) == 1:
    return plgpu.dot(a, w, precision=precision)
  sums = plgpu.dot(a, w.astype(a.dtype), precision=precision)
  g = start // group
  out = sums * tile_refs[1][g, :][None, :].astype(jnp.float32)
  if len(tile_refs) == 3:  # the offset: its value times the sum of the block's inputs, a
    #                        product with ones (a float32 sum of `a` would let XLA, in
    #                        interpret mode, sum the values `a` was rounded from)
    ones = jnp.ones((block, sums.shape[1]), a.dtype)
    offset = tile_refs[2][g, :][None, :].astype(jnp.float32)
    out = out + plgpu.dot(a, ones, precision=precision) * offset
  return out
