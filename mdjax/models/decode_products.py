"""A layer's products in a few-token pass on a GPU, one kernel each (Pallas, lowered to
Triton), and the layers of such a pass built on them and on the attention kernel
(`mdjax.models.decode_attention`): five kernels a layer at any row count up to
`MAX_ROWS`, where XLA:GPU's own products and fusions take nine::

    layer l   q|k|v = normed_product(x (+ down parts of l-1); attn_norm, wqkv)  kernel 1
              out   = attention(q|k|v, cache of layer l)                       kernel 2
              x     += out @ wo: parts (XLA: one split product), or             kernel 3
                       residual_product(x, out, wo)
              x, act = normed_product(x (+ parts); mlp_norm, w_gate_up, gated)  kernel 4
              x     += act @ w_down: parts, or residual_product                kernel 5
    after L   x (+ the last down parts), then the final norm and the head (XLA)

`normed_product` adds a product's parts to the residual stream (the new residual, x),
takes x's RMSNorm and multiplies it by a weight, in one kernel::

    x      = residual + sum of the parts                      [M, D]
    scale  = 1 / rms(x)                                        [M]
    out    = (x * norm) @ w * scale                            [M, F]
    gated: act = silu(gate) * up  with gate|up = out's halves  [M, F/2]

    program j (of F / TILE_F; gated: of F/2 / TILE_F)
      walk D in blocks of BLOCK_D: x's block (the residual's, plus the parts' sum;
           program 0 also writes it), its squares summed, and
           (x's block * norm) [Mt, BLOCK_D] @ w's tile(s) [BLOCK_D, TILE_F] summed
           (gated: gate's and up's tiles)
      out  the sums times scale (a row's scale commutes with the product; gated:
           silu(gate) * up) -> out's columns

Each program reads x whole, so that no kernel of its own computes the norm's scale:
with a 1B llama's parts at one row, 16-32 KiB (from L2) beside the 256-512 KiB of
weights it reads. The weights are read once, by one program each, in place (an
unrolled layer's own arrays: nothing copied).

The output and down products come to the next normed product in one of two ways.
At one or two rows, as XLA's product split in K, its parts left unsummed
(`linear_parts`, as few parts as XLA splits into itself: `part_count`): the kernel
that reads them adds them. Past the rows where reading every row of every part in
every program costs more than a kernel (`takes_parts`), a kernel of its own adds the
product to the residual stream, not split in K::

    residual_product   x + a @ w    [M, D] + [M, K] @ [K, D]
      program j (of D / TILE_OUT): walk K in blocks (`residual_block`), a's block
        [Mt, block] @ w's [block, TILE_OUT] summed in float32, rounded as `linear`
        rounds a product, added to x's columns -> the new x's columns

Each of its programs reads all of a, as each of XLA's split products reads a's slice
once per output tile (there 8 to 16 columns wide, here 16): no more L2 traffic than
XLA's product, and no float32 parts written and read again.

Quantized weights (`mdjax.models.quantized`: int8 with a scale per column, int4 in
groups along the input) take the same five kernels a layer: both kernels read q and
convert it in registers, block by block, each block's float32 sum scaled by its
group's scale (`mdjax.models.weight_tiles`): no float copy of a weight is written. An
int8 product's parts come from XLA's split product, scaled in that kernel; a product
in groups along K comes through `residual_product` (`feeding_parts`).

Letters: B batch, T tokens, M = B T rows (Mt: padded to a Triton tile), D model
width, F a product's width, K a residual product's input width, Q a product's parts.
Off a GPU, `reference` and `residual_reference` compute the same with jnp.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from mdjax import platform
from mdjax.models import weight_tiles
from mdjax.models.decode_attention import TILE, tile  # the smallest side of a Triton product
from mdjax.models.layer_loop import layer_scope
from mdjax.models.numerics import linear, linear_parts
from mdjax.models.quantized import QuantizedWeight, is_quantized

MAX_ROWS = 32  # rows (tokens times batch) per pass up to which the kernels replace XLA's
TILE_F = 64  # output columns per program (a 1B llama's gate|up: 128 programs)
BLOCK_D = 128  # model-width columns per step of a program's walk, at most
SHARED_KIB = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99,
              (9, 0): 227, (10, 0): 227, (12, 0): 99}  # KiB of shared memory a program
#                may take (CUDA's opt-in limit), by compute capability: V100, T4, A100,
#                A10/RTX 30, Orin, L4/RTX 40, H100/H200, B200, RTX 50
PARTS = 8  # a product's parts, at most (`part_count`)
PARTS_SHARE = 4  # a kernel adds a product's parts itself while they are at most 1/4 of
#                  the bytes a program reads of the weights (`takes_parts`)
TILE_OUT = 16  # output columns per program of `residual_product`: a Triton product's
#               narrowest (a 1B llama's wo and w_down in 128 programs, on 132 SMs)
RESIDUAL_BLOCK = 512  # input columns per step of its walk, at most
KERNEL_NAME = "mdjax_normed_product"  # the kernels' names in a compiled program (op_name)
RESIDUAL_NAME = "mdjax_residual_product"
OFF_SWITCH = "MDJAX_PALLAS_PRODUCTS"  # set to 0: XLA's products and fusions instead (read
#                                       when a program is traced: set it before the first)


def _power_of_two_dividing(n: int, most: int) -> int:
  """The largest power of two of at most `most` that divides `n` (1 at least)."""
  size = most
  while n % size:
    size //= 2
  return size


def part_count(width: int, rows: int) -> int:
  """How many parts a product of `width` inputs and `rows` rows comes in: the fewest XLA
  then splits no further itself, in whole Triton tiles, at most `PARTS`. Compiled for an
  H200, XLA:GPU splits such a product (1,024-8,192 wide) in K into parts of at most 2,048
  and 2 at least at 1 row (2 as `linear` runs it), of at most 1,024 and 4 at least at 17
  to 32 rows (`tests/test_gpu_kernels.py` checks it)."""
  fewest, most = (2, 2048) if rows <= 2 else (4, 1024)
  wanted = max(fewest, -(-width // most))
  count = 1 << (wanted - 1).bit_length()  # a power of two
  return _power_of_two_dividing(width // TILE, min(count, PARTS)) if width % TILE == 0 else 1


def takes_parts(rows: int, num_parts: int, gated: bool, itemsize: float) -> bool:
  """Whether the kernel adds a product's parts itself, or a `residual_product` adds the
  product first. Each program reads every row of every part (float32), where it reads
  its own weight tiles (`itemsize` bytes a value, two tiles `gated`): past `PARTS_SHARE`
  of those bytes, the parts' reads (from L2) cost more than the kernel saved. A 1B
  llama in bfloat16 adds them itself at 1-4 rows (gate|up) and 1-2 rows (q|k|v); in
  int8 at 1-2 rows and 1 row."""
  return rows * num_parts * 4 * PARTS_SHARE <= (2 if gated else 1) * TILE_F * itemsize


@functools.cache
def stage_bytes() -> int:
  """What one step of a program's walk may load into shared memory: a quarter of what
  the GPU lets a program take (`SHARED_KIB`) less 16 KiB, as Triton asks for 4.0 times
  one step's loads (compiled for an H200 at 3 stages: 278,528 bytes for 69,632 a step,
  427,008 for 106,496); this process's first GPU's, else a Hopper's (the compile
  targets', `mdjax.compile_targets`); 99 KiB for a GPU the table does not list."""
  try:
    gpu = jax.devices("gpu")[0]
    capability = tuple(int(v) for v in str(gpu.compute_capability).split("."))
  except (RuntimeError, AttributeError, ValueError):  # no GPU here
    capability = (9, 0)
  return (SHARED_KIB.get(capability, 99) - 16) * 1024 // 4


