"""Devices to compile for without having them: a GPU (jax's CUDA plugin, given a target
description from this folder) on a machine with only a CPU.

    device = compile_targets.device("h200")
    compiled = compile_targets.compile_for(decode_step, "h200", params, cache, ...,
                                           config=config, attention="fused")
    compiled.as_text()   # the optimized program the H200 would run (`mdjax.hlo_report`)

The arrays passed stand for their shapes only (`jax.ShapeDtypeStruct`s placed on the
target's device); nothing runs. mdjax's platform choices follow the target
(`mdjax.platform.building_for`). Needs `jax-cuda13-plugin` and `jax-cuda13-pjrt` at
jax's own version (requirements-compile-targets.txt); JAX_PLATFORMS=cpu keeps the host
on its CPU while the plugin only compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
from jax.sharding import SingleDeviceSharding

from mdjax import platform
from mdjax.errors import MdjaxError, MissingPackageError

HERE = pathlib.Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class Target:
  """A device to compile for: its platform, its description and its memory bandwidth
  (bytes/s: the roofline a report divides by)."""

  name: str
  platform: str
  description: str  # the file in this folder
  memory_bandwidth: float


TARGETS = {
    "h100": Target(name="h100", platform="gpu", description="h100.txtpb", memory_bandwidth=3.35e12),
    "h200": Target(name="h200", platform="gpu", description="h200.txtpb", memory_bandwidth=4.8e12),
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
    topology = topologies.get_topology_desc(
        name, "cuda", target_config=(HERE / target.description).read_text(), topology="1x1x1")
  except NotImplementedError:  # jax without the CUDA plugin: "topology not implemented"
    raise MissingPackageError(
        f"compiling for {name} needs jax's CUDA plugin: python3 -m pip install "
        "-r requirements-compile-targets.txt") from None
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


def compile_for(fn, name: str, *args, **static):
  """`fn` (a `jax.jit`-wrapped function) compiled for target `name` with `args` standing
  for their shapes and `static` its static arguments, as that device's platform would
  build it."""
  with platform.building_for(get(name).platform):
    return fn.trace(*abstract(args, name), **static).lower().compile()
