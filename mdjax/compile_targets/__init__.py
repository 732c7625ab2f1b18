"""Devices to compile for without having them, on a machine with only a CPU: a GPU
(jax's CUDA plugin, given a target description from this folder) or a TPU (libtpu, given
a topology name such as "v5e:1x1").

    device = compile_targets.device("v5e")
    compiled = compile_targets.compile_for(decode_step, "h200", params, cache, ...,
                                           config=config, attention="fused")
    compiled.as_text()   # the optimized program the H200 would run (`mdjax.hlo_report`)

The arrays passed stand for their shapes only (`jax.ShapeDtypeStruct`s placed on the
target's device); nothing runs. mdjax's platform choices follow the target
(`mdjax.platform.building_for`). Needs `jax-cuda13-plugin` and `jax-cuda13-pjrt` at
jax's own version, and `libtpu` at the version jax's `tpu` extra pins
(requirements-compile-targets.txt); JAX_PLATFORMS=cpu keeps the host on its CPU while
the plugin and libtpu only compile.

The TPU targets are single chips, the notebook's first (notebooks/tpu_colab.ipynb:
Colab's TPU runtime is a v5e-1); a multi-chip topology's first chip would compile the
same one-device program.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import warnings

import jax
from jax.sharding import SingleDeviceSharding

from mdjax import backends, platform
from mdjax.errors import MdjaxError, MissingPackageError

HERE = pathlib.Path(__file__).parent


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """A device to compile for: its platform, how jax names its topology, its memory
  bandwidth (bytes/s: the roofline a report divides by) and size (bytes: what a
  program's `memory_analysis()` must fit in)."""

  name: str
  platform: str  # "gpu" or "tpu"
  topology: str  # jax's topology name: a TPU's "v5e:1x1", a GPU's "1x1x1"
  memory_bandwidth: float
  memory_bytes: int
  description: str | None = None  # a GPU's GpuTargetConfigProto: a file in this folder


GIB = 2**30
# what libtpu would otherwise look up on a TPU host (it compiles for the named topology)
COMPILE_ONLY_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-1",
                        "TPU_WORKER_HOSTNAMES": "localhost"}
TARGETS = {
    "h100": Target(name="h100", platform="gpu", topology="1x1x1", description="h100.txtpb",
                   memory_bandwidth=3.35e12, memory_bytes=80 * GIB),
    "h200": Target(name="h200", platform="gpu", topology="1x1x1", description="h200.txtpb",
                   memory_bandwidth=4.8e12, memory_bytes=141 * 10**9),
    # Colab's TPU (a v5e-1) first; then the newer and the larger chips of Cloud TPU
    "v5e": Target(name="v5e", platform="tpu", topology="v5e:1x1", memory_bandwidth=8.19e11,
                  memory_bytes=16 * GIB),
    "v6e": Target(name="v6e", platform="tpu", topology="v6e:1x1", memory_bandwidth=1.64e12,
                  memory_bytes=32 * GIB),
    "v5p": Target(name="v5p", platform="tpu", topology="v5p:1x1x1", memory_bandwidth=2.765e12,
                  memory_bytes=95 * GIB),
}


def get(name: str) -> Target:
  if name not in TARGETS:
    raise MdjaxError(f"unknown compile target {name!r}; known: {', '.join(TARGETS)}")
  return TARGETS[name]


@functools.cache
def device(name: str) -> jax.Device:
  """The one device of target `name` (a compile-only device: it runs nothing)."""
  from jax.experimental import topologies
  target = get(name)
  try:
    if target.platform == "tpu":
      # libtpu holds /tmp/libtpu_lockfile while its process lives, so that two processes
      # never drive one TPU; compiling drives none, and another compiling process (a
      # test worker) or one whose jax found libtpu must not make this one fail
      os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
      # on a host without a TPU, libtpu looks for one (the cloud's metadata server, the
      # TPU's type and workers) and warns at length; a compile-only topology needs none
      if not backends.host_has_accelerator():
        for variable, value in COMPILE_ONLY_TPU_ENV.items():
          os.environ.setdefault(variable, value)
      topology = topologies.get_topology_desc(topology_name=target.topology, platform="tpu",
                                              chips_per_host_bounds=(1, 1, 1))
    else:
      topology = topologies.get_topology_desc(
          name, "cuda", target_config=(HERE / target.description).read_text(),
          topology=target.topology)
  except (NotImplementedError, RuntimeError) as e:
    if "not implemented" not in str(e) and "not installed" not in str(e):  # the package is there
      raise
    package = "libtpu" if target.platform == "tpu" else "jax's CUDA plugin"
    raise MissingPackageError(
        f"compiling for {name} needs {package}: python3 -m pip install "
        f"-r requirements-compile-targets.txt ({e})") from None
  return topology.devices[0]


def abstract(tree, name: str):
  """Every array (or `ShapeDtypeStruct`) of `tree` as a `ShapeDtypeStruct` on target
  `name`'s device; other leaves (static values) unchanged."""
  sharding = SingleDeviceSharding(device(name))

  def on_target(leaf):
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return leaf

  return jax.tree.map(on_target, tree)


# JAX's persistent compilation cache (where one is set) stores a program built for a
# target as any other, but without that device no client can load it back: JAX warns and
# compiles it again. The warning says nothing a caller can act on.
UNLOADABLE_CACHE_ENTRY = r"Error reading persistent compilation cache entry"


def compile_for(fn, name: str, *args, **static):
  """`fn` (a `jax.jit`-wrapped function) compiled for target `name` with `args` standing
  for their shapes and `static` its static arguments, as that device's platform would
  build it."""
  with platform.building_for(get(name).platform), warnings.catch_warnings():
    warnings.filterwarnings("ignore", UNLOADABLE_CACHE_ENTRY, UserWarning)
    return fn.trace(*abstract(args, name), **static).lower().compile()
