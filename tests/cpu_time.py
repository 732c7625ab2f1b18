"""CPU seconds per test file, the processes a test starts included, and the seconds of
them that JAX spent compiling: a pytest plugin and the table it feeds (docs/testing.md's
"Time per file").

    PYTEST_ADDOPTS="-p tests.cpu_time" MDJAX_CPU_TIME_DIR=/tmp/cpu bash .ci/run
    python3 -m tests.cpu_time /tmp/cpu          # the markdown table, largest first

The two workers share two cores, so a test's wall time (the junit XML's) counts what
the other worker did meanwhile, and a test that starts processes (a benchmark, a
notebook, a multi-process run) uses more than its wall time. The CPU time of the test's
process and of the processes it waited for is what the test costs the run; the run's
wall time is about their sum over the two cores. In the test's own process, JAX's
monitoring events give the wall seconds spent tracing and lowering programs and those
spent compiling them (which include reading a program from the persistent cache, and
for a GPU target the ptxas runs it waits for).
"""

import collections
import json
import os
import pathlib
import resource
import sys

import jax
import pytest

from mdjax import files

DIRECTORY = "MDJAX_CPU_TIME_DIR"
# (test id, own CPU s, its processes' CPU s, XLA compiling s, tracing and lowering s)
_rows: list[tuple[str, float, float, float, float]] = []
COMPILING = ("/jax/core/compile/backend_compile_duration",)
TRACING = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration")
_seconds = collections.Counter()  # event -> seconds so far


def _count(event: str, duration: float, **_):
  _seconds[event] += duration


jax.monitoring.register_event_duration_secs_listener(_count)


def _cpu_seconds() -> tuple[float, float]:
  own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  own, children = _cpu_seconds()
  _seconds.clear()
  yield
  own_after, children_after = _cpu_seconds()
  _rows.append((item.nodeid, own_after - own, children_after - children,
                sum(_seconds[e] for e in COMPILING), sum(_seconds[e] for e in TRACING)))


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
  """Per file: tests, CPU seconds (its own process's and its processes'), seconds of
  XLA compiling and of tracing and lowering in its own process, share of the CPU
  seconds; largest first."""
  per_file = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
  for path in sorted(directory.glob("*.json")):
    for test, *seconds in json.loads(path.read_text()):
      row = per_file[test.split("::")[0]]
      row[0] += 1
      for i, value in enumerate(seconds, 1):
        row[i] += value
  total = sum(row[1] + row[2] for row in per_file.values())
  lines = ["| file | tests | CPU s | of which its processes | compiling | tracing, lowering "
           "| share |", "|---|--:|--:|--:|--:|--:|--:|"]
  for name, (tests, own, children, compiling, tracing) in sorted(
      per_file.items(), key=lambda f: -(f[1][1] + f[1][2])):
    lines.append(f"| `{name}` | {tests} | {own + children:.0f} | {children:.0f} | "
                 f"{compiling:.0f} | {tracing:.0f} | {(own + children) / total:.1%} |")
  sums = [sum(row[i] for row in per_file.values()) for i in range(5)]
  lines.append(f"| all | {sums[0]} | {total:.0f} | {sums[2]:.0f} | {sums[3]:.0f} | "
               f"{sums[4]:.0f} | |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(table(pathlib.Path(sys.argv[1])))
