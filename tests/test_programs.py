"""mdjax's compiled programs (`mdjax.programs`): a bounded least-recently-used table
whose evictions and `clear_compiled` free mdjax's programs only."""

import gc
import pathlib

import jax
import pytest

import mdjax

MAPS = pathlib.Path("/proc/self/maps")
BUCKETS = {"a": 9, "b": 40, "c": 100}  # max_new_tokens of three output buckets: three programs


@pytest.fixture
def model():
  mdjax.clear_compiled()
  before = mdjax.compiled_cache_size()
  yield mdjax.load("random-llama-tiny")
  mdjax.set_compiled_cache_size(before)


def _generate(model, bucket: str) -> float:
  """Seconds `generate` spent compiling for `bucket` (0: its program was kept)."""
  return mdjax.generate(model, [1, 2, 3], max_new_tokens=BUCKETS[bucket]).stats["compile_s"]


def test_the_least_recently_used_program_is_evicted(model):
  mdjax.set_compiled_cache_size(2)
  _generate(model, "a")
  _generate(model, "b")
  program_a, program_b = mdjax.compiled_programs()
  assert _generate(model, "a") == 0  # a is now the most recently used
  assert mdjax.compiled_programs() == [program_b, program_a]
  _generate(model, "c")
  assert mdjax.compiled_programs()[0] is program_a  # b went
  assert _generate(model, "a") == 0 and _generate(model, "b") > 0


def test_the_cache_size_option_trims_and_bounds(model):
  _generate(model, "a")
  _generate(model, "b")
  mdjax.set_compiled_cache_size(1)
  assert mdjax.compiled_cache_size() == 1
  (kept,) = mdjax.compiled_programs()
  assert _generate(model, "b") == 0 and mdjax.compiled_programs() == [kept]
  mdjax.set_compiled_cache_size(0)
  assert mdjax.compiled_programs() == [] and _generate(model, "b") > 0
  assert mdjax.compiled_programs() == []
  for bad in (-1, 1.5, True, "8"):
    with pytest.raises(mdjax.MdjaxError, match="compiled cache size"):
      mdjax.set_compiled_cache_size(bad)


@pytest.mark.skipif(not MAPS.exists(), reason="counts the process's memory mappings (Linux)")
def test_an_evicted_program_frees_its_code(model):
  """Each program is compiled from a jit of its own, so nothing in JAX keeps it alive."""
  mdjax.set_compiled_cache_size(1)
  _generate(model, "a")
  gc.collect()
  with_one = MAPS.read_text().count("\n")
  mdjax.set_compiled_cache_size(0)
  gc.collect()
  assert MAPS.read_text().count("\n") < with_one - 50  # ~400 mappings per program on CPU


def test_clear_compiled_keeps_the_callers_own_programs(model):
  traces = []

  @jax.jit
  def double(x):
    traces.append(x)
    return 2 * x

  double(1.0)
  mdjax.forward_logits(model, [1, 2, 3])  # decode_step's own cache
  list(mdjax.stream(model, [1, 2, 3], max_new_tokens=2))
  _generate(model, "a")
  assert mdjax.decode_step._cache_size() > 0
  mdjax.clear_compiled()
  assert mdjax.compiled_programs() == [] and mdjax.decode_step._cache_size() == 0
  assert double._cache_size() == 1
  assert double(3.0) == 6.0 and len(traces) == 1  # neither traced nor compiled again
  assert _generate(model, "a") > 0
