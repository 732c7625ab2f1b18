"""Float32 means float32 on every platform.

JAX lets a platform compute a float32 matrix product with fewer mantissa bits: an
NVIDIA GPU from Ampere on uses TF32 (10 bits), a TPU one bfloat16 pass (7 bits). That
is harmless for training throughput but not for mdjax's contract: a branch decoded in
a shared cache must get exactly the logits it gets alone, and a float32 model must
match transformers to ~1e-5. TF32 rounding differs between two batch shapes (another
kernel, another tiling) by ~1e-3, enough to flip a close argmax: on an H200 the first
run of mdjax gave `multi_question` answers that differed from the questions decoded
one by one, and float32 logits ~1e-3 from transformers'.

`full_float32` makes every matrix product traced inside the wrapped function use the
full float32 algorithm. On CPU that is what XLA does anyway. bfloat16 models are not
slowed: their weight products take bfloat16 operands (accumulated in float32), for
which no lower-precision algorithm exists; what they compute in float32 (attention
scores, the softmax-weighted values) is then exact float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mdjax.models import quantized

MATMUL_PRECISION = "float32"  # `jax.default_matmul_precision`: no TF32, no bfloat16 passes


def full_float32(fn):
  """`fn` with every matrix product it traces in full float32 (see the module's
  docstring); works inside and outside `jax.jit`, since JAX reads the precision when
  it traces the product."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.default_matmul_precision(MATMUL_PRECISION):
      return fn(*args, **kwargs)

  return wrapped



def linear(x: jax.Array, weight: jax.Array, out_dtype=None, *,
           transposed: bool = False) -> jax.Array:
  """`x @ weight` ([..., D] @ [D, F] -> [..., F]; `transposed`: `weight` is [F, D], as a
  tied embedding serves as the unembedding) accumulated in float32, returned in
  `out_dtype` (None: `x`'s dtype), as transformers computes a bfloat16 linear layer.

  A one-row bfloat16 product is computed as two rows (the row broadcast), on every
  platform. XLA:CPU, measured on a 2-core AVX-512 server with a 576 x 49,152 weight:
  a bfloat16 product that outputs bfloat16, or that has one row, takes a slow path
  (~42 ms), while 2 to 16 rows with a float32 output take 3.5-5.3 ms (about float32's
  one-row product, 3.4 ms, and flat in the row count, where float32's few-row product
  doubles it). XLA:GPU, compiled for an H200 (`experiments/program_report.py`,
  random-llama-1b, 1 token): a one-row product becomes a multiply and a reduce, and
  for `wo` the multiply is its own kernel that writes a float32 [2048, 2048] (16 MiB per
  layer, written and read again); two rows are one Triton product (split in K, its
  partial sums added in the next kernel), 341 kernels per pass become 326. A
  transposed weight is contracted in place (XLA:CPU's `weight.T @` costs 44 ms in
  bfloat16, 5.5 ms in float32, against 3.3 ms). GPUs and TPUs accumulate bfloat16
  products in float32 anyway: the result is `x @ weight` up to summation order.

  A `mdjax.models.quantized.QuantizedWeight` is multiplied as its value, without a
  float copy of it (`quantized.product`; its `axis` says which axis is contracted)."""
  out_dtype = x.dtype if out_dtype is None else out_dtype
  if quantized.is_quantized(weight):
    return quantized.product(x, weight, out_dtype)
  rows, single = _rows(x, weight.dtype)  # [M, D]
  contract = (((1,), (1 if transposed else 0,)), ((), ()))
  out = jax.lax.dot_general(rows.astype(weight.dtype), weight, contract,
                            preferred_element_type=jnp.float32)  # [M, F]
  out = out[:1] if single else out
  return out.reshape(*x.shape[:-1], out.shape[-1]).astype(out_dtype)


def _rows(x: jax.Array, dtype) -> tuple[jax.Array, bool]:
  """`x`'s rows `[M, D]` as `linear` multiplies them by a weight of `dtype`, and whether
  they are one bfloat16 row computed as two (see `linear`)."""
  rows = x.reshape(-1, x.shape[-1])  # [M, D]
  single = (dtype == jnp.bfloat16 and rows.shape[0] == 1)
  if single:
    rows = jnp.broadcast_to(rows, (2, rows.shape[1]))  # [2, D]
  return rows, single


def linear_parts(x: jax.Array, weight: jax.Array, parts: int) -> jax.Array:
  """`linear(x, weight, jnp.float32)` as `parts` partial products over consecutive
  slices of D, not summed yet: `[parts, M, F]` float32 for `x`'s rows `[M, D]` (its
  leading axes flattened; one bfloat16 row: M = 2, the row twice, as `linear`
  computes it). XLA:GPU computes a few-row product split in K like this and adds the
  parts in the kernel that reads them; a Pallas kernel that reads them can add them
  itself (`mdjax.models.decode_attention`), and the sum is one kernel fewer. A quantized
  weight gives its parts scaled (`quantized.product_parts`)."""
  rows, _ = _rows(x, weight.dtype)
  if quantized.is_quantized(weight):
    return quantized.product_parts(rows, weight, parts)
  return _parts(rows, weight, parts)


def _parts(rows: jax.Array, weight: jax.Array, parts: int) -> jax.Array:
  """`[P, M, F]` float32 partial products of `rows [M, D]` over `parts` slices of D."""
  m, d = rows.shape
  contract = (((2,), (1,)), ((1,), (0,)))  # MPd,PdF->PMF
  return jax.lax.dot_general(rows.reshape(m, parts, d // parts).astype(weight.dtype),
                             weight.reshape(parts, d // parts, weight.shape[-1]), contract,
                             preferred_element_type=jnp.float32)  # [P, M, F]
