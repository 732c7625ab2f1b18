"""Writing directories atomically: a reader sees the old directory or the new one,
never half of either."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike):
  """Yields an empty staging directory beside `path`; when the block ends without an
  error, the staging directory replaces `path` (an existing one is swapped out and
  removed). On an error, `path` is untouched and the staging directory is removed."""
  target = pathlib.Path(path).resolve()
  target.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
  try:
    yield staging
    if target.exists():
      old = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
      os.rename(target, old / target.name)
      try:
        os.rename(staging, target)
      except OSError:
        os.rename(old / target.name, target)
        raise
      finally:
        shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(staging, target)
  finally:
    if staging.exists():
      shutil.rmtree(staging)