def _per_column(padded: int, num_parts: int, tile_f: int, tiles: int, itemsize: int) -> int:
  """Bytes one step loads per model-width column: `padded` rows of `num_parts` float32
  parts and of the residual, and `tiles` weight tiles `tile_f` wide."""
  return padded * (4 * num_parts + itemsize) + tiles * itemsize * tile_f


def block_columns(width: int, rows: int, num_parts: int, gated: bool, itemsize: int,
                  group: int | None = None) -> int:
  """Model-width columns per step of a program's walk over a product `width` wide in,
  for `rows` rows, `num_parts` parts, weights of `itemsize` bytes (a quantized weight's:
  its activations', which q's staged bytes and its scales' stay within): at most
  `BLOCK_D`, within `stage_bytes`, and dividing a quantized weight's `group`."""
  per_column = _per_column(tile(rows), num_parts, TILE_F, 2 if gated else 1, itemsize)
  return _largest_block(width, per_column, BLOCK_D, group)


def residual_block(width: int, rows: int, in_itemsize: int, itemsize: int,
                   group: int | None = None) -> int:
  """Input columns per step of a `residual_product` program's walk over `width`, for
  `rows` rows of `in_itemsize` bytes and weights of `itemsize` (as `block_columns`): at
  most `RESIDUAL_BLOCK`, within `stage_bytes`, and dividing a quantized weight's `group`."""
  return _largest_block(width, tile(rows) * in_itemsize + TILE_OUT * itemsize, RESIDUAL_BLOCK,
                        group)


