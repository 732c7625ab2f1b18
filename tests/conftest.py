"""Shared pytest setup."""

import os
import pathlib

# The suite's models are tiny, so its time is XLA compiling hundreds of programs;
# without LLVM's optimisation passes that is ~30% faster. Set before jax starts its
# backend; subprocesses (benchmarks, the CLI) inherit it. Results are checked
# between strategies under the same compiler, never against recorded floats of an
# optimised build (the shipped models' recorded accuracies have a tolerance).
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))

import pytest  # noqa: E402

import mdjax  # noqa: E402

MAPS = pathlib.Path("/proc/self/maps")
MAX_MAPPINGS = 30_000  # of the kernel's usual vm.max_map_count of 65530


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_per_module():
  """The suite compiles hundreds of XLA programs in one process; keeping all of them
  mapped exhausts vm.max_map_count, which aborts the compiler mid-suite. Each
  module's programs are freed after it."""
  yield
  mdjax.clear_compiled()


@pytest.fixture(autouse=True)
def _free_compiled_programs_when_many():
  """Within a long module too, once the process holds many memory mappings."""
  yield
  if MAPS.exists() and MAPS.read_text().count("\n") > MAX_MAPPINGS:
    mdjax.clear_compiled()
