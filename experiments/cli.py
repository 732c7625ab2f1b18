"""What the entry points share: bad input (an `MdjaxError`, a missing optional package,
a file that cannot be read) is one `error: ...` line on stderr, no traceback, exit code
1; many processes (`config.distributed`, `start_processes`), of which only process 0
prints; and the training entry points' `main`, which runs a config and prints its
summary as JSON."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Callable

from absl import flags, logging

from mdjax import distributed


def fail(message: object, code: int = 1):
  """Prints `message` as one `error: ...` line on stderr and exits with `code`."""
  print("error: " + " ".join(str(message).split()), file=sys.stderr)
  sys.exit(code)


def one_line_errors(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
  """`main` for `app.run`, a `ValueError` (an `MdjaxError`, `MissingPackageError`
  included) or `OSError` escaping it printed by `fail`: one line, exit code 1."""

  @functools.wraps(main)
  def wrapped(argv):
    try:
      main(argv)
    except (ValueError, OSError) as e:
      fail(e)

  return wrapped


def start_processes(config) -> None:
  """`config.distributed` ("" = one process, "auto" = JAX's cluster detection,
  "HOST:PORT,NUM_PROCESSES,PROCESS_ID"; a config without the field runs as one
  process): joins JAX's multi-controller runtime (`mdjax.distributed`). Every process
  runs the same command; only process 0 prints (the others' stdout, Python's and the
  collectives' own lines, goes to /dev/null; errors still reach each one's stderr)."""
  distributed.initialize_from_flag(config.get("distributed", ""))
  if not distributed.is_main_process():
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def check_argv(argv: list[str]) -> None:
  """What every entry point does first: stray arguments exit 2; absl logs only
  warnings unless `--verbosity` is given."""
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]!r}", 2)
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def json_main(run: Callable[[object], dict], config_flag) -> Callable[[list[str]], None]:
  """`main(argv)` for `app.run`: `run(config_flag.value)`, its summary printed as JSON;
  bad input is one line (`one_line_errors`); `check_argv` first."""

  @one_line_errors
  def main(argv):
    check_argv(argv)
    start_processes(config_flag.value)
    print(json.dumps(run(config_flag.value)))

  return main
