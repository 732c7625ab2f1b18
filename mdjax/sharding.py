"""Sharding over a device mesh: one rules table, the weights and the KV cache placed
by it, and sharding constraints inside the step.

Users pass a standard JAX mesh with axes `"data"` and `"tensor"` (either may be 1)::

    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    model = mdjax.load("smollm2-135m-instruct", mesh=mesh)    # or mdjax.shard(model, mesh)

and every strategy runs unchanged: `generate` compiles under the mesh, so the
constraints below apply, and XLA's SPMD partitioner does the rest.

**The layout's mesh.** The tensor axis is split in two, `tensor = tensor_kv x tensor_q`,
with `tensor_kv = gcd(kv_heads, tensor)`: query heads, MLP and vocabulary are sharded
over both (the whole tensor axis); key/value heads over `tensor_kv` only, replicated
over `tensor_q`, so a GQA model with 1, 2 or 8 KV heads shards on 8 devices. Query
head n reads KV head n // (N / K), and the shard of query heads a device holds always
reads KV heads of its own shard. E.g. K = 2 on tensor = 8::

    device (tensor index)   0   1   2   3 | 4   5   6   7
    query heads (N = 8)     0   1   2   3 | 4   5   6   7
    KV heads                0   0   0   0 | 1   1   1   1      tensor_kv = 2, tensor_q = 4

The mesh is made with auto axis types whatever the user's were (JAX's default,
explicit, would have every reshape of a sharded dimension annotated by hand).

**Rules.** Logical axis -> layout mesh axes (`RULES`); a weight's logical axes by its
name (`PARAM_AXES`; a stacked layer has one more, leading, replicated axis); the
rest (norms) replicated. A dimension is sharded only when its count (heads, not
heads x head_dim) divides the mesh axes' size; otherwise it is replicated.

**Weights on a mesh with tensor > 1.** Fused projections would put a shard boundary
inside q|k|v or gate|up, so they are split: `wqkv` -> `wq`, `wk`, `wv` (biases too),
`w_gate_up` -> `w_gate`, `w_up` (`mdjax.models.transformer` reads either layout). The
vocabulary rows of `embed` (and `lm_head`'s columns) are padded with zeros to a
multiple of the tensor size; `lm_head` cuts the logits back to `vocab_size`.

**Loading onto a mesh.** A checkpoint loader hands `WeightPlacement.place` recipes, not arrays
(`mdjax.checkpoints.lazy`, a floor above this one: the rules reach them only through the
array namespace they name, `__array_namespace__`, and the `put` the loader passes): split
and padded like arrays, then read shard by shard, so each process reads only the slices
of each tensor its own devices hold. E.g.
`q_proj.weight [N*H, D]` on a 1x8 mesh over two processes of 4 devices::

    wq = q_proj.weight.T [D, N*H]     columns:  0 ... N*H/2 | N*H/2 ... N*H
    devices                                     0  1  2  3  |  4  5  6  7
    process 0 reads q_proj.weight rows [0, N*H/2), in 4 slices; process 1 the rest

**The KV cache** `[L, B, S, K, H]`: batch over data, KV heads over tensor_kv;
`pos`/`seg` `[B, S]` and `length` `[B]` over data; the topology replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from mdjax import distributed
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.quantized import concatenate, is_quantized, same_form

MESH_AXES = ("data", "tensor")
LAYOUT_AXES = ("data", "tensor_kv", "tensor_q")

# logical axis -> the layout mesh's axes it is sharded over
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data",),
    "heads": ("tensor_kv", "tensor_q"),
    "kv_heads": ("tensor_kv",),
    "mlp": ("tensor_kv", "tensor_q"),
    "vocab": ("tensor_kv", "tensor_q"),
}

# weight name -> logical axis per dimension (of one layer); unnamed weights: replicated
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", None), "lm_head": (None, "vocab"),
    "wq": (None, "heads"), "wk": (None, "kv_heads"), "wv": (None, "kv_heads"),
    "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "wo": ("heads", None),
    "w_gate": (None, "mlp"), "w_up": (None, "mlp"), "b_gate": ("mlp",), "b_up": ("mlp",),
    "w_down": ("mlp", None),
}

# a fused weight -> the parts a mesh with tensor > 1 stores instead (`WeightPlacement.split`)
FUSED: dict[str, tuple[str, ...]] = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"),
                                     "w_gate_up": ("w_gate", "w_up"),
                                     "b_gate_up": ("b_gate", "b_up")}

# the KV cache's fields -> logical axes
CACHE_AXES = {"k": (None, "batch", None, "kv_heads", None),
              "v": (None, "batch", None, "kv_heads", None),
              "k_scale": (None, "batch", None, "kv_heads"),
              "v_scale": (None, "batch", None, "kv_heads"),
              "pos": ("batch", None), "seg": ("batch", None), "length": ("batch",)}


def mesh_from_spec(spec: str) -> Mesh | None:
  """The `("data", "tensor")` mesh of all the devices (every process's) that a config's
  `mesh` field names ("2,4": data 2 x tensor 4), or None for "" (one device, no mesh);
  `MdjaxError` when it is malformed or does not match the device count."""
  if not spec:
    return None
  parts = spec.replace(" ", "").split(",")
  if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise MdjaxError(f"config.mesh must be 'data,tensor', two positive sizes (e.g. '2,4'), "
                     f"or '' for one device; got {spec!r}")
  shape = tuple(int(p) for p in parts)
  devices = jax.devices()
  if math.prod(shape) != len(devices):
    raise MdjaxError(f"config.mesh {spec!r} needs {math.prod(shape)} devices, there are "
                     f"{len(devices)} ({devices[0].platform}, {jax.process_count()} process(es)); "
                     "a CPU simulates n devices with JAX_NUM_CPU_DEVICES=n")
  return jax.make_mesh(shape, MESH_AXES)


def layout_mesh(mesh: Mesh, num_kv_heads: int) -> Mesh:
  """The `("data", "tensor_kv", "tensor_q")` mesh of `mesh`'s devices for a model with
  `num_kv_heads` (auto axis types). A mesh already in layout form is returned as is."""
  if tuple(mesh.axis_names) == LAYOUT_AXES:
    return mesh
  if not isinstance(mesh, Mesh) or set(mesh.axis_names) != set(MESH_AXES):
    raise MdjaxError(f"mdjax needs a jax.sharding.Mesh with axes {MESH_AXES} (either may have "
                     f"size 1), e.g. jax.make_mesh((1, {len(jax.devices())}), "
                     f"('data', 'tensor')); got {mesh!r}")
  distributed.check_mesh(mesh)
  devices = np.moveaxis(mesh.devices, [mesh.axis_names.index(a) for a in MESH_AXES], [0, 1])
  data, tensor = devices.shape
  kv = math.gcd(num_kv_heads, tensor)
  return Mesh(devices.reshape(data, kv, tensor // kv), LAYOUT_AXES,
              axis_types=(AxisType.Auto,) * 3)


def _axis_size(mesh, axes: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def spec(mesh, logical: tuple[str | None, ...], counts: tuple[int, ...]) -> PartitionSpec:
  """The partition spec of a value whose dimension i has logical axis `logical[i]` and
  holds `counts[i]` units (heads, tokens, rows): sharded by `RULES` where the units
  divide the mesh axes' size, replicated otherwise."""
  parts = []
  for name, count in zip(logical, counts):
    axes = RULES.get(name, ()) if name else ()
    size = _axis_size(mesh, axes)
    parts.append(None if size == 1 or count % size else (axes if len(axes) > 1 else axes[0]))
  return PartitionSpec(*parts)


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
  """`x` constrained to its logical axes' sharding when a layout mesh is active (inside
  `generate`, `mdjax.forward_logits`); unchanged otherwise. Counts are `x`'s own sizes,
  so use it on activations whose dimensions count heads, not heads x head_dim."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or tuple(mesh.axis_names) != LAYOUT_AXES:
    return x
  return jax.lax.with_sharding_constraint(x, spec(mesh, logical, x.shape))


def constrain_cache(cache):
  """The KV cache (`mdjax.cache.KVCache`) with every field constrained by `CACHE_AXES`
  (a per-layer field's arrays each by the axes after the layer's)."""
  def constrained(field, axes):
    if isinstance(field, tuple):
      return tuple(constrain(x, *axes[1:]) for x in field)
    return constrain(field, *axes)

  return cache.replace(**{name: constrained(getattr(cache, name), axes)
                          for name, axes in CACHE_AXES.items()
                          if getattr(cache, name) is not None})


@dataclasses.dataclass(frozen=True)
class WeightPlacement:
  """How one model's weights lie on a layout mesh (static, hashable)."""

  mesh: Mesh  # axes LAYOUT_AXES
  config: ModelConfig

  @property
  def tensor(self) -> int:
    return _axis_size(self.mesh, ("tensor_kv", "tensor_q"))

  @property
  def padded_vocab(self) -> int:
    return -(-self.config.vocab_size // self.tensor) * self.tensor

  def counts(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Units per dimension of the weight `name`: heads for head axes, else the size."""
    units = {"heads": self.config.num_heads, "kv_heads": self.config.num_kv_heads}
    axes = PARAM_AXES.get(name, ())
    axes = (None,) * (len(shape) - len(axes)) + tuple(axes)
    return tuple(units.get(a, n) for a, n in zip(axes, shape))

  def sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
    """Where the weight `name` of `shape` lies (a leading stacked-layer axis replicated)."""
    axes = PARAM_AXES.get(name, ())
    logical = (None,) * (len(shape) - len(axes)) + tuple(axes)
    return NamedSharding(self.mesh, spec(self.mesh, logical, self.counts(name, shape)))

  def split(self, name: str, value) -> dict[str, Any]:
    """One stored weight as the mesh stores it: fused projections split (tensor > 1),
    the vocabulary padded. Works on numpy and jax arrays and on a loader's recipes
    (`mdjax.checkpoints.lazy`) alike, through the namespace each names (the array API's
    `__array_namespace__`: numpy, jax.numpy or the recipes' own); last axis = outputs.
    A quantized weight's integers, scales and offsets are split and padded alike (each
    has the weight's output axis, and its vocabulary axis; padding is zeros: value 0)."""
    if is_quantized(value):
      fields = {f: self.split(name, x) for f, x in _fields(value).items()}
      return {part: dataclasses.replace(value, **{f: parts[part] for f, parts in fields.items()})
              for part in fields["q"]}
    c = self.config
    xp = value.__array_namespace__()
    if self.tensor > 1 and name in FUSED:
      q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
      cuts = [q, q + kv] if name in ("wqkv", "bqkv") else 2  # q|k|v, gate|up
      return dict(zip(FUSED[name], xp.split(value, cuts, axis=-1)))
    pad = self.padded_vocab - c.vocab_size
    if pad and name in ("embed", "lm_head"):
      axis = 0 if name == "embed" else value.ndim - 1
      return {name: xp.pad(value, [(0, pad if i == axis else 0) for i in range(value.ndim)])}
    return {name: value}

  def place(self, tree: dict[str, Any],
            put: Callable[[Any, NamedSharding], jax.Array] = jax.device_put) -> dict[str, Any]:
    """A dict of named weights (a layer's, or the top-level ones) split and `put` on their
    shardings one by one: a numpy weight goes from the host to each device's shard, never
    whole onto one device; a loader passes its own `put`, which reads a recipe only in the
    shards this process's devices hold (`mdjax.checkpoints.lazy.put`)."""
    placed = {}
    for name, value in tree.items():
      if name == "layers":
        placed[name] = ([self.place(layer, put) for layer in value] if isinstance(value, list)
                        else self.place(value, put))
        continue
      for part, array in self.split(name, value).items():
        placed[part] = self._put(part, array, put)
    return placed

  def _put(self, name: str, value, put: Callable[[Any, NamedSharding], jax.Array]):
    """One weight on its sharding. A quantized weight's integers lie as the float weight
    would; its scales and offsets ([..., G, F], or [V, G] for the embedding) too, but
    their group axis only where the groups divide the mesh axes as the rows do (int8's
    one group per column is replicated along it)."""
    sharding = self.sharding(name, value.shape)
    if not is_quantized(value):
      return put(value, sharding)
    parts = list(sharding.spec) + [None] * (value.ndim - len(sharding.spec))
    grouped = value.axis % value.ndim
    axes = parts[grouped]
    if axes is not None and value.scale.shape[grouped] % _axis_size(
        self.mesh, axes if isinstance(axes, tuple) else (axes,)):
      parts[grouped] = None
    per_group = NamedSharding(self.mesh, PartitionSpec(*parts))
    return dataclasses.replace(
        value, **{f: put(x, sharding if f == "q" else per_group)
                  for f, x in _fields(value).items()})


def _fields(weight) -> dict[str, Any]:
  """A quantized weight's arrays by field name (no offset field when it has none)."""
  return {f: getattr(weight, f) for f in ("q", "scale", "offset") if getattr(weight, f) is not None}


def layout_for(mesh: Mesh | None, config: ModelConfig) -> WeightPlacement | None:
  """The `WeightPlacement` of a model of `config` on `mesh` (None: one device)."""
  if mesh is None:
    return None
  return WeightPlacement(mesh=layout_mesh(mesh, config.num_kv_heads), config=config)


def shard(model, mesh: Mesh):
  """`model` (an `mdjax.Model`, on one device or already on a mesh) with its weights
  placed on `mesh` by the rules table."""
  layout = layout_for(mesh, model.config)
  params = one_device_layout(model.params, model.config) if model.layout else model.params
  return dataclasses.replace(model, params=layout.place(params), layout=layout)


def one_device_layout(params: dict, config: ModelConfig) -> dict:
  """`params` as one device stores them (the inverse of `WeightPlacement.split`): split
  projections fused again, a padded vocabulary cut (e.g. to save a sharded model)."""
  def cut(fn, weight):  # fn on an array, or on each field of a quantized weight
    if not is_quantized(weight):
      return fn(weight)
    return dataclasses.replace(weight, **{f: fn(x) for f, x in _fields(weight).items()})

  def fuse(layer: dict) -> dict:
    layer = dict(layer)
    for fused, parts in FUSED.items():
      if parts[0] in layer and same_form([layer[p] for p in parts]):
        layer[fused] = concatenate([layer.pop(p) for p in parts])
    return layer

  out = dict(params)
  layers = params["layers"]
  out["layers"] = [fuse(lp) for lp in layers] if isinstance(layers, list) else fuse(layers)
  out["embed"] = cut(lambda x: x[:config.vocab_size], params["embed"])
  if "lm_head" in params:
    out["lm_head"] = cut(lambda x: x[..., :config.vocab_size], params["lm_head"])
  return out


def on_layout(tree, layout: WeightPlacement | None):
  """Every array of `tree` (e.g. a draft model's or heads' params) on the layout's mesh:
  those already there stay, the others are replicated over it."""
  if layout is None:
    return tree
  replicated = NamedSharding(layout.mesh, PartitionSpec())

  def put(x):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == layout.mesh:
      return x
    return jax.device_put(x, replicated)
  return jax.tree.map(put, tree)


def active(layout: WeightPlacement | None):
  """The context under which programs for `layout` are traced (a no-op without one)."""
  return jax.set_mesh(layout.mesh) if layout is not None else contextlib.nullcontext()
