"""The one error type mdjax raises for bad input, and the checks that raise it.

`MdjaxError` subclasses `ValueError`, so callers that already catch `ValueError`
keep working; the CLI catches it and prints its message on one line.
"""

from __future__ import annotations

import importlib
import math
import numbers


class MdjaxError(ValueError):
  """Bad input to mdjax: the message names the offending value."""


class CheckpointError(MdjaxError):
  """A checkpoint directory is missing, incomplete, corrupt or unsupported."""


class MissingPackageError(MdjaxError, ImportError):
  """A package that one feature needs (and mdjax itself does not) is not installed; the
  message names it and the pip command. An `ImportError` too, for callers that catch
  those."""


def require(module: str, purpose: str, pip_spec: str | None = None):
  """Imports and returns `module`, or raises `MissingPackageError` saying that `purpose`
  needs it and how to install it (`pip_spec`, e.g. "torch==2.13.0"; default: `module`)."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise MissingPackageError(
        f"{purpose} needs the package {module!r}, which is not installed: "
        f"python3 -m pip install {pip_spec or module}") from e


def check_options(kind: str, name: str, options, allowed: tuple[str, ...]) -> None:
  """Raises `MdjaxError` for the first of `options` not in `allowed`, naming it, the
  strategy (or pipeline) `name` and the valid ones."""
  for option in options:
    if option not in allowed:
      raise MdjaxError(f"unknown option {option!r} for {kind} {name!r}; "
                       f"valid options: {', '.join(allowed)}")


def check_count(name: str, value, minimum: int) -> None:
  """Raises `MdjaxError` naming option `name` and its `value` unless it is an integer
  >= `minimum` (a bool is not a count)."""
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise MdjaxError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_real(name: str, value, minimum: float | None = None,
               maximum: float | None = None) -> None:
  """Raises `MdjaxError` naming `name` and its `value` unless it is a finite real number
  (not a bool) within the given bounds (inclusive)."""
  finite = (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))
  if finite and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
    return
  if minimum is not None and maximum is not None:
    raise MdjaxError(f"{name} must be in [{minimum}, {maximum}], got {value!r}")
  bound = f" >= {minimum}" if minimum is not None else f" <= {maximum}" if maximum is not None else ""
  raise MdjaxError(f"{name} must be a finite number{bound}, got {value!r}")
