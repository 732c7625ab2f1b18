"""The KV cache: one preallocated pytree, and the pure operations on it.

    k, v    [layers, batch, slots, kv_heads, head_dim]   float, or int8 with:
    k_scale, v_scale  float32[layers, batch, slots, kv_heads]   (int8 only; else None)
            (each a stack, or a tuple of L per-layer arrays [batch, slots, ...]: below)
    pos     int32[batch, slots]   RoPE position of the token in each slot
    seg     int32[batch, slots]   segment owning the slot; -1 = empty or dead
    length  int32[batch]          append cursor: slots >= length are free

Rows fill independently (ragged lengths are normal). A slot's position and segment
are all attention needs to decide visibility (see `mdjax.topology`), so slot order
carries no meaning: branches may interleave freely. A strategy may still keep a
layout that lets attention skip work: `CacheRegions`, one region per branch.

An int8 cache (`KVCache.create(..., "int8")`) holds each slot's key and value of each
KV head as 127 * x / max|x| rounded, and max|x| / 127 beside it (`quantize_kv`): a
quarter of float32's bytes plus 4 bytes per head_dim values. Writes quantize (`write_layer`),
reads dequantize (`read_kv`: attention sees float32), and every move of slots moves
the scales with the values.

K/V come in one of two layouts (`KVCache.create(..., per_layer=)`), with the same
contents and operations:

    stacked     k: [L, B, S, K, H]               what a scanned layer loop carries
    per layer   k: ([B, S, K, H], ... L of them)  for the unrolled loop

A per-layer cache is what the unrolled loop reads fastest: XLA:CPU copied a layer out of
a stack before attention read it (SmolLM2's step at 6,144 cached tokens: 13% slower with
dense attention, 6.5% with block_sparse; docs/benchmarks/context.md). Code reads one
layer through `at_layer` (a stack and an index either way: a per-layer array as a stack
of one, a reshape, not a copy) and writes a per-layer array in place, directly (a write
through the stack of one copied the whole layer); `each_layer` moves slots in every
layer of either.

Example, one row after a prompt of 3 tokens and two decoded beams (segments 1, 2)::

    slot    0  1  2  3  4  5  6  .  .
    seg     0  0  0  1  2  1  2 -1 -1
    pos     0  1  2  3  3  4  4  0  0       length = 7
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mdjax import platform, programs
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.layer_loop import layer_loop_of
from mdjax.sharding import constrain_cache

FEW_TOKENS = 32  # tokens per pass up to which a GPU claims slots by selects (`set_few`)
KV_DTYPES = ("float32", "bfloat16", "int8")  # `kv_cache_dtype`
KV_STEP = 127.0  # the largest int8 magnitude of a quantized key or value


class CacheRegions(NamedTuple):
  """A cache laid out as `shared` slots every branch sees, then one region of `size`
  slots per branch (region j from slot `shared + j * size`) that only branch j sees;
  see `mdjax.models.attention.cascade_attention`. Static (hashable) under jit.

  in_order: this pass's query t is branch t's newest token (so it lies in region t),
    which lets attention read a chunk of all regions as one view of the cache
    instead of gathering each query's own; a property of the pass, not the layout.
  """
  shared: int
  size: int
  in_order: bool = False


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "pos", "seg", "length", "k_scale", "v_scale"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: Float[Array, "L B S K H"] | tuple[Float[Array, "B S K H"], ...]
  v: Float[Array, "L B S K H"] | tuple[Float[Array, "B S K H"], ...]
  pos: Int[Array, "B S"]
  seg: Int[Array, "B S"]
  length: Int[Array, "B"]
  k_scale: Float[Array, "L B S K"] | tuple[Float[Array, "B S K"], ...] | None = None  # int8's
  v_scale: Float[Array, "L B S K"] | tuple[Float[Array, "B S K"], ...] | None = None

  @classmethod
  def create(cls, config: ModelConfig, batch: int, slots: int, dtype=jnp.float32, *,
             per_layer: bool = False) -> "KVCache":
    """An empty cache for K/V of `dtype`, stacked or `per_layer` (see the module; a
    per-layer cache serves the unrolled layer loop only). On CPU a bfloat16 cache is
    stored as float32, which holds the same values (attention reads K/V in float32
    anyway): XLA:CPU writes into a bfloat16 array by converting all of it to float32 and
    back, the whole cache of every layer at each layer's write, ~70% of a bfloat16
    SmolLM2 pass. An int8 cache has its scales (see the module)."""
    if jnp.dtype(dtype) == jnp.bfloat16 and platform.is_cpu():
      dtype = jnp.float32
    shape = (config.num_layers, batch, slots, config.num_kv_heads, config.head_dim)

    def zeros(shape, dtype):
      if not per_layer:
        return jnp.zeros(shape, dtype)
      return tuple(jnp.zeros(shape[1:], dtype) for _ in range(shape[0]))

    scales = (dict(k_scale=zeros(shape[:-1], jnp.float32), v_scale=zeros(shape[:-1], jnp.float32))
              if jnp.dtype(dtype) == jnp.int8 else {})
    return constrain_cache(cls(k=zeros(shape, dtype), v=zeros(shape, dtype),
                               pos=jnp.zeros((batch, slots), jnp.int32),
                               seg=jnp.full((batch, slots), -1, jnp.int32),
                               length=jnp.zeros((batch,), jnp.int32), **scales))

  @classmethod
  def for_params(cls, config: ModelConfig, params: dict, batch: int, slots: int,
                 dtype=jnp.float32) -> "KVCache":
    """`create` in the layout the layer loop of `params` reads fastest (see the module):
    per layer under "unrolled" on a CPU, else stacked. A GPU's passes move slots of all
    layers at once (a beam's reorder, an accepted path): over a stack one kernel per
    field, per layer L of them (compiled for an H200, beam's step in the smallest program
    `tests/test_gpu_programs.py` builds: 43 kernels against the stack's 34)."""
    unrolled = layer_loop_of(params) == "unrolled"
    return cls.create(config, batch, slots, dtype, per_layer=unrolled and platform.is_cpu())

  @property
  def num_slots(self) -> int:
    return self.seg.shape[1]

  @property
  def quantized(self) -> bool:
    return self.k_scale is not None

  @property
  def per_layer(self) -> bool:
    """Whether K/V are a tuple of per-layer arrays (else one stack each)."""
    return isinstance(self.k, tuple)

  @property
  def dtype(self) -> jnp.dtype:
    """The dtype K and V are stored in."""
    return (self.k[0] if self.per_layer else self.k).dtype

  @property
  def num_kv_heads(self) -> int:
    return (self.k[0] if self.per_layer else self.k).shape[-2]

  def replace(self, **changes) -> "KVCache":
    return dataclasses.replace(self, **changes)

  def slot_fields(self) -> dict[str, Array]:
    """The per-slot contents that move with a slot: K, V (and their scales)."""
    names = ("k", "v", "k_scale", "v_scale") if self.quantized else ("k", "v")
    return {name: getattr(self, name) for name in names}


def check_kv_dtype(dtype) -> str:
  """`dtype`'s name if a cache can hold it (`KV_DTYPES`); else one line naming the option."""
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = None
  if name not in KV_DTYPES:
    raise MdjaxError(f"unknown kv_cache_dtype {dtype!r}; valid: {', '.join(KV_DTYPES)}")
  return name


def quantize_kv(x: Float[Array, "... K H"]) -> tuple[Int[Array, "... K H"], Float[Array, "... K"]]:
  """Keys or values as int8 and a float32 scale per KV head (see the module)."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1) / KV_STEP  # [..., K]
  q = jnp.round(x / jnp.where(scale == 0, 1.0, scale)[..., None])
  return q.astype(jnp.int8), scale


def split_layers(cache: KVCache) -> KVCache:
  """A stacked `cache` as a per-layer one (its K/V and scales cut apart: a copy); a
  per-layer one as it is."""
  if cache.per_layer:
    return cache
  return cache.replace(**{name: tuple(x) for name, x in cache.slot_fields().items()})


def at_layer(field, layer) -> tuple[Array, int | Array]:
  """`(stack, index)` such that `stack[index]` is `layer` of one K/V field (or scale):
  a stacked field and `layer` as they are, or a per-layer field's array as a stack of
  one `[1, B, S, ...]` (a reshape, no copy) and 0; `layer` must then be an int."""
  if not isinstance(field, tuple):
    return field, layer
  return field[_static(layer)][None], 0


def _static(layer) -> int:
  """`layer`, which indexes a per-layer field: an int, or one line naming the option."""
  if not isinstance(layer, int):
    raise MdjaxError("a per-layer KV cache is read by the unrolled layer loop only; "
                     "layer_loop='scan' takes a stacked one (KVCache.create(per_layer=False))")
  return layer


def with_layer(field, layer, stack: Array):
  """`field` with `layer` replaced by what `at_layer` gave, updated (`stack`)."""
  if isinstance(field, tuple):
    return _replaced(field, layer, stack[0])
  return stack


def _replaced(field: tuple, layer: int, array: Array) -> tuple:
  """A per-layer field with layer `layer`'s array replaced by `array`."""
  return field[:layer] + (array,) + field[layer + 1:]


def read_kv(cache: KVCache, layer, pick=lambda x, index: x[index]
            ) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
  """`layer`'s K and V as `pick(stack, index)` reads them from `at_layer`'s view,
  dequantized to float32 for an int8 cache. `pick` indexes or slices the leading axes
  (layer, batch, slot, KV head) only, so it applies to the scales too; by default the
  whole layer `[B, S, K, H]`."""
  read = lambda field: pick(*at_layer(field, layer))
  if not cache.quantized:
    return read(cache.k), read(cache.v)
  return tuple(read(values).astype(jnp.float32) * read(scale)[..., None]
               for values, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)))


