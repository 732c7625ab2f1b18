"""A layer's products that begin with an RMSNorm, in a few-token pass on a GPU, one
kernel each (Pallas, lowered to Triton), and the layers of such a pass built on them
and on the attention kernel (`mdjax.models.decode_attention`): five kernels a layer,
where XLA:GPU's own products and fusions take nine::

    layer l   q|k|v = normed_product(x, + down parts of l-1; attn_norm, wqkv)   kernel 1
              out   = attention(q|k|v, cache of layer l)                        kernel 2
              parts = out @ wo, in parts (XLA: one split product)              kernel 3
              x, act = normed_product(x, + parts; mlp_norm, w_gate_up, gated)   kernel 4
              parts = act @ w_down, in parts (XLA)                             kernel 5
    after L   x + the last down parts (then the final norm and the head, XLA)

`normed_product` adds a product's parts to the residual stream (the new residual, x),
takes x's RMSNorm and multiplies it by a weight, in one kernel::

    x      = residual + sum of the parts                      [M, D]
    scale  = 1 / rms(x)                                        [M]
    out    = (x * norm) @ w * scale                            [M, F]
    gated: act = silu(gate) * up  with gate|up = out's halves  [M, F/2]

    program j (of F / TILE_F; gated: of F/2 / TILE_F)
      pass 1   walk D in blocks: x's block (each program: M D values, from L2), its
               squares summed -> scale; program 0 also writes x (when parts came)
      pass 2   walk D in blocks: (x's block * norm) [Mt, BLOCK_D] @ w's tile(s)
               [BLOCK_D, TILE_F] -> [Mt, TILE_F] (gated: gate's and up's tiles)
      out      times scale (gated: silu(gate) * up) -> out's columns

Each program reads x whole (a 1B llama's row: 4 KiB, against the 256-512 KiB of
weights it reads), so that no kernel of its own computes the norm's scale; the weights
are read once, by one program each, in place (an unrolled layer's own arrays: nothing
copied). The output product's and the down product's parts are XLA's products split in
K (`linear_parts`), summed by the kernel that reads them.

Letters: B batch, T tokens, M = B T rows (Mt: padded to a Triton tile), D model
width, F a product's width, Q a product's parts. Off a GPU, `reference` computes the
same with jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from mdjax import platform
from mdjax.models import decode_attention
from mdjax.models.numerics import linear, linear_parts

MAX_ROWS = 32  # rows (tokens times batch) per pass up to which the kernels replace XLA's
TILE = 16  # the smallest side of a Triton product
TILE_F = 64  # output columns per program (a 1B llama's gate|up: 128 programs)
BLOCK_D = 128  # model-width columns per step of a program's walk, at most
STAGE_BYTES = 100 * 1024  # what one step's loads may take of a program's shared memory
#                           (Triton keeps two steps' in flight; an H100/H200 SM has 227 KiB)
PARTS = 8  # a product's parts, at most: compiled for an H200, XLA:GPU splits a 2,048-wide
#            few-row product in K in 8, an 8,192-wide one in 16 (`linear_parts`)
KERNEL_NAME = "mdjax_normed_product"  # the kernel's name in a compiled program (op_name)


def _power_of_two_dividing(n: int, most: int) -> int:
  """The largest power of two of at most `most` that divides `n` (1 at least)."""
  size = most
  while n % size:
    size //= 2
  return size


def _tile(n: int) -> int:
  """`n` rounded up to a power of two of at least `TILE`."""
  return max(TILE, 1 << (n - 1).bit_length())


def parts(width: int) -> int:
  """How many parts (`PARTS` at most) a product of `width` inputs comes in: whole Triton
  tiles each."""
  return _power_of_two_dividing(width // TILE, PARTS) if width % TILE == 0 else 1


def _block(width: int, padded: int, num_parts: int, tile_f: int, tiles: int,
           itemsize: int) -> int:
  """Model-width columns per step: at most `BLOCK_D`, and one step's loads (`padded` rows
  of `num_parts` float32 parts and of the residual, `tiles` weight tiles, in elements of
  `itemsize` bytes) within `STAGE_BYTES`."""
  per_column = padded * (4 * num_parts + itemsize) + tiles * itemsize * tile_f  # bytes
  most = BLOCK_D
  while most > TILE and most * per_column > STAGE_BYTES:
    most //= 2
  return _power_of_two_dividing(width, most)


def fits(rows: int, width: int, out_width: int) -> bool:
  """Whether `rows` rows through a product `width` wide in and `out_width` out can run
  the kernel: few rows, both widths in whole Triton tiles."""
  return rows <= MAX_ROWS and width % TILE == 0 and out_width % TILE == 0


def _kernel(*refs, rows: int, num_parts: int, gated: bool, eps: float, precision):
  """Program j: `out`'s columns j TILE_F .. (see the module's docstring). `refs`: the
  parts (when `num_parts`), the residual, the norm's weight, the weight, then x (when
  `num_parts`) and out."""
  if num_parts:
    parts_ref, residual_ref, norm_ref, w_ref, x_ref, out_ref = refs
  else:
    residual_ref, norm_ref, w_ref, out_ref = refs
  j = pl.program_id(0)
  width, out_width = residual_ref.shape[1], out_ref.shape[1]
  tile_f = _power_of_two_dividing(out_width, TILE_F)
  padded = _tile(rows)
  block = _block(width, padded, num_parts, tile_f, 2 if gated else 1, w_ref.dtype.itemsize)
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

  def squares(k, total):  # [Mt]
    x, columns = x_block(k)
    if num_parts:
      @pl.when(j == 0)
      def _():
        plgpu.store(x_ref.at[pl.ds(0, padded), columns], x, mask=row_ok)

    x = x.astype(jnp.float32)
    return total + (x * x).sum(axis=1)

  steps = width // block
  total = jax.lax.fori_loop(0, steps, squares, jnp.zeros((padded,), jnp.float32))
  scale = jax.lax.rsqrt(total / width + eps)[:, None]  # [Mt, 1]
  starts = [j * tile_f] + ([out_width + j * tile_f] if gated else [])  # gate (and up)

  def product(k, acc):  # [Mt, TILE_F] per tile
    x, columns = x_block(k)
    operand = (x * norm_ref[columns][None, :]).astype(w_ref.dtype)  # [Mt, BLOCK_D]
    return tuple(total + plgpu.dot(operand, w_ref[columns, pl.ds(pl.multiple_of(start, tile_f),
                                                                  tile_f)], precision=precision)
                 for total, start in zip(acc, starts))

  empty = tuple(jnp.zeros((padded, tile_f), jnp.float32) for _ in starts)
  sums = jax.lax.fori_loop(0, steps, product, empty)
  if gated:  # rounded as `reference` rounds them
    gate, up = ((s * scale).astype(dtype).astype(jnp.float32) for s in sums)
    out = (gate * jax.nn.sigmoid(gate)).astype(dtype).astype(jnp.float32) * up
  else:
    out = sums[0] * scale
  plgpu.store(out_ref.at[pl.ds(0, padded), pl.ds(pl.multiple_of(j * tile_f, tile_f), tile_f)],
              out.astype(out_ref.dtype), mask=row_ok)


def normed_product(parts: Float[Array, "Q M2 D"] | None, residual: Float[Array, "B T D"],
                   norm: Float[Array, "D"], weight: Float[Array, "D F"], *, eps: float,
                   gated: bool = False, interpret: bool = False
                   ) -> tuple[Float[Array, "B T D"], Float[Array, "B T F"]]:
  """`(x, out)`: the residual stream `residual` plus the sum of a product's `parts`
  (`linear_parts`: row b T + t is token t of row b; rows past B T ignored; None: x is
  `residual`), and the product of x's RMSNorm (`norm`, `eps`) with `weight`, float32;
  `gated`: `silu(gate) * up` of its halves, `[B, T, F/2]` in the residual's dtype."""
  b, t, width = residual.shape
  rows = b * t
  out_width = weight.shape[1] // 2 if gated else weight.shape[1]
  num_parts = 0 if parts is None else parts.shape[0]
  precision = jax.lax.Precision.HIGHEST if weight.dtype == jnp.float32 else None
  kernel = functools.partial(_kernel, rows=rows, num_parts=num_parts, gated=gated, eps=eps,
                             precision=precision)
  out_shape = [jax.ShapeDtypeStruct((rows, out_width), residual.dtype if gated else jnp.float32)]
  if num_parts:
    out_shape.insert(0, jax.ShapeDtypeStruct((rows, width), residual.dtype))
  inputs = [residual.reshape(rows, width), norm, weight]
  whole = pl.BlockSpec()  # the whole array: each program indexes its part
  outs = pl.pallas_call(
      kernel, grid=(out_width // _power_of_two_dividing(out_width, TILE_F),),
      in_specs=[whole] * (len(inputs) + bool(num_parts)), out_specs=[whole] * len(out_shape),
      out_shape=out_shape, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret, name=KERNEL_NAME,
  )(*([parts] if num_parts else []), *inputs)
  x = outs[0].reshape(b, t, width) if num_parts else residual
  return x, outs[-1].reshape(b, t, out_width)


def reference(parts: Float[Array, "Q M2 D"] | None, residual: Float[Array, "B T D"],
              norm: Float[Array, "D"], weight: Float[Array, "D F"], *, eps: float,
              gated: bool = False) -> tuple[Float[Array, "B T D"], Float[Array, "B T F"]]:
  """What `normed_product` computes, as `mdjax.models.transformer` computes it on a GPU
  without it (the norm's weight into the product's operand, its row scale after)."""
  b, t, width = residual.shape
  dtype = residual.dtype
  x = residual
  if parts is not None:
    x = x + parts.astype(jnp.float32).sum(axis=0)[:b * t].astype(dtype).reshape(b, t, width)
  x32 = x.astype(jnp.float32)
  scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [B, T, 1]
  out = linear(norm * x, weight, jnp.float32) * scale
  if not gated:
    return x, out
  gate, up = jnp.split(out.astype(dtype), 2, axis=-1)
  return x, jax.nn.silu(gate) * up


def _anywhere(parts, residual, norm, weight, *, eps: float, gated: bool = False):
  """`normed_product` where the program is lowered for an NVIDIA GPU, `reference`
  elsewhere (a program built for a GPU but run on this host: the tests)."""
  static = dict(eps=eps, gated=gated)
  return jax.lax.platform_dependent(
      parts, residual, norm, weight, cuda=functools.partial(normed_product, **static),
      default=functools.partial(reference, **static))


def applies(config, params: dict, rows: int) -> bool:
  """Whether a few-token pass on a GPU (`decode_attention.applies`) of `rows` rows runs
  `layers` (else XLA's products): unrolled layers (a scanned layer's weights are slices
  of the stack, which a kernel's operand would copy) of the llama family's plainest
  form (an attention norm, q|k|v and gate|up fused, SiLU, no biases, no q/k or post
  norms), whose products `fits`."""
  layers = params["layers"]
  if (platform.current() != "gpu" or not isinstance(layers, list) or config.family == "gemma3"
      or config.qkv_bias or config.qk_norm or config.o_bias or config.mlp_bias):
    return False
  return all({"attn_norm", "wqkv", "w_gate_up"} <= set(lp)
             and fits(rows, *lp["wqkv"].shape) and fits(rows, *lp["w_gate_up"].shape)
             for lp in layers)


def layers(config, params: dict, x: Float[Array, "B T D"], attend, carry,
           keep_after: tuple[int, ...] = ()):
  """The decoder layers of a few-token pass as the module's docstring draws them, where
  `applies`: `(x, kept, carry)`, the residual stream after the last layer, after each
  layer of `keep_after` (a dict by layer), and the last `carry`. `attend(qkv, index, carry) ->
  (out [B, T, N, H], carry)` is the attention of layer `index` on its q|k|v product
  `[1, M, N + 2K, H]` (normed, before RoPE)."""
  pending, kept = None, {}  # pending: the last down product's parts, not added yet
  for index, lp in enumerate(params["layers"]):
    x, qkv = _anywhere(pending, x, lp["attn_norm"], lp["wqkv"], eps=config.rms_norm_eps)
    out, carry = attend(qkv.reshape(1, -1, qkv.shape[-1] // config.head_dim, config.head_dim),
                        index, carry)  # [B, T, N, H]
    out = out.reshape(*out.shape[:2], -1)  # --> [B, T, N H]
    x, act = _anywhere(linear_parts(out, lp["wo"], parts(out.shape[-1])), x, lp["mlp_norm"],
                       lp["w_gate_up"], eps=config.rms_norm_eps, gated=True)  # [B, T, F]
    pending = linear_parts(act, lp["w_down"], parts(act.shape[-1]))  # [Q, M, D]
    if index in keep_after:
      kept[index] = _added(x, pending)
  return _added(x, pending), kept, carry


def _added(x: Float[Array, "B T D"], parts: Float[Array, "Q M2 D"]) -> Float[Array, "B T D"]:
  """`x` plus the sum of a product's `parts`, rounded as `linear` rounds a product."""
  b, t, width = x.shape
  return x + parts.sum(axis=0)[:b * t].astype(x.dtype).reshape(b, t, width)
