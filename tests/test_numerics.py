"""Every matrix product of a float32 model runs in full float32 (`mdjax.models.numerics`).

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
import pytest

from mdjax.cache import KVCache
from mdjax.heads.eagle import eagle_inputs
from mdjax.heads.medusa import medusa_logits
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
