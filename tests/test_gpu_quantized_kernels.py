"""Quantized weights in a few-token pass on a GPU (`mdjax.models.decode_products`,
`mdjax.models.weight_tiles`): the normed-product and residual-product kernels with int8
(a scale per column) and int4 weights (groups along the input, with and without an
offset; held as int8 and as int4) give the float product of the dequantized weight (run
on this CPU in Pallas' interpret mode) and compile for an H200; and the 1B `decode_step`
in int8 and int4, compiled for an H200, launches the bfloat16 step's five kernels in
each layer, none of them writing a float copy of a weight."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import compile_targets, hlo_report, platform, program_report
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.models import decode_products, quantized, weight_tiles
from mdjax.models.quantized import QuantizedWeight
from mdjax.models.random_init import init_params
from tests.test_gpu_kernels import CONFIGS, KERNELS_IN_A_LAYER, TARGET

WIDTH, OUT_WIDTH = 96, 80  # as tests/test_gpu_kernels.py: blocks narrower than the widest
SCHEMES = {  # bits, group (None: one, a scale per column), offset, q held as int4
    "int8": (8, None, False, False),
    "int4": (4, 32, False, False),  # three groups: blocks of 32, each its own scale
    "int4_offset": (4, 16, True, False),  # GGUF's asymmetric form, blocks of a Triton tile
    "int4_held": (4, 32, False, True),  # q as a GPU holds it
}


def _weight(rng, shape, scheme: str, dtype) -> QuantizedWeight:
  bits, group, offset, held = SCHEMES[scheme]
  w = jnp.asarray(rng.normal(size=shape, scale=shape[0]**-0.5), dtype)
  weight = quantized.quantize(w, bits, group)
  if offset:
    weight = dataclasses.replace(weight, offset=0.3 * weight.scale)
  return dataclasses.replace(weight, q=weight.q.astype(jnp.int4)) if held else weight


# Against the product with the dequantized weight in float32: the kernel multiplies the
# same operand (x's norm in the activations' dtype) by q, exact in that dtype, and scales
# each block's float32 sum by its group's scale: equal up to float32 summation order
# (1e-5 of outputs up to ~4). The gated activation rounds gate and up to bfloat16 first,
# where a float32 difference may round the other way: relatively 1/64, as for a float
# weight (tests/test_gpu_kernels.py).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("batch, tokens", [(1, 1), (4, 8)])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_the_normed_product_kernel_gives_the_dequantized_product(dtype, scheme, batch, tokens,
                                                                 gated):
  rng = np.random.default_rng(0)
  weight = _weight(rng, (WIDTH, OUT_WIDTH * (2 if gated else 1)), scheme, dtype)
  parts = jnp.asarray(rng.normal(size=(2, max(2, batch * tokens), WIDTH)), jnp.float32)
  residual = jnp.asarray(rng.normal(size=(batch, tokens, WIDTH)), dtype)
  norm = jnp.asarray(rng.normal(size=(WIDTH,)), dtype)
  got = decode_products.normed_product(parts, residual, norm, weight, eps=1e-6, gated=gated,
                                       interpret=True)
  expected = decode_products.reference(parts, residual, norm, quantized.dequantize(weight),
                                       eps=1e-6, gated=gated)
  assert got[1].shape == expected[1].shape == (batch, tokens, OUT_WIDTH)
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(expected[0], np.float32))
  assert np.abs(np.asarray(expected[1], np.float32)).max() > 1
  bfloat16_gated = gated and dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(expected[1], np.float32),
                             rtol=1 / 64 if bfloat16_gated else 0, atol=1e-5 if gated else 1e-4)


# The kernel rounds its float32 sum to the residual's dtype, then adds: in bfloat16 that
# sum, equal to the dequantized product's up to float32 order, may round the other way,
# and the result then differs by a unit in its last place (2^-7 relatively at most;
# 2^-6 absolutely near zero, where the residual's own rounding dominates).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 3), (4, 8)])
def test_the_residual_product_kernel_gives_the_dequantized_product(dtype, scheme, batch, tokens):
  rng = np.random.default_rng(1)
  weight = _weight(rng, (WIDTH, OUT_WIDTH), scheme, dtype)
  residual = jnp.asarray(rng.normal(size=(batch, tokens, OUT_WIDTH)), dtype)
  a = jnp.asarray(rng.normal(size=(batch, tokens, WIDTH)), dtype)
  got = decode_products.residual_product(residual, a, weight, interpret=True)
  expected = decode_products.residual_reference(residual, a, quantized.dequantize(weight))
  assert got.shape == residual.shape and got.dtype == dtype
  assert not np.allclose(np.asarray(expected, np.float32), np.asarray(residual, np.float32))
  exact = dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                             rtol=0 if exact else 2**-7, atol=1e-5 if exact else 2**-6)


def test_a_walk_takes_blocks_within_a_group():
  assert decode_products.block_columns(2048, 1, 2, True, 2) == 128
  assert decode_products.block_columns(2048, 1, 2, True, 2, group=64) == 64
  assert decode_products.block_columns(2048, 1, 2, True, 2, group=2048) == 128
  assert decode_products.residual_block(8192, 1, 2, 2, group=64) == 64
  assert decode_products.residual_block(8192, 1, 2, 2, group=32) == 32


def _abstract(shape, bits: int, group: int | None, offset: bool = False) -> QuantizedWeight:
  """A weight held as a GPU holds it, shapes only."""
  groups = jax.ShapeDtypeStruct((1 if group is None else shape[0] // group, shape[1]),
                                jnp.float32)
  return QuantizedWeight(q=jax.ShapeDtypeStruct(shape, jnp.int8 if bits == 8 else jnp.int4),
                         scale=groups, offset=groups if offset else None, axis=-2, bits=bits,
                         dtype=jnp.dtype(jnp.bfloat16))


def _float_copies(text: str, shape) -> list[str]:
  """The lines of an optimized program that hold a float array of a weight's `shape`."""
  names = [f"{kind}[{shape[0]},{shape[1]}]" for kind in ("bf16", "f16", "f32")]
  return [line for line in text.splitlines() if any(name in line for name in names)]


