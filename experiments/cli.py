"""What the training entry points share: an absl `main` that runs a config and prints
its summary as JSON, or one `error: ...` line for bad input."""

from __future__ import annotations

import json
import sys
from typing import Callable

from absl import flags, logging


def json_main(run: Callable[[object], dict], config_flag) -> Callable[[list[str]], None]:
  """`main(argv)` for `app.run`: `run(config_flag.value)`, its summary printed as JSON;
  a `ValueError` (an `MdjaxError`) or `OSError` prints one line and exits 1, stray
  arguments exit 2. absl logs only warnings unless `--verbosity` is given."""

  def main(argv):
    if len(argv) > 1:
      print(f"error: unexpected arguments {argv[1:]!r}", file=sys.stderr)
      sys.exit(2)
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    try:
      summary = run(config_flag.value)
    except (ValueError, OSError) as e:  # MdjaxError is a ValueError; OSError: files
      print("error: " + " ".join(str(e).split()), file=sys.stderr)
      sys.exit(1)
    print(json.dumps(summary))

  return main
