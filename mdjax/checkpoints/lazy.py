"""Weights as recipes over checkpoint tensors, read only in the slices asked for.

A loader describes each param of `mdjax.models.transformer` by how it is made from
the tensors of a `TensorSource` (defined here; `mdjax.checkpoints.hf_layout.params_from_hf`): a tensor
(cast to the load's dtype), transposed, concatenated, split, padded with zeros. Nothing
is read until `read(index)` asks for a block; each step maps the index back onto its
inputs, so a block reads only the slices of the checkpoint tensors it covers::

    wq [D, N*H] = q_proj.weight [N*H, D] transposed; tensor = 4, wq's columns split
      device 0 holds wq[:, 0 : NH/4]      -> reads q_proj.weight[0 : NH/4, :], then .T
      device 3 holds wq[:, 3NH/4 : NH]    -> reads q_proj.weight[3NH/4 : NH, :], then .T

    embed [V', D] = embed_tokens [V, D] ++ zeros [V' - V, D]   (the padded vocabulary)
      the last device's rows [r, V')      -> reads embed_tokens[r : V, :], zeros after

    wqkv [D, (N+2K)*H] = q.T ++ k.T ++ v.T   (one device, or a mesh with tensor = 1)
      every device holds it whole          -> reads q, k and v whole (once per process)

    wq [D, N*H] of a GGUF file's blocks, kept as blocks (quantize="gguf"): the integers q,
      the scales and offsets each a recipe over the file's bytes, q/k rows reordered by
      `take` (llama.cpp's permutation undone)
      device 1 of 4 holds q[:, NH/4 : NH/2] -> decodes only ggml rows [NH/4, NH/2)
                                              (mdjax.checkpoints.gguf_native)

`put` builds a `jax.Array` on a sharding from the blocks its process's own devices
hold (`jax.make_array_from_callback`), each distinct block read once; `read_whole` reads
a recipe whole, with the same numpy operations (and bytes) an eager loader would use.
The functions `asarray` (a cast), `concatenate`, `split`, `pad` and `take` follow
numpy's, and a recipe names this module as its array namespace (`__array_namespace__`,
as numpy and jax arrays name theirs), so `mdjax.sharding.WeightPlacement.split` applies
to recipes as it does to arrays without the sharding rules importing this floor;
`placer` hands them over.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.sharding import WeightPlacement

Block = tuple[tuple[int, int], ...]  # [start, stop) per dimension


class TensorSource(Protocol):
  """Tensors by Hugging Face name: what `mdjax.checkpoints.hf_layout.params_from_hf` reads.

  Sources that track what was read (`SafetensorsFile`, the GGUF reader) also offer
  `check_all_read()`, which names the tensors a checkpoint holds and its config does
  not describe.
  """

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `name`, checked to have `shape` (a `CheckpointError` naming it if not)."""
    ...


