"""`tests/cpu_time.py`'s table: the workers' rows summed per file, largest first."""

import json

from tests import cpu_time


def test_the_table_sums_each_files_tests_over_the_workers(tmp_path):
  # (test id, own CPU s, its processes' CPU s, compiling s, tracing and lowering s)
  (tmp_path / "gw0.json").write_text(json.dumps([["tests/test_a.py::x", 1.0, 0.0, 0.5, 0.25],
                                                 ["tests/test_b.py::y", 2.0, 4.0, 0.0, 0.0]]))
  (tmp_path / "gw1.json").write_text(json.dumps([["tests/test_a.py::z", 3.0, 0.0, 1.5, 0.75]]))
  lines = cpu_time.table(tmp_path).splitlines()
  assert lines[2:] == ["| `tests/test_b.py` | 1 | 6 | 4 | 0 | 0 | 60.0% |",
                       "| `tests/test_a.py` | 2 | 4 | 0 | 2 | 1 | 40.0% |",
                       "| all | 3 | 10 | 4 | 2 | 1 | |"]
