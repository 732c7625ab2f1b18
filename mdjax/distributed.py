"""Many processes: JAX's multi-controller runtime (`jax.distributed`), and the rules
mdjax keeps under it.

A TPU pod slice or a cluster of GPU nodes runs one process per host; each addresses
only its own devices, and one mesh spans them all::

    host 0: python -m experiments.decode ... ┐  the same command on every host
    host 1: python -m experiments.decode ... ┘  (SPMD)
                │                    │
       initialize(): jax.distributed.initialize (coordinator = process 0)
                │                    │
          devices 0 1 2 3      devices 4 5 6 7        addressable: its own four
          └──── jax.make_mesh((2, 4), ("data", "tensor")) ────┘   one global mesh

Every process calls mdjax with the same arguments (`check_same` proves it for
`generate`) and gets the whole result: what a program leaves sharded over other
processes' devices is gathered (`to_host`), never fetched from one process alone.
A process that dies stops the others: the coordination service misses its
heartbeats and terminates them within `heartbeat_timeout_s` ("another task died").
The trainers (`mdjax.train.lm`, `mdjax.train.heads`) keep the same rules: each process
builds only its rows of a batch, process 0 alone writes files (the others wait at a
`barrier` before reading one), and every process saves each checkpoint with orbax.
"""

from __future__ import annotations

import hashlib
import math

import jax
import numpy as np
from jax.experimental import multihost_utils

from mdjax.errors import MdjaxError


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_s: int = 60,
               initialization_timeout_s: int = 300) -> None:
  """Starts JAX's multi-controller runtime; call it first, before any other JAX call.

  With no arguments JAX detects the cluster (TPU pod slices, SLURM, Open MPI,
  Kubernetes); otherwise pass all three, e.g. `initialize("localhost:1234", 2, 0)`.
  A peer that stops sending heartbeats for `heartbeat_timeout_s` terminates every
  other process (a clear "another task died" line, never a hang); a peer that never
  joins fails `initialize` after `initialization_timeout_s`. A second call is a no-op."""
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise MdjaxError("initialize needs coordinator_address, num_processes and process_id "
                     f"together (or none, to detect the cluster); got {explicit}")
  if jax.distributed.is_initialized():
    return
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             initialization_timeout=initialization_timeout_s)


def initialize_from_flag(value: str) -> None:
  """The CLIs' `config.distributed`: "" = one process (nothing to do), "auto" = JAX's
  cluster detection, "HOST:PORT,NUM_PROCESSES,PROCESS_ID" = explicit (e.g.
  "localhost:1234,2,0")."""
  if not value:
    return
  if value == "auto":
    initialize()
    return
  parts = value.replace(" ", "").split(",")
  if len(parts) != 3 or ":" not in parts[0] or not all(p.isdigit() for p in parts[1:]):
    raise MdjaxError("config.distributed must be '', 'auto' or 'HOST:PORT,NUM_PROCESSES,"
                     f"PROCESS_ID' (e.g. 'localhost:1234,2,0'); got {value!r}")
  initialize(parts[0], int(parts[1]), int(parts[2]))


def is_main_process() -> bool:
  """True in process 0 (and when there is only one): the one that prints and writes."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (nothing with one process):
  where the others read a file process 0 just wrote."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def agreed(flag: bool) -> bool:
  """Process 0's `flag`, on every process (every process must make this call): for a
  decision from something that differs between processes, such as a clock."""
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def from_main(values: np.ndarray) -> np.ndarray:
  """Process 0's `values` (an array of the same shape and dtype on every process), on
  every process (every process must make this call): a measurement, say, that each
  process took on its own clock."""
  if jax.process_count() == 1:
    return values
  return np.asarray(multihost_utils.broadcast_one_to_all(values))


def to_host(tree):
  """Every array of `tree` as numpy, whole, on every process: an array sharded over
  other processes' devices is all-gathered (every process must make this call), the
  rest is copied from its own devices."""
  def fetch(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))
  return jax.tree.map(fetch, tree)


def fingerprint(*values) -> str:
  """A hex digest of numpy-convertible values (arrays, nested lists of ids, strings,
  numbers): equal values give equal digests on every host."""
  digest = hashlib.sha256()
  for value in values:
    array = np.asarray(value)
    digest.update(f"{array.dtype}{array.shape}".encode())
    digest.update(array.tobytes() if array.dtype != object else repr(value).encode())
  return digest.hexdigest()[:16]


def check_same(what: str, *values) -> None:
  """Raises `MdjaxError` naming two processes and their digests unless every process
  passed equal `values` (one all-gather of a digest; nothing with one process)."""
  if jax.process_count() == 1:
    return
  local = fingerprint(*values)
  words = np.frombuffer(bytes.fromhex(local), np.uint32)  # 64 bits as two uint32
  every = multihost_utils.process_allgather(words)  # [processes, 2]
  digests = [row.tobytes().hex() for row in np.asarray(every, np.uint32)]
  for process, digest in enumerate(digests):
    if digest != digests[0]:
      raise MdjaxError(f"{what} differ between processes: process 0 has digest {digests[0]}, "
                       f"process {process} has {digest}; under jax.distributed every process "
                       "must make the same call (SPMD)")


def check_mesh(mesh) -> None:
  """Raises `MdjaxError` when several processes run and `mesh` does not span every
  device of every process (a process outside it would compute nothing)."""
  size = math.prod(mesh.devices.shape)
  if jax.process_count() > 1 and size != jax.device_count():
    raise MdjaxError(f"the mesh has {size} devices but the {jax.process_count()} processes have "
                     f"{jax.device_count()} in all; under jax.distributed a mesh spans every "
                     f"device, e.g. jax.make_mesh(({jax.process_count()}, "
                     f"{jax.local_device_count()}), ('data', 'tensor'))")
