"""Every matrix product of a float32 model runs in full float32 (`mdjax.models.numerics`);
`linear`, the weight product every layer uses, sums in float32 in any dtype and any shape.

On CPU XLA computes float32 products in float32 whatever the precision says, so the
tokens cannot show a mistake here; on an NVIDIA GPU JAX's default is TF32, which broke
`multi_question == sequential` and parity with transformers on the first GPU run. So
these tests read the programs themselves: every `dot_general` that mdjax lowers for
the model, its attention implementations, the LM head and the heads must ask for
HIGHEST precision. A product added without `full_float32` fails here.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax.cache import KVCache, write_layer
from mdjax.heads.eagle import eagle_inputs
from mdjax.heads.medusa import medusa_logits
from mdjax.models.numerics import linear
from mdjax.models.transformer import causal_logits
from mdjax.step import decode_step
from mdjax.topology import Topology
from tests.helpers import random_medusa_heads, random_model

DOT = re.compile(r"stablehlo\.dot_general .*")


def _dots(lowered) -> list[str]:
  dots = DOT.findall(lowered.as_text())
  assert dots, "no matrix product found: the test reads the wrong program"
  return dots


def _assert_full_float32(lowered):
  loose = [d for d in _dots(lowered) if "precision = [HIGHEST, HIGHEST]" not in d]
  assert not loose, "matrix products without full float32 precision:\n" + "\n".join(loose)


@pytest.mark.parametrize("attention", ["block_sparse", "dense", "fused"])
def test_decode_step_products_are_full_float32(attention):
  model = random_model()
  cache = KVCache.create(model.config, 1, 8)
  tokens = jnp.ones((1, 3), jnp.int32)  # [1, T]
  positions = jnp.arange(3, dtype=jnp.int32)[None]  # [1, T]
  segments = jnp.zeros((1, 3), jnp.int32)  # [1, T]
  _assert_full_float32(decode_step.lower(model.params, cache, tokens, positions, segments,
                                         Topology.causal(1), config=model.config,
                                         attention=attention))


def test_causal_forward_products_are_full_float32():
  model = random_model()
  tokens = jnp.ones((2, 5), jnp.int32)  # [B, T]
  _assert_full_float32(jax.jit(causal_logits, static_argnames="config").lower(
      model.params, tokens, config=model.config))


def test_heads_products_are_full_float32():
  model = random_model()
  heads = random_medusa_heads(model)
  hidden = jnp.ones((1, 2, model.config.hidden_size), jnp.float32)  # [B, T, D]
  _assert_full_float32(jax.jit(medusa_logits, static_argnames="model_config").lower(
      heads.params, model.params, hidden, model_config=model.config))
  d = model.config.hidden_size
  eagle = {"fc": jnp.ones((2 * d, d)), "fc_bias": jnp.zeros((d,))}  # [2D, D], [D]
  _assert_full_float32(jax.jit(eagle_inputs, static_argnames="model_config").lower(
      eagle, model.params, jnp.ones((1, 2), jnp.int32), hidden, model_config=model.config))


def test_products_outside_mdjax_keep_the_callers_precision():
  """The precision is scoped to mdjax's own functions: a caller's products are untouched."""
  x = jnp.ones((2, 3))
  (dot,) = _dots(jax.jit(lambda a: a @ a.T).lower(x))
  assert "HIGHEST" not in dot


@pytest.mark.parametrize("rows", [(1,), (1, 1), (3,), (2, 4)])
@pytest.mark.parametrize("transposed", [False, True])
def test_linear_sums_in_float32(rows, transposed):
  """bfloat16 operands, float32 sums rounded once (as transformers does), one row (which
  runs as two on CPU) or many, the weight [D, F] or transposed [F, D]; in float32 the
  product of an untransposed weight is exactly `x @ w`."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((*rows, 48)).astype(np.float32)  # [..., D]
  w = rng.standard_normal((48, 40)).astype(np.float32)  # [D, F]
  stored = lambda a: a.T.copy() if transposed else a
  x16 = jnp.asarray(x, jnp.bfloat16)
  w16 = jnp.asarray(stored(w), jnp.bfloat16)
  w_read = np.asarray(w16, np.float32)  # the bfloat16 values, as [D, F] or [F, D]
  reference = np.asarray(x16, np.float32) @ (w_read.T if transposed else w_read)  # [..., F]
  out = jax.jit(linear, static_argnames=("out_dtype", "transposed"))(x16, w16, jnp.float32,
                                                                     transposed=transposed)
  assert out.shape == (*rows, 40) and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), reference, rtol=1e-5, atol=1e-5)
  rounded = linear(x16, w16, transposed=transposed)  # x's dtype: rounded once
  assert rounded.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(rounded, np.float32),
                                np.asarray(jnp.asarray(out, jnp.bfloat16), np.float32))
  float32 = linear(jnp.asarray(x), jnp.asarray(stored(w)), transposed=transposed)
  if transposed:  # contracted in place: another summation order than `x @ w`
    np.testing.assert_allclose(np.asarray(float32), x @ w, rtol=1e-5, atol=1e-5)
  else:
    np.testing.assert_array_equal(np.asarray(float32), np.asarray(jnp.asarray(x) @ jnp.asarray(w)))


def test_a_bfloat16_cache_keeps_its_values():
  """On CPU a bfloat16 cache is stored in float32 (XLA:CPU writes bfloat16 arrays slowly):
  what is written reads back as the bfloat16 values; elsewhere it is bfloat16."""
  model = random_model()
  cache = KVCache.create(model.config, 1, 8, jnp.bfloat16)
  cpu = jax.default_backend() == "cpu"
  assert cache.k.dtype == (jnp.float32 if cpu else jnp.bfloat16)
  k = jnp.asarray(np.random.default_rng(1).standard_normal(
      (1, 2, model.config.num_kv_heads, model.config.head_dim)), jnp.bfloat16)  # [B, T, K, H]
  written = write_layer(cache, 0, jnp.asarray([[3, 5]]), k, k)
  np.testing.assert_array_equal(np.asarray(written.k[0, 0, jnp.asarray([3, 5])], np.float32),
                                np.asarray(k[0], np.float32))