class SlicedTensorSource(TensorSource, Protocol):
  """A `TensorSource` that also reads parts of a tensor without the rest: what loading
  onto a mesh needs, where each process reads only the slices its own devices hold
  (`put`). The safetensors sources are; a GGUF is loaded onto a mesh from its converted
  safetensors copy (`mdjax.checkpoints.gguf`)."""

  def get_slice(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """`get(name, shape)[index]`, reading only the slice."""
    ...


class Lazy:
  """A host tensor of `shape` and `dtype` not read yet."""

  shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def T(self) -> Lazy:  # noqa: N802 -- numpy's name
    return Transposed(self)

  def __array_namespace__(self, api_version: str | None = None):
    """This module: its `concatenate`, `split` and `pad` take recipes as numpy's take arrays."""
    return sys.modules[__name__]

  def read(self, block: Block) -> np.ndarray:
    """The values in `block`, reading only what it covers."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Tensor(Lazy):
  """Tensor `name` of a source, checked to have `shape`, cast to `dtype`: read whole
  by `get`, in part by `get_slice`."""

  source: SlicedTensorSource
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype

  def read(self, block: Block) -> np.ndarray:
    if block == whole(self.shape):  # the whole-tensor read is the faster one
      values = self.source.get(self.name, self.shape)
    else:
      values = self.source.get_slice(self.name, self.shape, tuple(slice(*b) for b in block))
    return values.astype(self.dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class Transposed(Lazy):
  """`inner` with its dimensions reversed (numpy's `.T`)."""

  inner: Lazy

  @property
  def shape(self) -> tuple[int, ...]:
    return self.inner.shape[::-1]

  @property
  def dtype(self) -> np.dtype:
    return self.inner.dtype

  def read(self, block: Block) -> np.ndarray:
    return self.inner.read(block[::-1]).T


@dataclasses.dataclass(frozen=True)
class Cast(Lazy):
  """`inner` in `dtype` (numpy's `asarray(inner, dtype)`)."""

  inner: Lazy
  dtype: np.dtype

  @property
  def shape(self) -> tuple[int, ...]:
    return self.inner.shape

  def read(self, block: Block) -> np.ndarray:
    return self.inner.read(block).astype(self.dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class Taken(Lazy):
  """`inner`'s entries along `axis` in the order `indices` (numpy's `take`): a block
  reads the span of `inner` its entries come from (a permutation within heads: the
  block's own heads)."""

  inner: Lazy
  indices: tuple[int, ...]
  axis: int

  @property
  def shape(self) -> tuple[int, ...]:
    return _along(self.inner.shape, self.axis, len(self.indices))

  @property
  def dtype(self) -> np.dtype:
    return self.inner.dtype

  def read(self, block: Block) -> np.ndarray:
    lo, hi = block[self.axis]
    wanted = np.asarray(self.indices[lo:hi])
    first, last = int(wanted.min()), int(wanted.max()) + 1
    values = self.inner.read(_along(block, self.axis, first, last))
    return np.take(values, wanted - first, axis=self.axis)


@dataclasses.dataclass(frozen=True)
class Zeros(Lazy):
  shape: tuple[int, ...]
  dtype: np.dtype

  def read(self, block: Block) -> np.ndarray:
    return np.zeros([stop - start for start, stop in block], self.dtype)


@dataclasses.dataclass(frozen=True)
class Concatenated(Lazy):
  """`parts` one after another along `axis` (numpy's `concatenate`)."""

  parts: tuple[Lazy, ...]
  axis: int

  @property
  def shape(self) -> tuple[int, ...]:
    first = self.parts[0].shape
    return (*first[:self.axis], sum(p.shape[self.axis] for p in self.parts),
            *first[self.axis + 1:])

  @property
  def dtype(self) -> np.dtype:
    return self.parts[0].dtype

  def read(self, block: Block) -> np.ndarray:
    """Each part's share of `block`, joined: parts outside it are not read."""
    start, stop = block[self.axis]
    pieces, offset = [], 0
    for part in self.parts:
      size = part.shape[self.axis]
      lo, hi = max(start, offset), min(stop, offset + size)
      if lo < hi:
        pieces.append(part.read(_along(block, self.axis, lo - offset, hi - offset)))
      offset += size
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=self.axis)


@dataclasses.dataclass(frozen=True)
class Window(Lazy):
  """`inner[start:stop]` along `axis`."""

  inner: Lazy
  axis: int
  start: int
  stop: int

  @property
  def shape(self) -> tuple[int, ...]:
    return _along(self.inner.shape, self.axis, self.stop - self.start)

  @property
  def dtype(self) -> np.dtype:
    return self.inner.dtype

  def read(self, block: Block) -> np.ndarray:
    lo, hi = block[self.axis]
    return self.inner.read(_along(block, self.axis, self.start + lo, self.start + hi))


def _along(items: tuple, axis: int, *value) -> tuple:
  """`items` with entry `axis` replaced by `value` (one item, or a (start, stop) pair)."""
  return (*items[:axis], value[0] if len(value) == 1 else value, *items[axis + 1:])


def whole(shape: tuple[int, ...]) -> Block:
  return tuple((0, n) for n in shape)


# --------------------------------------------------------------------------- numpy-like


def asarray(value: Lazy, dtype=None) -> Lazy:
  """`value` in `dtype` (its own when None): numpy's `asarray`, not read yet."""
  dtype = value.dtype if dtype is None else np.dtype(dtype)
  return value if dtype == value.dtype else Cast(value, dtype)


def take(value: Lazy, indices: Sequence[int], axis: int = 0) -> Lazy:
  return Taken(value, tuple(int(i) for i in indices), axis % value.ndim)


def concatenate(parts: Sequence[Lazy], axis: int = 0) -> Lazy:
  return Concatenated(tuple(parts), axis % parts[0].ndim)


def split(value: Lazy, indices_or_sections: int | Sequence[int], axis: int = 0) -> list[Lazy]:
  """numpy's `split`: into equal sections, or at the given indices."""
  axis %= value.ndim
  size = value.shape[axis]
  if isinstance(indices_or_sections, int):
    cuts = [size * i // indices_or_sections for i in range(1, indices_or_sections)]
  else:
    cuts = list(indices_or_sections)
  bounds = [0, *cuts, size]
  return [Window(value, axis, lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def pad(value: Lazy, pad_width: Sequence[tuple[int, int]]) -> Lazy:
  """numpy's `pad` with zeros."""
  for axis, (before, after) in enumerate(pad_width):
    zeros = [Zeros(_along(value.shape, axis, n), value.dtype) for n in (before, after)]
    parts = [p for p in (zeros[0], value, zeros[1]) if p.shape[axis]]
    value = value if len(parts) == 1 else Concatenated(tuple(parts), axis)
  return value


# --------------------------------------------------------------------------- reading


def read_whole(value: Lazy) -> np.ndarray:
  """`value` read whole: a fresh C-contiguous array."""
  return np.ascontiguousarray(value.read(whole(value.shape)))


def materialize(tree: dict) -> dict:
  """A dict of recipes read whole (a loader's `place` for host arrays); arrays in it, and
  the fields of quantized weights, alike."""
  read = lambda v: read_whole(v) if isinstance(v, Lazy) else v  # noqa: E731
  return {name: jax.tree.map(read, value) for name, value in tree.items()}  # in tree's order


def put(value: Lazy | Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """`value` as a `jax.Array` on `sharding`: this process reads only the blocks its own
  devices hold, each distinct block once (a replicated weight is read once, not once
  per device), and puts each on its device. An array (not a recipe) is put as it is."""
  if not isinstance(value, Lazy):
    return jax.device_put(value, sharding)
  blocks: dict[Block, np.ndarray] = {}

  def block_of(index: tuple[slice, ...]) -> np.ndarray:
    block = tuple(s.indices(n)[:2] for s, n in zip(index, value.shape))
    if block not in blocks:
      blocks[block] = np.ascontiguousarray(value.read(block))
    return blocks[block]

  return jax.make_array_from_callback(value.shape, sharding, block_of, dtype=value.dtype)


def placer(layout: WeightPlacement | None) -> Callable[[dict], dict]:
  """What a checkpoint loader calls on each dict of weights it describes (recipes): read
  whole onto the default device, or, with a layout, read by shard straight onto their
  shardings (`WeightPlacement.place` with `put`)."""
  if layout is None:
    return lambda tree: {name: jax.tree.map(jnp.asarray, value)
                         for name, value in materialize(tree).items()}
  return lambda tree: layout.place(tree, put)