def each_layer(fn, field):
  """`fn(x, lead)` over a stacked field (`lead`: `(slice(None),)`, its layer axis), or
  over each array of a per-layer one (`lead`: `()`), so that `x[lead + (rows, slots)]`
  indexes the batch and slot axes of either: for operations on every layer alike
  (moving slots), each in place."""
  if isinstance(field, tuple):
    return tuple(fn(x, ()) for x in field)
  return fn(field, (slice(None),))


def claim_slots(cache: KVCache, positions: Int[Array, "B T"], segments: Int[Array, "B T"],
                slots: Int[Array, "B T"] | None = None) -> tuple[KVCache, Int[Array, "B T"]]:
  """Gives the tokens with `segment >= 0` the next free slots of their row, or the
  `slots` given (a layout the strategy keeps, e.g. one region per branch).

  Records their positions and segments and moves `length` past the last slot taken;
  returns the slot of every token (past the end for padding, which takes no slot).
  Their K/V are written layer by layer (`write_layer`, or the GPU's attention kernel:
  `mdjax.models.decode_attention`). Tokens that would overflow the row are dropped, so
  callers size the cache (`mdjax.generate` does).
  """
  valid = segments >= 0  # [B, T]
  if slots is None:
    slots = cache.length[:, None] + jnp.cumsum(valid, axis=1) - 1  # [B, T]
  slot = jnp.where(valid, slots, cache.num_slots)  # [B, T]
  end = jnp.where(valid, slot + 1, 0).max(axis=1, initial=0)  # [B]
  claimed = cache.replace(
      pos=set_columns(cache.pos, slot, positions), seg=set_columns(cache.seg, slot, segments),
      length=jnp.minimum(jnp.maximum(cache.length, end), cache.num_slots))
  return claimed, slot


