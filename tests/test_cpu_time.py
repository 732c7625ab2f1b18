"""`tests/cpu_time.py`'s table: the workers' rows summed per file, largest first."""

import json

import jax

from tests import cpu_time


def test_the_table_sums_each_files_tests_over_the_workers(tmp_path):
  # (test id, *cpu_time.FIELDS)
  (tmp_path / "gw0.json").write_text(json.dumps([
      ["tests/test_a.py::x", 1.0, 0.0, 0.5, 0.25, 3, 1],
      ["tests/test_b.py::y", 2.0, 4.0, 0.0, 0.0, 0, 0]]))
  (tmp_path / "gw1.json").write_text(json.dumps([
      ["tests/test_a.py::z", 3.0, 0.0, 1.5, 0.75, 5, 2]]))
  lines = cpu_time.table(tmp_path).splitlines()
  assert lines[2:] == ["| `tests/test_b.py` | 1 | 6 | 4 | 0 | 0 | 0 | 0 | 60.0% |",
                       "| `tests/test_a.py` | 2 | 4 | 0 | 2 | 1 | 8 | 3 | 40.0% |",
                       "| all | 3 | 10 | 4 | 2 | 1 | 8 | 3 | |"]


def test_the_plugin_counts_a_tests_compiles_and_its_cache_hits():
  """What the plugin records of a test: JAX's events, counted from the test's start."""
  jax.monitoring.record_event_duration_secs(cpu_time.COMPILING, 2.0)  # before: not counted
  cpu_time.restart()
  jax.monitoring.record_event_duration_secs(cpu_time.COMPILING, 0.5)
  jax.monitoring.record_event(cpu_time.CACHE_HIT)
  jax.monitoring.record_event_duration_secs(cpu_time.COMPILING, 0.25)
  jax.monitoring.record_event_duration_secs(cpu_time.TRACING[0], 0.125)
  assert cpu_time.counted() == (0.75, 0.125, 2, 1)
  cpu_time.restart()  # made-up events: not this test's, where the plugin records it
