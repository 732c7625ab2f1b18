"""mdjax's compiled programs: what `generate` and `stream` keep, and what
`clear_compiled` frees, without touching JAX's caches or the caller's own programs.

`generate` compiles one whole-generation program per (strategy, shapes, placements)
and `stream` one pair of jitted functions (first state, step) per (strategy, shapes).
Each lives in a `Table`: least recently used first out, at most
`compiled_cache_size()` entries per table (`set_compiled_cache_size(n)`; default
`DEFAULT_CACHE_SIZE`). A program takes memory and, on CPU, a few hundred code
mappings of the process (vm.max_map_count is usually 65530), so an unbounded table
ends a long-running process.

Every entry is compiled from a `jax.jit` made for it alone, so evicting it drops
the last reference to its executable: JAX's tracing and lowering caches hold that
executable only as long as the jitted function lives. mdjax's module-level jitted
functions (`decode_step`, the cache operations, the heads' and trainers' steps)
are made with `jit` below, which registers them so `clear_compiled` empties their
caches too.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Hashable

import jax

from mdjax.errors import MdjaxError

DEFAULT_CACHE_SIZE = 32  # programs per table; ~400 code mappings each for a tiny model on CPU

_size = DEFAULT_CACHE_SIZE
_tables: list[Table] = []
_jitted: list = []  # mdjax's module-level jitted functions (`jit`)


class Table:
  """Compiled programs by key, least recently used first, at most
  `compiled_cache_size()` of them; `clear_compiled` empties every table."""

  def __init__(self):
    self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    _tables.append(self)

  def get(self, key: Hashable) -> Any | None:
    """The program stored under `key` (now the most recently used), or None."""
    if key not in self._entries:
      return None
    self._entries.move_to_end(key)
    return self._entries[key]

  def put(self, key: Hashable, program: Any) -> None:
    """Stores `program` as the most recently used; evicts the least recently used
    beyond `compiled_cache_size()`."""
    self._entries[key] = program
    self._entries.move_to_end(key)
    self._trim()

  def keys(self) -> list:
    """The stored programs' keys, least recently used first."""
    return list(self._entries)

  def values(self) -> list:
    """The stored programs, least recently used first."""
    return list(self._entries.values())

  def clear(self) -> None:
    self._entries.clear()

  def _trim(self) -> None:
    while len(self._entries) > _size:
      self._entries.popitem(last=False)


def compiled_cache_size() -> int:
  """How many compiled programs `generate` (and, apart, `stream`) keeps."""
  return _size


def set_compiled_cache_size(size: int) -> None:
  """Keeps at most `size` compiled programs for `generate` and `size` for `stream`
  (0: none; every call compiles), evicting the least recently used now if more are
  kept. Larger sizes save compiles for workloads of many shapes or strategies, at the
  memory (and, on CPU, the code mappings) of each program kept."""
  if not isinstance(size, int) or isinstance(size, bool) or size < 0:
    raise MdjaxError(f"compiled cache size must be an integer >= 0, got {size!r}")
  global _size
  _size = size
  for table in _tables:
    table._trim()


def jit(fun: Callable, **options) -> Callable:
  """`jax.jit(fun, **options)`, registered so `clear_compiled` empties its cache: for
  mdjax's module-level functions (a jit made inside a call dies with it)."""
  jitted = jax.jit(fun, **options)
  _jitted.append(jitted)
  return jitted


def clear_compiled() -> None:
  """Forgets every program mdjax compiled (`generate`'s, `stream`'s and those of its
  jitted functions such as `decode_step`), freeing their memory and code mappings;
  the next call compiles again. The caller's own jitted functions keep theirs, and
  JAX's caches are left alone (`jax.clear_caches()` clears those)."""
  for table in _tables:
    table.clear()
  for jitted in _jitted:
    jitted.clear_cache()