def set_columns(row: Int[Array, "B S"], column: Int[Array, "B T"],
                values: Int[Array, "B T"]) -> Int[Array, "B S"]:
  """`row.at[rows, column].set(values, mode="drop")`; on a GPU, for up to `FEW_TOKENS`
  columns, by `set_few`'s selects (the cache's positions and segments, a strategy's
  output buffer and token histories)."""
  if platform.current() == "gpu" and column.shape[1] <= FEW_TOKENS:
    return set_few(row, column, values)
  return row.at[jnp.arange(row.shape[0])[:, None], column].set(values, mode="drop")


def set_few(row: Int[Array, "B S"], slot: Int[Array, "B T"],
            values: Int[Array, "B T"]) -> Int[Array, "B S"]:
  """`row.at[rows, slot].set(values, mode="drop")` for a few tokens, as T selects over
  the whole row (negative slots counted from the end, as jnp's indexing reads them;
  distinct slots): XLA:GPU runs the scatter of one token as a bounds check, then a read
  and an update per array; the selects of both arrays, one or two kernels."""
  num_slots = row.shape[1]
  every = jnp.arange(num_slots)[None, :]  # [1, S]
  slot = jnp.where(slot < 0, slot + num_slots, slot)  # [B, T]
  for t in range(slot.shape[1]):
    row = jnp.where(every == slot[:, t:t + 1], values[:, t:t + 1], row)  # [B, S]
  return row