def _largest_block(width: int, per_column: int, most: int, group: int | None) -> int:
  """The most columns of `per_column` bytes each, a power of two dividing `width` (and
  `group`, if any), of at most `most`, that one step loads within `stage_bytes` (a
  Triton tile at least)."""
  while most > TILE and most * per_column > stage_bytes():
    most //= 2
  block = _power_of_two_dividing(width, most)
  return block if group is None else _power_of_two_dividing(group, block)


def kernel_parts(rows: int, in_width: int, gated: bool, itemsize: float) -> int:
  """How many parts of a product `in_width` wide in (`part_count`) the kernel after it
  adds itself: all of them where it `takes_parts`, else 0 (a `residual_product` first)."""
  count = part_count(in_width, rows)
  return count if takes_parts(rows, count, gated, itemsize) else 0


def feeding_parts(rows: int, feeding: Float[Array, "K D"] | QuantizedWeight,
                  reader: Float[Array, "D F"] | QuantizedWeight, gated: bool) -> int:
  """How many parts of the product of `feeding` the normed product of `reader` adds
  itself (`kernel_parts`, weighed against the bytes of `reader`'s values); 0: a
  `residual_product` adds it first. A quantized product comes in parts only with a
  scale per column and no offset (int8): XLA's split product then scales its output in
  the same kernel, where groups along K would take a kernel more to scale and sum."""
  if is_quantized(feeding) and (feeding.group < feeding.shape[0] or feeding.offset is not None):
    return 0
  return kernel_parts(rows, feeding.shape[0], gated, weight_tiles.value_bytes(reader))


def fits(rows: int, width: int, out_width: int, itemsize: int, num_parts: int,
         gated: bool) -> bool:
  """Whether `rows` rows through a product `width` wide in and `out_width` out (of
  weights of `itemsize` bytes; `num_parts` parts added in the kernel; `gated`) can run
  the kernel: few rows, both widths in whole Triton tiles, and a step of one tile's
  width within `stage_bytes`."""
  step = TILE * _per_column(tile(rows), num_parts, TILE_F, 2 if gated else 1, itemsize)
  return (rows <= MAX_ROWS and width % TILE == 0 and out_width % TILE == 0
          and step <= stage_bytes())


def residual_fits(rows: int, width: int, out_width: int) -> bool:
  """Whether `residual_product` takes `rows` rows through a product `width` wide in and
  `out_width` out: few rows and both widths in whole tiles (a step of one tile, 3 KiB
  at most, fits any GPU's shared memory)."""
  return rows <= MAX_ROWS and width % TILE == 0 and out_width % TILE_OUT == 0


