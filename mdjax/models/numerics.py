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