@pytest.mark.parametrize("bits, group, offset, rows, num_parts, gated", [
    (8, None, False, 1, 2, True), (8, None, False, 32, 8, False), (4, 64, False, 1, 0, True),
    (4, 64, False, 32, 0, True), (4, 32, True, 32, 0, True)])
def test_the_normed_product_kernel_compiles_for_an_h200_on_quantized_weights(
    bits, group, offset, rows, num_parts, gated):
  """At one row and at the most rows, within the H200's shared memory (a Triton compile
  error otherwise), reading the weight as it is held: no float array of its shape."""
  width, out_width = 2048, 16384 if gated else 3072
  args = (jax.ShapeDtypeStruct((num_parts, max(rows, 2), width), jnp.float32)
          if num_parts else None,
          jax.ShapeDtypeStruct((1, rows, width), jnp.bfloat16),
          jax.ShapeDtypeStruct((width,), jnp.bfloat16),
          _abstract((width, out_width), bits, group, offset))
  product = jax.jit(functools.partial(decode_products.normed_product, eps=1e-6, gated=gated))
  with platform.building_for("gpu"):
    text = compile_targets.compile_for(product, TARGET, *args).as_text()
  assert decode_products.KERNEL_NAME in text
  assert not _float_copies(text, (width, out_width))


@pytest.mark.parametrize("bits, group, rows", [(8, None, 3), (4, 64, 1), (4, 64, 32)])
def test_the_residual_product_kernel_compiles_for_an_h200_on_quantized_weights(bits, group,
                                                                               rows):
  """A 1B llama's down product: one kernel with nothing around it."""
  args = (jax.ShapeDtypeStruct((1, rows, 2048), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, rows, 8192), jnp.bfloat16), _abstract((8192, 2048), bits, group))
  with platform.building_for("gpu"):
    text = compile_targets.compile_for(jax.jit(decode_products.residual_product), TARGET,
                                       *args).as_text()
  assert decode_products.RESIDUAL_NAME in text
  assert hlo_report.read(text).kernels == 1


def test_quantized_layers_run_the_kernels_and_int4s_products_come_whole():
  """int8's and int4's (groups of 16, whole Triton tiles) layers take the kernels; int4's
  output and down products come through a residual product, int8's in parts at one row;
  groups narrower than a Triton tile, and a head's layout, do not."""
  config = CONFIGS["llama"]
  float_params = init_params(config, 0, jnp.bfloat16)
  int8, int4 = (quantized.quantize_params(float_params, scheme, group)
                for scheme, group in (("int8", None), ("int4", 16)))
  with platform.building_for("gpu"):
    assert decode_products.applies(config, int8, 1) and decode_products.applies(config, int4, 1)
    narrow = quantized.quantize_params(float_params, "int4", 8)
    assert not decode_products.applies(config, narrow, 1)
  layer8, layer4 = int8["layers"][0], int4["layers"][0]
  assert decode_products.feeding_parts(1, layer8["wo"], layer8["w_gate_up"], True) == 2
  assert decode_products.feeding_parts(1, layer4["wo"], layer4["w_gate_up"], True) == 0
  assert weight_tiles.value_bytes(_abstract((64, 64), 4, 16)) == 0.5
  assert not weight_tiles.takes(quantized.quantize(float_params["embed"], 8, axis=-1))


@functools.cache
def _one_token_step(batch: int, scheme: str, num_layers: int = 16):
  config = dataclasses.replace(RANDOM_MODELS["random-llama-1b"], num_layers=num_layers)
  compiled, _ = program_report.compile_decode_step(
      TARGET, config, batch=batch, tokens=1, slots=1024, segments=4, layer_loop="unrolled",
      quantize=scheme)
  return compiled.as_text()


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_1b_one_token_step_launches_the_bfloat16_steps_kernels(batch, scheme):
  """A layer's kernels (the 16-layer step's less the 2-layer one's, per layer) as many as
  bfloat16's; mdjax's own three a layer, and two residual products more where a product
  comes whole (int4; batch 8: `takes_parts`); no float copy of a layer's weight."""
  text = _one_token_step(batch, scheme)
  counts = hlo_report.read(text)
  in_a_layer = (counts.kernels - hlo_report.read(_one_token_step(batch, scheme, 2)).kernels) / 14
  assert in_a_layer <= KERNELS_IN_A_LAYER[batch]
  whole = scheme == "int4" or batch == 8
  assert counts.kernels_by_kind["custom-call"] == (5 if whole else 3) * 16
  for shape in ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)):
    assert not _float_copies(text, shape), shape
