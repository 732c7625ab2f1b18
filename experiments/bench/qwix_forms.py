"""The contenders of `experiments.bench.qwix_products` (flag-free, so that tests import
them): one float32 matrix `w [D, F]` as mdjax and qwix quantize it, and the product each
computes with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mdjax.errors import MdjaxError
from mdjax.models import quantized
from experiments.bench import quality

DOT = (((1,), (0,)), ((), ()))  # x [M, D] @ w [D, F]


def import_qwix():
  """The qwix module, or a one-line error naming how to install it."""
  try:
    import qwix
  except ImportError as e:
    raise MdjaxError("this benchmark compares with qwix: python3 -m pip install --no-deps "
                     "qwix==0.1.8 (requirements-dev.txt has it)") from e
  return qwix


def contenders(w: jax.Array) -> dict:
  """name -> (weights, product(x, weights) [M, F] float32, dequantize(weights) [D, F]) for
  one float32 matrix `w [D, F]`."""
  qwix = import_qwix()

  def mdjax_product(x, q):
    return quantized.product(x, q, jnp.float32)

  def qwix_product(x, q):
    return qwix.dot_general(x, q, DOT, preferred_element_type=jnp.float32)

  def qwix_w8a8(x, q):
    return qwix.dot_general(qwix.quantize(x, jnp.int8, channelwise_axes=[0]), q, DOT,
                            preferred_element_type=jnp.float32)

  qwix8 = qwix.quantize(w, jnp.int8, channelwise_axes=[1])
  return {
      "float32": (w, lambda x, w: x @ w, lambda w: w),
      "mdjax int8": (quantized.quantize(w, 8), mdjax_product, quantized.dequantize),
      "qwix int8": (qwix8, qwix_product, qwix.dequantize),
      "qwix w8a8": (qwix8, qwix_w8a8, qwix.dequantize),
      "mdjax int4": (quantized.quantize(w, 4, quantized.INT4_GROUP, offsets=True),
                     mdjax_product, quantized.dequantize),
      "qwix int4": (qwix.quantize(w, jnp.int4, channelwise_axes=[1],
                                  tiled_axes={0: quantized.INT4_GROUP},
                                  calibration_method="minmax"), qwix_product, qwix.dequantize),
  }


def packed_bytes(weights) -> int:
  """Bytes of `weights` with 4-bit values two a byte (mdjax holds int4 one a byte on a
  CPU: `quality.weight_bytes`' packed count), its scales, offsets and zero points as
  they are."""
  if not isinstance(weights, import_qwix().QArray):
    return quality.weight_bytes(weights)["packed"]
  return sum(leaf.size // 2 if leaf.dtype == jnp.int4 else leaf.nbytes
             for leaf in jax.tree.leaves(weights))


def relative(a, b) -> float:
  """`a`'s largest distance from `b`, relative to `b`'s largest magnitude."""
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
