"""Where mdjax keeps what it derives once (`cache_dir`); writing directories
atomically: a reader sees the old directory or the new one, never half of either;
and a lock for writing one entry once when several processes (test workers, the
processes of a `jax.distributed` run) race to write it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import tempfile


def cache_dir() -> pathlib.Path:
  """`$MDJAX_CACHE`, else `~/.cache/mdjax`: converted GGUF copies, measured pass costs."""
  return pathlib.Path(os.environ.get("MDJAX_CACHE") or pathlib.Path.home() / ".cache" / "mdjax")


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


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
  """Yields a partial path beside `path` (same suffix, so writers that pick a format by
  it, like matplotlib, still do); when the block ends without an error, the partial
  file replaces `path` in one rename, so a reader (or a run stopped mid-write) never
  sees half a file. On an error, `path` is untouched and the partial file removed."""
  target = pathlib.Path(path)
  target.parent.mkdir(parents=True, exist_ok=True)
  partial = target.with_name(f".{target.stem}.{os.getpid()}.partial{target.suffix}")
  try:
    yield partial
    os.replace(partial, target)
  finally:
    partial.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
  """`text` at `path`, written atomically (`atomic_file`)."""
  with atomic_file(path) as partial:
    partial.write_text(text)


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike):
  """Holds an exclusive `flock` on the file `path` (created if missing) for the block:
  one process at a time on this host, and across hosts on a filesystem that supports
  it (NFSv4, Lustre). Write-once entries check, under it, whether another process
  already wrote them."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)