def write_layer(cache: KVCache, layer: int, slot: Int[Array, "B T"], k: Float[Array, "B T K H"],
                v: Float[Array, "B T K H"]) -> KVCache:
  """Writes one layer's new K/V into the slots `claim_slots` gave (in place under jit).

  A TPU writes them by T selects over the layer's slice, not by a scatter: XLA:TPU
  keeps the cache slots-minor (`{2,4,3,1,0}`; a head_dim of 64 minor would be padded to
  128 lanes) but scatters only head_dim-minor, so for a scatter it copied K and V into
  that layout before the layer loop and back after it (twice the cache per pass from
  8 rows; at 32 rows of 64 tokens, a whole K or V 4 times in every layer). The selects
  read and write the layer's slice where it lies, in one pass over it; the token each
  slot takes (`src`, a scatter of ints `[B, S]`) follows the scatter's own rule
  (docs/benchmarks/programs.md, "The KV cache is not copied")."""
  rows = jnp.arange(slot.shape[0])[:, None]  # [B, 1]
  new = _written(cache, k, v)  # field -> [B, T, K(, H)]
  if platform.current() == "tpu":
    tokens = jnp.broadcast_to(jnp.arange(slot.shape[1], dtype=jnp.int32), slot.shape)  # [B, T]
    src = jnp.full(cache.seg.shape, -1, jnp.int32).at[rows, slot].set(tokens, mode="drop")

    def put(stack, index, values):  # [L, B, S, K(, H)], [B, T, K(, H)]
      written = jax.lax.dynamic_index_in_dim(stack, index, keepdims=False)  # [B, S, K(, H)]
      taken = (src[(...,) + (None,) * (written.ndim - 2)])  # [B, S, 1(, 1)]
      for t in range(slot.shape[1]):
        written = jnp.where(taken == t, values[:, t, None].astype(stack.dtype), written)
      return jax.lax.dynamic_update_index_in_dim(stack, written, index, 0)
  else:
    def put(stack, index, values):
      return stack.at[index, rows, slot].set(values.astype(stack.dtype), mode="drop")

  def put_field(name, values):
    field = getattr(cache, name)
    if isinstance(field, tuple) and platform.current() != "tpu":  # into the layer's own array:
      # through `at_layer`'s stack of one, XLA:CPU copied the whole layer for the scatter
      own = field[_static(layer)]
      return _replaced(field, layer, own.at[rows, slot].set(values.astype(own.dtype), mode="drop"))
    return with_layer(field, layer, put(*at_layer(field, layer), values))

  return cache.replace(**{name: put_field(name, values) for name, values in new.items()})


