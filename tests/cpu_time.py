"""CPU seconds per test file, the processes a test starts included: a pytest plugin and
the table it feeds (docs/testing.md's "Time per file").

    PYTEST_ADDOPTS="-p tests.cpu_time" MDJAX_CPU_TIME_DIR=/tmp/cpu bash .ci/run
    python3 -m tests.cpu_time /tmp/cpu          # the markdown table, largest first

The two workers share two cores, so a test's wall time (the junit XML's) counts what
the other worker did meanwhile, and a test that starts processes (a benchmark, a
notebook, a multi-process run) uses more than its wall time. The CPU time of the test's
process and of the processes it waited for is what the test costs the run; the run's
wall time is about their sum over the two cores.
"""

import collections
import json
import os
import pathlib
import resource
import sys

import pytest

from mdjax import files

DIRECTORY = "MDJAX_CPU_TIME_DIR"
_rows: list[tuple[str, float, float]] = []  # (test id, own CPU s, its processes' CPU s)


def _cpu_seconds() -> tuple[float, float]:
  own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  own, children = _cpu_seconds()
  yield
  own_after, children_after = _cpu_seconds()
  _rows.append((item.nodeid, own_after - own, children_after - children))


def pytest_sessionfinish(session):
  """Each worker's rows to <MDJAX_CPU_TIME_DIR>/<worker>.json. A pytest that a test
  starts (tests/test_sharding.py's) inherits the plugin and a worker's name but is no
  worker: it writes nothing, its time being the starting test's processes'."""
  directory = os.environ.get(DIRECTORY)
  workerinput = getattr(session.config, "workerinput", None)
  if workerinput is None and "PYTEST_XDIST_WORKER" in os.environ:
    return
  if directory and _rows:
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    worker = workerinput["workerid"] if workerinput else "main"
    files.write_text(path / f"{worker}.json", json.dumps(_rows))


def table(directory: pathlib.Path) -> str:
  """Per file: tests, CPU seconds (own and its processes') and share, largest first."""
  files = collections.defaultdict(lambda: [0, 0.0, 0.0])
  for path in sorted(directory.glob("*.json")):
    for test, own, children in json.loads(path.read_text()):
      row = files[test.split("::")[0]]
      row[0] += 1
      row[1] += own
      row[2] += children
  total = sum(own + children for _, own, children in files.values())
  lines = ["| file | tests | CPU s | of which its processes | share |", "|---|--:|--:|--:|--:|"]
  for name, (tests, own, children) in sorted(files.items(), key=lambda f: -sum(f[1][1:])):
    lines.append(f"| `{name}` | {tests} | {own + children:.0f} | {children:.0f} | "
                 f"{(own + children) / total:.1%} |")
  lines.append(f"| all | {sum(f[0] for f in files.values())} | {total:.0f} | "
               f"{sum(f[2] for f in files.values()):.0f} | |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(table(pathlib.Path(sys.argv[1])))
