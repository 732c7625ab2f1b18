"""`mdjax.sampling.kth_largest`, the top-k filter's threshold, against `jax.lax.top_k`:
ties, infinities, signed zeros, negative rows, k = 1 and k = V."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax.sampling import kth_largest


@pytest.mark.parametrize("k", [1, 2, 7, 64, 1000])
def test_kth_largest_equals_top_k(k):
  x = jax.random.normal(jax.random.key(0), (6, 1000)) * 5
  x = (x.at[0, :10].set(-jnp.inf).at[1, 5].set(100.0).at[2].set(-3.0)  # a constant row
       .at[3, :100].set(jnp.inf).at[4, :500].set(0.0).at[4, 500:].set(-0.0)
       .at[5, 1:9].set(x[5, 0]))  # nine-way tie
  np.testing.assert_array_equal(kth_largest(x, k), jax.lax.top_k(x, k)[0][:, -1:])