def _kernel(*refs, rows: int, num_parts: int, gated: bool, eps: float, operand_dtype,
            group: int | None, precision):
  """Program j: `out`'s columns j TILE_F .. (see the module's docstring). `refs`: the
  parts (when `num_parts`), the residual, the norm's weight, the weight's tile refs
  (`weight_tiles.specs`; gated: the gate's, then the up's), then x (when `num_parts`)
  and out. The product's operand is in `operand_dtype` (the weight's, or a quantized
  weight's activations'), a quantized weight's blocks within its groups of `group`."""
  if num_parts:
    parts_ref, residual_ref, norm_ref, *tile_refs, x_ref, out_ref = refs
  else:
    residual_ref, norm_ref, *tile_refs, out_ref = refs
  j = pl.program_id(0)
  width, out_width = residual_ref.shape[1], out_ref.shape[1]
  tile_f = _power_of_two_dividing(out_width, TILE_F)
  padded = tile(rows)
  block = block_columns(width, rows, num_parts, gated, operand_dtype.itemsize, group)
  row_ok = (jnp.arange(padded) < rows)[:, None]  # [Mt, 1]
  dtype = residual_ref.dtype

  def x_block(k):  # [Mt, BLOCK_D] in the residual's dtype: x's columns k BLOCK_D ..
    columns = pl.ds(pl.multiple_of(k * block, block), block)
    load = lambda ref: plgpu.load(ref, mask=row_ok, other=0).astype(jnp.float32)
    x = load(residual_ref.at[pl.ds(0, padded), columns])
    if num_parts:
      out = load(parts_ref.at[jnp.int32(0), pl.ds(0, padded), columns])
      for part in range(1, num_parts):
        out = out + load(parts_ref.at[jnp.int32(part), pl.ds(0, padded), columns])
      x = x + out.astype(dtype).astype(jnp.float32)
    return x.astype(dtype), columns

  per_tile = len(tile_refs) // (2 if gated else 1)
  tiles = [tile_refs[i:i + per_tile] for i in range(0, len(tile_refs), per_tile)]  # gate, up

  def step(k, carry):  # x's squares summed [Mt], and [Mt, TILE_F] per weight tile
    total, sums = carry
    x, columns = x_block(k)
    if num_parts:
      @pl.when(j == 0)
      def _():
        plgpu.store(x_ref.at[pl.ds(0, padded), columns], x, mask=row_ok)

    operand = (x * norm_ref[columns][None, :]).astype(operand_dtype)  # [Mt, BLOCK_D]
    sums = tuple(acc + weight_tiles.block_product(weight_refs, operand, k * block, group=group,
                                                  precision=precision)
                 for acc, weight_refs in zip(sums, tiles))
    x = x.astype(jnp.float32)
    return total + (x * x).sum(axis=1), sums

  empty = (jnp.zeros((padded,), jnp.float32),
           tuple(jnp.zeros((padded, tile_f), jnp.float32) for _ in tiles))
  total, sums = jax.lax.fori_loop(0, width // block, step, empty)
  scale = jax.lax.rsqrt(total / width + eps)[:, None]  # [Mt, 1]: the row scale commutes
  #                                                     with the product
  if gated:  # rounded as `reference` rounds them
    gate, up = ((s * scale).astype(dtype).astype(jnp.float32) for s in sums)
    out = (gate * jax.nn.sigmoid(gate)).astype(dtype).astype(jnp.float32) * up
  else:
    out = sums[0] * scale
  plgpu.store(out_ref.at[pl.ds(0, padded), pl.ds(pl.multiple_of(j * tile_f, tile_f), tile_f)],
              out.astype(out_ref.dtype), mask=row_ok)


def normed_product(parts: Float[Array, "Q M2 D"] | None, residual: Float[Array, "B T D"],
                   norm: Float[Array, "D"], weight: Float[Array, "D F"] | QuantizedWeight, *,
                   eps: float, gated: bool = False, interpret: bool = False
                   ) -> tuple[Float[Array, "B T D"], Float[Array, "B T F"]]:
  """`(x, out)`: the residual stream `residual` plus the sum of a product's `parts`
  (`linear_parts`: row b T + t is token t of row b; rows past B T ignored; None: x is
  `residual`), and the product of x's RMSNorm (`norm`, `eps`) with `weight` (float or
  quantized: `weight_tiles`), float32; `gated`: `silu(gate) * up` of its halves,
  `[B, T, F/2]` in the residual's dtype."""
  b, t, width = residual.shape
  rows = b * t
  out_width = weight.shape[1] // 2 if gated else weight.shape[1]
  tile_f = _power_of_two_dividing(out_width, TILE_F)
  num_parts = 0 if parts is None else parts.shape[0]
  operand_dtype = jnp.dtype(weight.dtype)  # a quantized weight's: its activations'
  precision = jax.lax.Precision.HIGHEST if operand_dtype == jnp.float32 else None
  kernel = functools.partial(_kernel, rows=rows, num_parts=num_parts, gated=gated, eps=eps,
                             operand_dtype=operand_dtype, group=weight_tiles.group(weight),
                             precision=precision)
  out_shape = [jax.ShapeDtypeStruct((rows, out_width), residual.dtype if gated else jnp.float32)]
  if num_parts:
    out_shape.insert(0, jax.ShapeDtypeStruct((rows, width), residual.dtype))
  firsts = (0, out_width // tile_f) if gated else (0,)  # the gate's first tile (and the up's)
  whole = pl.BlockSpec()  # the whole array: each program indexes its part
  outs = pl.pallas_call(
      kernel, grid=(out_width // tile_f,),
      in_specs=[whole] * (2 + bool(num_parts))
      + [spec for first in firsts for spec in weight_tiles.specs(weight, tile_f, first)],
      out_specs=[whole] * len(out_shape), out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret, name=KERNEL_NAME,
  )(*([parts] if num_parts else []), residual.reshape(rows, width), norm,
    *weight_tiles.operands(weight) * len(firsts))
  x = outs[0].reshape(b, t, width) if num_parts else residual
  return x, outs[-1].reshape(b, t, out_width)


def reference(parts: Float[Array, "Q M2 D"] | None, residual: Float[Array, "B T D"],
              norm: Float[Array, "D"], weight: Float[Array, "D F"] | QuantizedWeight, *,
              eps: float, gated: bool = False
              ) -> tuple[Float[Array, "B T D"], Float[Array, "B T F"]]:
  """What `normed_product` computes, as `mdjax.models.transformer` computes it on a GPU
  without it (the norm's weight into the product's operand, its row scale after)."""
  dtype = residual.dtype
  x = _added(residual, parts)
  x32 = x.astype(jnp.float32)
  scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [B, T, 1]
  out = linear(norm * x, weight, jnp.float32) * scale
  if not gated:
    return x, out
  gate, up = jnp.split(out.astype(dtype), 2, axis=-1)
  return x, jax.nn.silu(gate) * up


def _residual_kernel(a_ref, *refs, rows: int, operand_dtype, group: int | None, precision):
  """Program j: the new residual stream's columns j TILE_OUT .. (the module's docstring).
  `refs`: the weight's tile refs (`weight_tiles.specs`), the residual, out; the rest as
  `_kernel`'s."""
  *tile_refs, residual_ref, out_ref = refs
  j = pl.program_id(0)
  padded = tile(rows)
  width = a_ref.shape[1]
  block = residual_block(width, rows, a_ref.dtype.itemsize, operand_dtype.itemsize, group)
  row_ok = (jnp.arange(padded) < rows)[:, None]  # [Mt, 1]
  columns = pl.ds(pl.multiple_of(j * TILE_OUT, TILE_OUT), TILE_OUT)

  def step(k, total):  # [Mt, TILE_OUT]: a's block times w's
    inputs = pl.ds(pl.multiple_of(k * block, block), block)
    a = plgpu.load(a_ref.at[pl.ds(0, padded), inputs], mask=row_ok, other=0)
    return total + weight_tiles.block_product(tile_refs, a.astype(operand_dtype), k * block,
                                              group=group, precision=precision)

  product = jax.lax.fori_loop(0, width // block, step,
                              jnp.zeros((padded, TILE_OUT), jnp.float32))
  dtype = residual_ref.dtype
  x = plgpu.load(residual_ref.at[pl.ds(0, padded), columns], mask=row_ok, other=0)
  out = x.astype(jnp.float32) + product.astype(dtype).astype(jnp.float32)  # as `linear` rounds
  plgpu.store(out_ref.at[pl.ds(0, padded), columns], out.astype(dtype), mask=row_ok)


def residual_product(residual: Float[Array, "B T D"], a: Float[Array, "B T K"],
                     weight: Float[Array, "K D"] | QuantizedWeight, *, interpret: bool = False
                     ) -> Float[Array, "B T D"]:
  """The residual stream plus `a @ weight` (float or quantized: `weight_tiles`;
  accumulated in float32, rounded to the residual's dtype, then added), in one kernel,
  not split in K (the module's docstring)."""
  b, t, out_width = residual.shape
  rows, width = b * t, a.shape[-1]
  operand_dtype = jnp.dtype(weight.dtype)
  precision = jax.lax.Precision.HIGHEST if operand_dtype == jnp.float32 else None
  whole = pl.BlockSpec()  # the whole array: each program indexes its part
  out = pl.pallas_call(
      functools.partial(_residual_kernel, rows=rows, operand_dtype=operand_dtype,
                        group=weight_tiles.group(weight), precision=precision),
      grid=(out_width // TILE_OUT,),
      in_specs=[whole, *weight_tiles.specs(weight, TILE_OUT), whole], out_specs=whole,
      out_shape=jax.ShapeDtypeStruct((rows, out_width), residual.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret, name=RESIDUAL_NAME,
  )(a.reshape(rows, width), *weight_tiles.operands(weight), residual.reshape(rows, out_width))
  return out.reshape(b, t, out_width)


def residual_reference(residual: Float[Array, "B T D"], a: Float[Array, "B T K"],
                       weight: Float[Array, "K D"] | QuantizedWeight) -> Float[Array, "B T D"]:
  """What `residual_product` computes, as `mdjax.models.transformer` adds a product."""
  return residual + linear(a, weight, residual.dtype)


def _anywhere(kernel, kernel_reference, *args, **static):
  """`kernel(*args, **static)` where the program is lowered for an NVIDIA GPU, its
  reference elsewhere (a program built for a GPU but run on this host: the tests)."""
  return jax.lax.platform_dependent(
      *args, cuda=functools.partial(kernel, **static),
      default=functools.partial(kernel_reference, **static))


def applies(config, params: dict, rows: int) -> bool:
  """Whether a few-token pass on a GPU (`decode_attention.applies`) of `rows` rows runs
  `layers` (else XLA's products): unrolled layers (a scanned layer's weights are slices
  of the stack, which a kernel's operand would copy) of the llama family's plainest
  form (an attention norm, q|k|v and gate|up fused, SiLU, no biases, no q/k or post
  norms), whose weights, float or quantized (`weight_tiles.takes`), give products that
  `fits`; unless the environment sets `OFF_SWITCH` to 0."""
  layers = params["layers"]
  if (os.environ.get(OFF_SWITCH, "1") == "0" or platform.current() != "gpu"
      or not isinstance(layers, list) or config.family == "gemma3"
      or not all(weight_tiles.takes(lp[name]) for lp in layers
                 for name in ("wqkv", "wo", "w_gate_up", "w_down") if name in lp)
      or config.qkv_bias or config.qk_norm or config.o_bias or config.mlp_bias):
    return False

  def runs(weight, feeding, gated):  # the normed product of `weight`, and the product
    #                                  `feeding` it: its parts, or a residual product
    parts = feeding_parts(rows, feeding, weight, gated)
    return fits(rows, *weight.shape, weight.dtype.itemsize, parts, gated) and (
        parts > 0 or residual_fits(rows, *feeding.shape))

  return all({"attn_norm", "wqkv", "w_gate_up"} <= set(lp) and all(
      runs(weight, feeding, gated)
      for weight, feeding, gated in ((lp["wqkv"], lp["w_down"], False),
                                     (lp["w_gate_up"], lp["wo"], True))) for lp in layers)


def layers(config, params: dict, x: Float[Array, "B T D"], attend, carry,
           keep_after: tuple[int, ...] = ()):
  """The decoder layers of a few-token pass as the module's docstring draws them, where
  `applies`: `(x, kept, carry)`, the residual stream after the last layer, after each
  layer of `keep_after` (a dict by layer), and the last `carry`. `attend(qkv, index, carry) ->
  (out [B, T, N, H], carry)` is the attention of layer `index` on its q|k|v product
  `[1, M, N + 2K, H]` (normed, before RoPE)."""
  rows = x.shape[0] * x.shape[1]
  stack = params["layers"]

  def added(x, a, weight, reader, gated):  # (x, parts): the parts where `reader` adds them
    count = feeding_parts(rows, weight, reader, gated)
    if count:
      return x, linear_parts(a, weight, count)  # [Q, M, D]
    return _anywhere(residual_product, residual_reference, x, a, weight), None

  def normed(parts, x, norm, weight, gated=False):
    return _anywhere(normed_product, reference, parts, x, norm, weight,
                     eps=config.rms_norm_eps, gated=gated)

  pending, kept = None, {}  # pending: the last down product's parts, not added yet
  for index, lp in enumerate(stack):
    with jax.named_scope(layer_scope(index)):
      x, qkv = normed(pending, x, lp["attn_norm"], lp["wqkv"])
      out, carry = attend(qkv.reshape(1, -1, qkv.shape[-1] // config.head_dim, config.head_dim),
                          index, carry)  # [B, T, N, H]
      x, parts = added(x, out.reshape(*out.shape[:2], -1), lp["wo"], lp["w_gate_up"], True)
      x, act = normed(parts, x, lp["mlp_norm"], lp["w_gate_up"], gated=True)  # [B, T, F]
      reader = stack[min(index + 1, len(stack) - 1)]["wqkv"]  # after the last: as if a layer
      x, pending = added(x, act, lp["w_down"], reader, False)  # followed (XLA's final norm)
    if index in keep_after:
      kept[index] = _added(x, pending)
  return _added(x, pending), kept, carry


def _added(x: Float[Array, "B T D"], parts: Float[Array, "Q M2 D"] | None
           ) -> Float[Array, "B T D"]:
  """`x` plus the sum of a product's float32 `parts` (None: none), rounded as `linear`
  rounds a product."""
  if parts is None:
    return x
  b, t, width = x.shape
  return x + parts.sum(axis=0)[:b * t].astype(x.dtype).reshape(b, t, width)
