"""The trainers on a device mesh: the `("data", "tensor")` mesh a config's `mesh` field
names, and a training state (`{"params", "opt_state"}`) laid out on it.

On a mesh the params and the optimizer's moments lie as `mdjax.sharding` lays out a
model (fused projections split, the vocabulary padded, every matrix sharded by the
rules table), step counts replicated, and each batch split over "data". Checkpoints
always hold the one-device layout (`checkpoint_state`), so a run resumes on any mesh,
or on one device, whatever wrote its checkpoint (`restore_target`).

Under `jax.distributed` the mesh spans every process's devices: each process builds
only its own rows of a batch (`shard_batch`), and every process saves and restores each
checkpoint together (orbax writes a multi-host checkpoint into a directory they all
see), so a run resumes on any number of processes too.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mdjax import sharding
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig


def device_mesh(spec: str, batch_size: int) -> Mesh | None:
  """`sharding.mesh_from_spec(spec)` for a trainer: also `MdjaxError` when the mesh's
  "data" axis does not divide `batch_size`, or when several processes run without a
  mesh (each would train alone)."""
  mesh = sharding.mesh_from_spec(spec)
  if mesh is None and jax.process_count() > 1:
    raise MdjaxError(f"{jax.process_count()} processes train on one mesh of all their devices: "
                     f"set config.mesh (e.g. '{jax.process_count()},{jax.local_device_count()}')")
  if mesh is not None and batch_size % mesh.shape["data"]:
    raise MdjaxError(f"config.batch_size ({batch_size}) must be a multiple of the mesh's data "
                     f"axis ({mesh.shape['data']}, config.mesh {spec!r}): every data shard takes "
                     "an equal part of each batch")
  return mesh


def map_param_trees(fn, state: dict, other=lambda x: x) -> dict:
  """`state` ({"params", "opt_state"}) with `fn` applied to every subtree shaped like
  `state["params"]` (the params, Adam's moments: dicts of named weights) and `other` to
  every other leaf (step counts)."""
  treedef = jax.tree.structure(state["params"])

  def like_params(x) -> bool:
    return isinstance(x, dict) and jax.tree.structure(x) == treedef
  return jax.tree.map(lambda x: fn(x) if like_params(x) else other(x), state,
                      is_leaf=like_params)


def state_on_mesh(state: dict, layout: sharding.WeightPlacement | None,
                  by_rules: bool = True) -> dict:
  """A state in the one-device layout, laid out on `layout`'s mesh: the params and
  their moments by `Layout.place` (split, padded, sharded by the rules; a model's own
  weights) or, not `by_rules`, replicated like the rest (heads beside a frozen target).
  Unchanged without a layout."""
  if layout is None:
    return state
  if not by_rules:
    return sharding.on_layout(state, layout)
  return map_param_trees(layout.place, state, lambda x: sharding.on_layout(x, layout))


SPLIT_PARTS = tuple(part for parts in sharding.FUSED.values() for part in parts)


def checkpoint_state(state: dict, config: ModelConfig,
                     layout: sharding.WeightPlacement | None) -> dict:
  """What a checkpoint holds: `state` in the one-device layout (`state_on_mesh`'s
  inverse), so that any mesh, or one device, restores it. The split parts (and a padded
  vocabulary) are first gathered whole onto every device: a fused weight's shard
  boundaries do not fall where its parts' did (left to XLA, that is a "full
  rematerialization" warning), so a save briefly holds those weights unsharded.

  One program does it all: as eager operations (a program each over every process's
  devices), their transfers could run in another order on each process and wait on
  each other for good, which hung a save under gloo about one run in ten."""
  if layout is None:
    return state
  return _one_device_state(state, config, layout)


@functools.partial(jax.jit, static_argnames=("config", "layout"))
def _one_device_state(state: dict, config: ModelConfig, layout: sharding.WeightPlacement) -> dict:
  gathered = SPLIT_PARTS + (("embed", "lm_head") if layout.padded_vocab != config.vocab_size
                            else ())
  replicated = NamedSharding(layout.mesh, PartitionSpec())

  def one_device(params):
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (jax.lax.with_sharding_constraint(x, replicated)
                         if path[-1].key in gathered else x), params)
    return sharding.one_device_layout(params, config)
  return map_param_trees(one_device, state)


def restore_target(state: dict, layout: sharding.WeightPlacement, by_rules: bool = True) -> dict:
  """Abstract arrays to restore a checkpoint of the one-device layout `state` straight
  onto `layout`'s mesh: each weight (and moment) sharded by the rules where its one-device
  shape allows (a fused or unpadded one: replicated), or every one replicated when not
  `by_rules`; the rest replicated. Then `state_on_mesh` lays it out."""
  def abstract(x, where):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)

  replicated = NamedSharding(layout.mesh, PartitionSpec())
  if not by_rules:
    return jax.tree.map(lambda x: abstract(x, replicated), state)

  def weights(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: abstract(x, layout.sharding(path[-1].key, x.shape)), params)
  return map_param_trees(weights, state, lambda x: abstract(x, replicated))


def shard_batch(build: Callable[[slice], dict | np.ndarray], batch_size: int,
                layout: sharding.WeightPlacement | None):
  """The step's batch of `batch_size` rows, `build(rows)` making (numpy, batch-major) the
  rows `rows` of it: on the default device, or split over the mesh's "data" axis, each
  process building only the rows its own devices hold (under `jax.distributed`, its
  contiguous part of the global batch) and putting them straight there."""
  if layout is None:
    return jax.tree.map(jnp.asarray, build(slice(None)))
  where = NamedSharding(layout.mesh, PartitionSpec("data"))
  local = build(process_rows(where, batch_size))
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
      where, x, (batch_size, *x.shape[1:])), local)


def process_rows(where: NamedSharding, batch_size: int) -> slice:
  """The rows of a `batch_size`-row array split by `where` that this process's devices
  hold: all of them with one process."""
  bounds = [index[0].indices(batch_size)[:2]
            for index in where.addressable_devices_indices_map((batch_size,)).values()]
  return slice(min(start for start, _ in bounds), max(stop for _, stop in bounds))


def state_shardings(state: dict, layout: sharding.WeightPlacement | None):
  """Where every array of `state` lies (None without a mesh): `make_train_step` keeps it so."""
  return None if layout is None else jax.tree.map(lambda x: x.sharding, state)
