"""The one error type mdjax raises for bad input.

`MdjaxError` subclasses `ValueError`, so callers that already catch `ValueError`
keep working; the CLI catches it and prints its message on one line.
"""


class MdjaxError(ValueError):
  """Bad input to mdjax: the message names the offending value."""


class CheckpointError(MdjaxError):
  """A checkpoint directory is missing, incomplete, corrupt or unsupported."""
