"""Shared pytest setup."""

import pathlib

import pytest

import mdjax

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
