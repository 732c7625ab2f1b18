"""`mdjax.sampling.kth_largest`, the top-k filter's threshold, against `jax.lax.top_k`:
ties, infinities, signed zeros, negative rows, k = 1 and k = V; the processors built
for a GPU (`jax.lax.top_k`, one sort for top-p) against the CPU's, ties at the boundary;
the one-pass log-softmax against `jax.nn.log_softmax`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import platform
from mdjax.sampling import SamplingParams, kth_largest, log_softmax, process_logits


@pytest.mark.parametrize("k", [1, 2, 7, 64, 1000])
def test_kth_largest_equals_top_k(k):
  x = jax.random.normal(jax.random.key(0), (6, 1000)) * 5
  x = (x.at[0, :10].set(-jnp.inf).at[1, 5].set(100.0).at[2].set(-3.0)  # a constant row
       .at[3, :100].set(jnp.inf).at[4, :500].set(0.0).at[4, 500:].set(-0.0)
       .at[5, 1:9].set(x[5, 0]))  # nine-way tie
  np.testing.assert_array_equal(kth_largest(x, k), jax.lax.top_k(x, k)[0][:, -1:])


@pytest.mark.parametrize("options", [dict(top_k=7), dict(top_p=0.3), dict(top_p=0.9),
                                     dict(top_k=40, top_p=0.5, min_p=0.05),
                                     dict(temperature=0.7, top_p=0.999), dict(top_p=1e-6)])
def test_gpu_processors_equal_the_cpus(options):
  """Built for a GPU, `process_logits` keeps exactly the CPU's tokens: logits rounded to
  a coarse grid tie in groups, so top-p's boundary falls inside a tie (the lower
  indices kept), and rows hold -inf, signed zeros and a constant row."""
  x = jnp.round(jax.random.normal(jax.random.key(1), (6, 500)) * 4) / 2  # [6, 500] many ties
  x = x.at[0, :10].set(-jnp.inf).at[1].set(1.5).at[2, :250].set(0.0).at[2, 250:].set(-0.0)
  params = SamplingParams(**options)
  with platform.building_for("gpu"):
    on_gpu = jax.jit(lambda x: process_logits(x, params))(x)
  np.testing.assert_array_equal(on_gpu, jax.jit(lambda x: process_logits(x, params))(x))
  assert (on_gpu > -jnp.inf).sum() < x.size  # something was filtered


def test_one_pass_log_softmax_equals_jaxs():
  """Built for a GPU, up to float32 rounding (relative 1e-6), with -inf logits (a removed
  token) and bfloat16 logits read as float32."""
  x = jax.random.normal(jax.random.key(2), (3, 4, 4096)) * 8
  x = x.at[0, 0, :100].set(-jnp.inf).at[1, 2].set(x[1, 2, 0])  # a constant row
  with platform.building_for("gpu"):
    on_gpu = jax.jit(lambda x: log_softmax(x))  # a trace of its own, built for a GPU
    np.testing.assert_allclose(on_gpu(x), jax.nn.log_softmax(x, axis=-1), rtol=1e-6, atol=1e-5)
    half = x.astype(jnp.bfloat16)
    np.testing.assert_allclose(on_gpu(half), jax.nn.log_softmax(half.astype(jnp.float32)),
                               rtol=1e-6, atol=1e-5)