def _written(cache: KVCache, k: Float[Array, "B T K H"], v: Float[Array, "B T K H"]) -> dict:
  """The fields a layer's write sets: k and v, quantized with their scales in an int8 cache."""
  if not cache.quantized:
    return {"k": k, "v": v}
  (k, k_scale), (v, v_scale) = quantize_kv(k), quantize_kv(v)
  return {"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale}


@programs.jit
def rollback(cache: KVCache, length: Int[Array, "B"]) -> KVCache:
  """Forgets every slot at or after `length` (e.g. rejected draft tokens)."""
  slot = jnp.arange(cache.num_slots)[None, :]  # [1, S]
  return cache.replace(seg=jnp.where(slot < length[:, None], cache.seg, -1), length=length)


@programs.jit
def remap_segments(cache: KVCache, mapping: Int[Array, "B G"]) -> KVCache:
  """Every slot of segment `g` now belongs to segment `mapping[b, g]` (-1: dead).

  E.g. after verifying a draft tree, the accepted nodes' segments map to the main
  segment and the rejected ones to -1; then `compact` closes the gaps.
  """
  remapped = jnp.take_along_axis(mapping, jnp.maximum(cache.seg, 0), axis=1)  # [B, S]
  return cache.replace(seg=jnp.where(cache.seg >= 0, remapped, -1))


@programs.jit
def kill_segments(cache: KVCache, dead: Bool[Array, "B G"]) -> KVCache:
  """Marks the slots of the segments flagged in `dead` as dead (a pruned branch).

  The slots stay occupied until `compact` reclaims them.
  """
  same = jnp.broadcast_to(jnp.arange(dead.shape[1], dtype=jnp.int32), dead.shape)
  return remap_segments(cache, jnp.where(dead, -1, same))


@functools.partial(programs.jit, static_argnames=("width",))
def compact(cache: KVCache, start: Int[Array, "B"], width: int) -> KVCache:
  """Moves the live slots of `[start, start + width)` to its front, in order.

  Slots before `start` are not touched, so a committed prefix is never copied;
  `length` becomes `start + live slots in the window`. With `start = 0` and
  `width = num_slots` this compacts the whole cache. Example (width 5)::

      before  seg 0 0 | 1 -1 3 -1 4 | .       start = 2, length = 7
      after   seg 0 0 | 1  3 4 -1 -1 | .      length = 5
  """
  window = start[:, None] + jnp.arange(width)[None, :]  # [B, W] slot ids, may pass the end
  in_use = window < cache.length[:, None]
  seg_w = jnp.take_along_axis(cache.seg, jnp.minimum(window, cache.num_slots - 1), axis=1)
  live = (seg_w >= 0) & in_use
  # live first, original order kept: slot i takes the window's (i+1)-th live slot, the
  # one past as many slots of live rank <= i (a reduction a GPU fuses; an argsort is a sort)
  rank = jnp.cumsum(live, axis=1, dtype=jnp.int32)  # [B, W] live slots up to each
  order = (rank[:, None, :] <= jnp.arange(width)[None, :, None]).sum(-1, dtype=jnp.int32)
  source = start[:, None] + jnp.minimum(order, width - 1)  # [B, W]
  num_live = rank[:, -1]
  keep = jnp.arange(width)[None, :] < num_live[:, None]  # [B, W]
  return _move_window(cache, start, source, keep).replace(length=start + num_live)


@programs.jit
def move_slots(cache: KVCache, start: Int[Array, "B"], source: Int[Array, "B W"],
               count: Int[Array, "B"]) -> KVCache:
  """Slot `start[b] + i` takes the K/V, position and segment of slot `source[b, i]`
  for i < `count[b]`, and the row ends there: every slot from `start + count` on is
  freed (`rollback`). `compact` when the kept slots are known (an accepted path, in
  order): only they move, and no slot's liveness is read."""
  keep = jnp.arange(source.shape[1])[None, :] < count[:, None]  # [B, W]
  return rollback(_move_window(cache, start, source, keep), start + count)


@functools.partial(programs.jit, static_argnames=("width",))
def gather_slots(cache: KVCache, start: Int[Array, "B"], source: Int[Array, "B W"],
                 width: int) -> KVCache:
  """Copies the K/V of slot `source[b, i]` into slot `start[b] + i`.

  The positions and segment labels of the destination slots stay: a beam reorder
  keeps the layout (which slots belong to which beam, at which position: a source
  holds the same position) and changes only their contents. Only the `width` branch
  slots move; the shared prefix is never copied.
  """
  return _move_window(cache, start, source)


def _move_window(cache: KVCache, start: Int[Array, "B"], source: Int[Array, "B W"],
                 keep: Bool[Array, "B W"] | None = None) -> KVCache:
  """Slot `start[b] + i` takes the K/V of slot `source[b, i]`; with `keep`, also its
  position, and its segment if `keep[b, i]` (else the slot is freed). Destinations
  past the end are dropped.

  K/V (and an int8 cache's scales) move by a gather and a scatter (in place; on a TPU by
  products with one-hot columns, `_move_by_products`); positions and segments by one
  select over the whole row, which a GPU fuses with their gather (a scatter is a kernel
  of its own per array, after a copy of the array it updates)."""
  width = source.shape[1]
  rows = jnp.arange(source.shape[0])[:, None]  # [B, 1]
  source = jnp.minimum(source, cache.num_slots - 1)
  destination = start[:, None] + jnp.arange(width)[None, :]  # [B, W]
  move = lambda x, lead: x.at[lead + (rows, destination)].set(x[lead + (rows, source)],
                                                             mode="drop")
  if platform.current() == "tpu":
    move = functools.partial(_move_by_products, start=start, source=source)
  moved = cache.replace(**{name: each_layer(move, x)
                           for name, x in cache.slot_fields().items()})  # [L, B, S, K(, H)]
  if keep is None:
    return moved
  offset = jnp.arange(cache.num_slots)[None, :] - start[:, None]  # [B, S] slot - start
  inside = (offset >= 0) & (offset < width)
  at = jnp.clip(offset, 0, width - 1)  # [B, S]
  from_slot = jnp.take_along_axis(source, at, axis=1)  # [B, S]
  seg = jnp.where(jnp.take_along_axis(keep, at, axis=1),
                  jnp.take_along_axis(cache.seg, from_slot, axis=1), -1)
  return moved.replace(
      pos=jnp.where(inside, jnp.take_along_axis(cache.pos, from_slot, axis=1), cache.pos),
      seg=jnp.where(inside, seg, cache.seg))


def _move_by_products(x: Array, lead: tuple, *, start: Int[Array, "B"],
                      source: Int[Array, "B W"]) -> Array:
  """`_move_window`'s move of one field `x` `[.., B, S, ...]` (`lead`: its axes before B)
  as a TPU does it: each row's window of slots `[w, w + W)` holding its destinations (`w`
  = `start`, or less where the window would pass the end) is the product of the field
  with one-hot columns `[S, W]` (a destination takes its source, any other slot itself;
  exact: one term each, at the highest precision), written back in place. XLA:TPU
  holds the cache slots-minor, where this product reads the slots as they lie; a gather
  and scatter of slots copied all of K and V into another layout and back, and a
  program with such a move held its cache in that layout, so the attention kernel
  (`mdjax.models.tpu_attention`) copied each layer out of it."""
  num_slots = x.shape[len(lead) + 1]
  width = min(source.shape[1], num_slots)
  window = jnp.minimum(start, num_slots - width)  # [B]
  slot = window[:, None] + jnp.arange(width)[None, :]  # [B, W] the window's slots
  offset = slot - start[:, None]  # [B, W] which destination a slot is, if in [0, W)
  taken = jnp.take_along_axis(source, jnp.clip(offset, 0, source.shape[1] - 1), axis=1)
  taken = jnp.where((offset >= 0) & (offset < source.shape[1]), taken, slot)  # [B, W]
  columns = (taken[:, None, :] == jnp.arange(num_slots)[None, :, None])  # [B, S, W]
  dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16  # int8: exact in bf16
  axes = "l" * len(lead) + "bs" + "kh"[:x.ndim - len(lead) - 2]  # K/V [(L,) B, S, K, H], scales
  moved = jnp.einsum(f"{axes},bsw->{axes.replace('s', 'w')}", x.astype(dtype),
                     columns.astype(dtype), precision=jax.lax.Precision.HIGHEST
                     ).astype(x.dtype)  # [.., B, W, ...]
  for b in range(x.shape[len(lead)]):
    at = (0,) * len(lead) + (b, window[b]) + (0,) * (x.ndim - len(lead) - 2)
    x = jax.lax.dynamic_update_slice(x, jax.lax.slice_in_dim(moved, b, b + 1, axis=len(lead)), at)
  return x
