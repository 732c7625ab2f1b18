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
for a GPU target the ptxas runs it waits for), and how many programs it asked XLA for
and how many of those the run's persistent cache held (tests/conftest.py): a file that
shares its programs with others shows them there.
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
# what a row holds of its test, after the test's id (the table's columns but its share)
FIELDS = ("own CPU s", "its processes' CPU s", "XLA compiling s", "tracing and lowering s",
          "programs asked of XLA", "of them read from the persistent cache")
_rows: list[tuple] = []  # (test id, *FIELDS)
COMPILING = "/jax/core/compile/backend_compile_duration"
TRACING = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration")
CACHE_HIT = "/jax/compilation_cache/cache_hits"
_seconds = collections.Counter()  # event -> seconds so far
_events = collections.Counter()  # event -> how many so far


def _time(event: str, duration: float, **_):
  _seconds[event] += duration
  _events[event] += 1


def _count(event: str, **_):
  _events[event] += 1


jax.monitoring.register_event_duration_secs_listener(_time)
jax.monitoring.register_event_listener(_count)


def restart():
  """Counts JAX's events from now (a test's start)."""
  _seconds.clear()
  _events.clear()


def counted() -> tuple[float, float, int, int]:
  """Since `restart`: (seconds compiling, seconds tracing and lowering, programs asked
  of XLA, of them read from the persistent cache), `FIELDS`' last four."""
  return (_seconds[COMPILING], sum(_seconds[e] for e in TRACING), _events[COMPILING],
          _events[CACHE_HIT])


def _cpu_seconds() -> tuple[float, float]:
  own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  own, children = _cpu_seconds()
  restart()
  yield
  own_after, children_after = _cpu_seconds()
  _rows.append((item.nodeid, own_after - own, children_after - children, *counted()))


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
  XLA compiling and of tracing and lowering in its own process, the programs it
  asked XLA for and how many of them came from the run's cache, share of the CPU seconds;
  largest first."""
  per_file = collections.defaultdict(lambda: [0] * (1 + len(FIELDS)))  # [tests, *FIELDS]
  for path in sorted(directory.glob("*.json")):
    for test, *values in json.loads(path.read_text()):
      row = per_file[test.split("::")[0]]
      row[0] += 1
      for i, value in enumerate(values, 1):
        row[i] += value
  cpu = lambda row: row[1] + row[2]  # own and its processes' CPU s
  total = sum(map(cpu, per_file.values()))
  lines = ["| file | tests | CPU s | of which its processes | compiling | tracing, lowering "
           "| programs | from the cache | share |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]

  def cells(row) -> str:
    tests, _, children, compiling, tracing, programs, cached = row
    return (f"{tests} | {cpu(row):.0f} | {children:.0f} | {compiling:.0f} | "
            f"{tracing:.0f} | {programs} | {cached}")

  for name, row in sorted(per_file.items(), key=lambda f: -cpu(f[1])):
    lines.append(f"| `{name}` | {cells(row)} | {cpu(row) / total:.1%} |")
  lines.append(f"| all | {cells([sum(column) for column in zip(*per_file.values())])} | |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(table(pathlib.Path(sys.argv[1])))
