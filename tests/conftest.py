"""Shared pytest setup."""

import os
import pathlib
import shutil
import tempfile

# The suite's models are tiny, so its time is XLA compiling hundreds of programs;
# without LLVM's optimisation passes that is ~30% faster, and with XLA:CPU's older
# fusion emitters (LLVM IR directly, not through MLIR) small programs take ~45% less
# CPU again, a real model's ~15% more (CHANGELOG.md, 2026-11-27); and with the LLVM module
# compiled whole rather than split into parts for threads (which two workers on two cores
# never run at once) ~9% less again (test_medusa, test_mixed and test_program_syncs: 120
# CPU s against 132). Set before jax starts its
# backend; subprocesses (benchmarks, the CLI) inherit it, all but the TPU notebook's
# kernel, which runs more than it compiles (tests/test_notebooks.py takes these two
# flags out of its environment). Results are checked between strategies under the same
# compiler, never against recorded floats of an optimised build (the shipped models'
# recorded accuracies have a tolerance).
# The suite runs on the CPU, even where jax's CUDA plugin is installed (it is, for the
# GPU program report's tests: requirements-compile-targets.txt), and every process it
# starts inherits that; the accelerator checks on a GPU set JAX_PLATFORMS themselves
# (experiments/device_check/).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The oracle (transformers on torch) and numpy's BLAS one thread each: the two workers
# already fill the two cores, and torch's thread per core then stalls at every operation
# (a benchmark's transformers calls: 10 s against 0.7 s with one thread, measured).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Only on the CPU: a jaxlib that does not know a flag aborts at its backend's start
# (jax 0.11.2 on an H100 lost every test worker to `--xla_cpu_use_fusion_emitters`).
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ["XLA_FLAGS"] = " ".join(
      filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0",
                    "--xla_cpu_use_fusion_emitters=false",
                    "--xla_cpu_parallel_codegen_split_count=1"]))
# `tree_budget="auto"` sizes trees by a measured pass cost: the suite pins a flat one
# (a GPU-like device, where the widest trees pay), so no test pays a measurement and
# every test's tree is the same on any machine; tests/test_tree_auto.py measures.
os.environ["MDJAX_PASS_COST"] = "1,1,1,1,1,1,1"
# Most of those programs are compiled again and again: by each worker, by the
# subprocesses the suite starts (CLIs, notebooks, benchmarks, multi-process runs), and
# after each module frees its programs (below). JAX's persistent compilation cache,
# one per test run (the workers and subprocesses inherit it; removed at the end),
# compiles each distinct program once. A user's own cache directory is left alone.
OWN_XLA_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if OWN_XLA_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mdjax-tests-xla-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

import mdjax  # noqa: E402

# The fixtures that load a real model from its GGUF package (requirements-models.txt).
REAL_MODEL_FIXTURES = {"smollm2", "gemma3_270m"}


# Files that take a minute or more, started first, so that the two workers
# (`--dist loadfile`) end together rather than one running the 8-device subprocess
# alone at the end; the two multi-process files (three processes each, on heartbeat
# timeouts) are five files apart, so that they do not run at the same time.
SLOW_FILES = ("test_bench_smoke.py", "test_sharding.py", "test_distributed.py", "test_gguf.py",
              "test_cli_configs.py", "test_speculative.py", "test_notebooks.py",
              "test_distributed_train.py")


def pytest_collection_modifyitems(items):
  """A test that uses a real model's fixture is marked `real_models`; the slow files
  run first (`SLOW_FILES`), the rest in their usual order."""
  for item in items:
    if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
      item.add_marker(pytest.mark.real_models)
  rank = {name: i for i, name in enumerate(SLOW_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


def pytest_collection_finish(session):
  """Python's collector walks less (`tests.collector.collect_rarely`) once every test's
  imports are done."""
  from tests.collector import collect_rarely
  collect_rarely()


MAPS = pathlib.Path("/proc/self/maps")
MAX_MAPPINGS = 30_000  # of the kernel's usual vm.max_map_count of 65530


def _free_programs():
  """mdjax's programs and, as only the process's owner may, every other JAX cache."""
  mdjax.clear_compiled()
  jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_per_module():
  """The suite compiles hundreds of XLA programs in one process. mdjax keeps at most
  `mdjax.compiled_cache_size()` of its own per table, but the tests' own jitted
  functions and JAX's caches of eager operations keep theirs; keeping all of them
  mapped exhausts vm.max_map_count, which aborts the compiler mid-suite. Each
  module's programs are freed after it."""
  yield
  _free_programs()


@pytest.fixture(autouse=True)
def _free_compiled_programs_when_many():
  """Within a long module too, once the process holds many memory mappings."""
  yield
  if MAPS.exists() and MAPS.read_text().count("\n") > MAX_MAPPINGS:
    _free_programs()


def pytest_sessionfinish(session):
  """The run's compilation cache goes with it (removed by the process that made it: the
  xdist controller, or the one process without xdist)."""
  if OWN_XLA_CACHE and not hasattr(session.config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
