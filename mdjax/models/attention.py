"""Attention of the T tokens fed this step over one layer of the cache.

The step first writes the new tokens' K/V into their cache slots (in place), then
each query attends over the cache: visibility of every slot, the query's own and
its fellow new tokens' included, comes from `mdjax.topology.visible` on
`(seg, pos)`; no dense mask ever crosses an API.

Implementations with the same signature and the same result up to float
summation order:

* `dense_attention` — the readable reference: one `[T, S]` masked softmax.
* `fused_attention` — the same product through `jax.nn.dot_product_attention` (the
  platform's fused kernel; for accelerators).
* `block_sparse_attention` — walks the cache in blocks of `block_size` slots, only
  up to the fullest row's length, and skips every block that no query of the batch
  can see (other branches' tokens, dead slots); an online softmax merges blocks. A
  pass that would skip nothing reads the layer whole, as `dense_attention`.
* `cascade_attention` — for caches laid out in *regions*, one per branch after a
  shared prefix: the prefix is read once for all queries, then each query reads only
  its own branch's region. A block holding several branches' tokens is read by every
  query; a region is read by one, so a step's attention work is N x (prefix + own
  tokens), not N x (prefix + all N branches').

On a GPU, "fused" passes of a few tokens run `mdjax.models.decode_attention` instead: one
kernel per layer that reads only the filled slots, the new tokens' K/V beside the cache.

Each takes the layer's static `LayerAttention` (its sliding window, score scale and
soft-cap), so layers of one model may differ (gemma3 mixes sliding and full ones).

Einsum letters: B batch, T queries, S keys, K kv heads, R query heads per kv head
(N = K * R), H head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mdjax import platform
from mdjax.cache import CacheRegions, KVCache, at_layer, read_kv
from mdjax.errors import MdjaxError
from mdjax.models import tpu_attention
from mdjax.topology import visible

ATTENTIONS = ("block_sparse", "dense", "fused")  # `attention_fn`'s implementations
# The largest key block `block_sparse_attention` walks; `mdjax.generate` rounds caches
# past one block up to whole blocks of it (blocks must tile the cache).
ATTENTION_BLOCK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Queries:
  """What a layer's attention needs besides the cache: the queries and who they are."""

  q: Float[Array, "B T N H"]
  positions: Int[Array, "B T"]
  segments: Int[Array, "B T"]
  slots: Int[Array, "B T"]  # cache slot each query's own K/V went to (past the end: none)
  limit: Int[Array, "B G G"]  # mdjax.topology.visibility_limits


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerAttention:
  """One layer's static attention settings (hashable: part of the compiled program)."""

  sliding_window: int | None = None  # a query at position p sees keys with p - pos < window
  scale: float  # q . k is multiplied by it
  softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), before the mask


def _grouped(q: Float[Array, "B T N H"], num_kv_heads: int,
             scale: float) -> Float[Array, "B T K R H"]:
  b, t, n, h = q.shape
  scaled = q.astype(jnp.float32) * scale
  return scaled.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def _capped(scores: Float[Array, "..."], softcap: float | None) -> Float[Array, "..."]:
  return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _scores(qg, keys, mask, softcap: float | None):
  s = jnp.einsum("btkrh,bskh->bkrts", qg, keys.astype(jnp.float32))  # [B, K, R, T, S]
  return jnp.where(mask[:, None, None], _capped(s, softcap), -jnp.inf)


def _weigh(weights: Float[Array, "B K R T S"], values: Float[Array, "B S K H"]
           ) -> Float[Array, "B K R T H"]:
  return jnp.einsum("bkrts,bskh->bkrth", weights, values.astype(jnp.float32))


def _finish(acc, total, dtype) -> Float[Array, "B T N H"]:
  """acc [B, K, R, T, H] / total [B, K, R, T]; queries that see nothing give 0."""
  out = acc / jnp.where(total > 0, total, 1.0)[..., None]
  b, k, r, t, h = out.shape
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, k * r, h).astype(dtype)


def masked_attention(q: Float[Array, "B T N H"], keys: Float[Array, "B S K H"],
                     values: Float[Array, "B S K H"], mask: Bool[Array, "B T S"], *,
                     scale: float, softcap: float | None = None) -> Float[Array, "B T N H"]:
  """One masked softmax of the queries over `keys` (also the cache-free training path)."""
  scores = _scores(_grouped(q, keys.shape[2], scale), keys, mask, softcap)  # [B, K, R, T, S]
  peak = jnp.max(scores, axis=-1, keepdims=True)
  weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
  return _finish(_weigh(weights, values), weights.sum(-1), q.dtype)


def _pass_mask(queries: Queries, cache: KVCache, spec: LayerAttention) -> Bool[Array, "B T S"]:
  """What each query sees of every slot of the cache."""
  return visible(queries.limit, queries.segments, queries.positions, cache.seg, cache.pos,
                 spec.sliding_window)


def _whole_layer(queries: Queries, cache: KVCache, layer, spec: LayerAttention,
                 mask: Bool[Array, "B T S"]) -> Float[Array, "B T N H"]:
  """One masked softmax over every slot of `layer`, for the queries' `mask`."""
  return masked_attention(queries.q, *read_kv(cache, layer), mask, scale=spec.scale,
                          softcap=spec.softcap)


def dense_attention(queries: Queries, cache: KVCache, layer: int,
                    spec: LayerAttention) -> Float[Array, "B T N H"]:
  """Reference: every slot of `layer`, one masked softmax."""
  return _whole_layer(queries, cache, layer, spec, _pass_mask(queries, cache, spec))


def fused_attention(queries: Queries, cache: KVCache, layer, spec: LayerAttention
                    ) -> Float[Array, "B T N H"]:
  """Every slot of `layer` through `jax.nn.dot_product_attention` with the visibility
  mask `[B, 1, T, S]`: the platform's fused kernel (XLA's; cuDNN's on a GPU where it
  takes the mask), for accelerators, where one large product beats a walk over blocks.
  A soft-capped layer (which the fused kernel cannot cap) uses `dense_attention`.
  Built for a TPU, a pass of a few tokens runs `mdjax.models.tpu_attention` instead:
  one kernel that reads only each row's filled slots.
  Queries that see nothing give 0, as in the others."""
  mask = _pass_mask(queries, cache, spec)  # [B, T, S]
  q = queries.q
  kv_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))
  if tpu_attention.applies(q.shape[1], cache.num_slots, kv_bytes, cache.dtype):
    return _filled_slots_only(queries, cache, layer, spec, mask)
  if spec.softcap is not None:
    return _whole_layer(queries, cache, layer, spec, mask)
  keys, values = read_kv(cache, layer)  # [B, S, K, H]
  out = jax.nn.dot_product_attention(q, keys.astype(q.dtype),
                                     values.astype(q.dtype), mask=mask[:, None],
                                     scale=spec.scale)  # [B, T, N, H]
  return jnp.where(mask.any(-1)[..., None, None], out, 0).astype(q.dtype)


def _filled_slots_only(queries: Queries, cache: KVCache, layer, spec: LayerAttention,
                       mask: Bool[Array, "B T S"]) -> Float[Array, "B T N H"]:
  """`mdjax.models.tpu_attention` where the program is lowered for a TPU; elsewhere (a
  program built for a TPU but run on this host: the tests) the same masked softmax over
  every slot."""
  (k, at), (v, _) = at_layer(cache.k, layer), at_layer(cache.v, layer)

  def reference(q, mask, length, at, k, v):
    del length  # slots past it are never visible
    return masked_attention(q, k[at], v[at], mask, scale=spec.scale, softcap=spec.softcap)

  return jax.lax.platform_dependent(
      queries.q, mask, cache.length, at, k, v,
      tpu=functools.partial(tpu_attention.attention, scale=spec.scale, softcap=spec.softcap),
      default=reference)


def _absorb(carry, scores: Float[Array, "B K R T S"], weigh):
  """Online softmax: folds one more set of key scores into `carry = (peak, total,
  acc)`; `weigh(weights [B, K, R, T, S]) -> [B, K, R, T, H]` sums their values."""
  peak, total, acc = carry  # [B, K, R, T], [B, K, R, T], [B, K, R, T, H]
  new_peak = jnp.maximum(peak, scores.max(-1))
  base = jnp.where(jnp.isfinite(new_peak), new_peak, 0.0)
  rescale = jnp.exp(peak - base)
  weights = jnp.exp(scores - base[..., None])
  return new_peak, total * rescale + weights.sum(-1), acc * rescale[..., None] + weigh(weights)


def _no_keys(qg: Float[Array, "B T K R H"]):
  """The online-softmax carry `(peak, total, acc)` before any key is absorbed."""
  b, t, k, r, h = qg.shape
  return jnp.full((b, k, r, t), -jnp.inf), jnp.zeros((b, k, r, t)), jnp.zeros((b, k, r, t, h))


def _visit_blocks(qg: Float[Array, "B T K R H"], queries: Queries, cache: KVCache, layer: int,
                  spec: LayerAttention, *, block_size: int):
  """The online-softmax carry of the queries over the visible key blocks of `layer`.

  Blocks past the fullest row's `length` are not visited; a visited block's K/V
  are sliced out of the cache only when some query can see into it, so
  invisible blocks are never read.
  """
  b, _, k, _, h = qg.shape
  filled = cache.length.max()

  def visit(block, carry):
    start = block * block_size
    k_pos = jax.lax.dynamic_slice_in_dim(cache.pos, start, block_size, axis=1)  # [B, Bk]
    k_seg = jax.lax.dynamic_slice_in_dim(cache.seg, start, block_size, axis=1)
    mask = visible(queries.limit, queries.segments, queries.positions, k_seg, k_pos,
                   spec.sliding_window)  # [B, T, Bk]

    def read_block(carry):
      size = (1, b, block_size, k, h)
      keys, values = read_kv(cache, layer, lambda x, at: jax.lax.dynamic_slice(
          x, (at, 0, start, 0, 0)[:x.ndim], size[:x.ndim])[0])  # [B, Bk, K, H] each
      return _absorb(carry, _scores(qg, keys, mask, spec.softcap),
                     functools.partial(_weigh, values=values))

    return jax.lax.cond(mask.any(), read_block, lambda c: c, carry)

  return jax.lax.fori_loop(0, (filled + block_size - 1) // block_size, visit, _no_keys(qg))


# Queries per tile of a long feed (prefill), each tile skipping the key blocks it cannot
# see. SmolLM2's prefill of 6,144 tokens on the 2-core CPU: 16.5-17.0 s in tiles of 64,
# 17.5-18.4 in tiles of 32, 128 or 256, 21.1-21.8 in tiles of 512 (key blocks of 128).
QUERY_BLOCK = 64


# Caches of fewer slots are always walked: both ways cost about the same there (SmolLM2
# at 256 slots: 16.1 and 16.0 ms a step), and a program with both compiles and runs more
# (the suite's test_self_speculative: 22 s walking only, 32 s with the choice).
WHOLE_READ_SLOTS = 1024


def walk_pays(mask: Bool[Array, "B T S"], length: Int[Array, "B"], block_size: int
              ) -> Bool[Array, ""]:
  """Whether a pass with `mask` walks the cache's blocks rather than reading it whole
  (`dense_attention`): some filled block is seen by no query (the walk skips it), or
  less than half the cache is filled (the walk reads only filled blocks). A walk slices
  each block out and copies it for XLA:CPU's products; a layer read whole is copied
  once: SmolLM2's greedy step over 6,144 cached tokens took 50.6 ms walking, 28.6 read
  whole (docs/benchmarks/context.md)."""
  b, t, num_slots = mask.shape
  num_blocks = num_slots // block_size
  seen = mask.reshape(b, t, num_blocks, block_size).any((0, 1, 3))  # [blocks]
  filled = (length.max() + block_size - 1) // block_size
  return (~seen & (jnp.arange(num_blocks) < filled)).any() | (2 * filled < num_blocks)


def block_sparse_attention(queries: Queries, cache: KVCache, layer: int, spec: LayerAttention, *,
                           block_size: int) -> Float[Array, "B T N H"]:
  """Online-softmax attention over the visible key blocks of `layer` only (a sliding
  window makes the blocks wholly behind every query's window invisible too).
  `block_size` must divide the slot count. A pass of up to `QUERY_BLOCK` queries that
  would skip no block, over a cache of `WHOLE_READ_SLOTS` or more at least half filled,
  reads the layer whole instead (`walk_pays`): the same sum, faster.

  More than `QUERY_BLOCK` queries (a prefill) are cut into tiles of that many, and each
  tile visits only the key blocks *it* can see: a prefill of N questions over one
  context reads, per tile, the context and its own questions' blocks, not all N
  questions' (with one tile, every question block is visible to some query, so the
  prefill's attention grew as N^2)::

      key blocks      ctx ctx | q0-q3 | q4-q7 | ...
      query tile 0    ctx ctx | q0-q3                 (q4... never read by tile 0)
  """
  qg = _grouped(queries.q, cache.num_kv_heads, spec.scale)  # [B, T, K, R, H]
  b, t = queries.segments.shape
  if t <= QUERY_BLOCK:
    def walk(_):
      _, total, acc = _visit_blocks(qg, queries, cache, layer, spec, block_size=block_size)
      return _finish(acc, total, queries.q.dtype)

    if cache.num_slots < WHOLE_READ_SLOTS:
      return walk(None)
    mask = _pass_mask(queries, cache, spec)  # [B, T, S]
    return jax.lax.cond(walk_pays(mask, cache.length, block_size), walk,
                        lambda _: _whole_layer(queries, cache, layer, spec, mask), None)
  tiles = -(-t // QUERY_BLOCK)

  def tiled(x, fill):  # [B, T, ...] -> [tiles, B, Q, ...], padded with `fill`
    x = jnp.pad(x, [(0, 0), (0, tiles * QUERY_BLOCK - t)] + [(0, 0)] * (x.ndim - 2),
                constant_values=fill)
    return jnp.moveaxis(x.reshape(b, tiles, QUERY_BLOCK, *x.shape[2:]), 1, 0)

  def one_tile(tile):
    qg_tile, positions, segments = tile  # padding queries: segment -1, they see nothing
    part = dataclasses.replace(queries, positions=positions, segments=segments)
    _, total, acc = _visit_blocks(qg_tile, part, cache, layer, spec, block_size=block_size)
    return _finish(acc, total, queries.q.dtype)  # [B, Q, N, H]

  out = jax.lax.map(one_tile, (tiled(qg, 0), tiled(queries.positions, 0),
                               tiled(queries.segments, -1)))  # [tiles, B, Q, N, H]
  return jnp.moveaxis(out, 0, 1).reshape(b, tiles * QUERY_BLOCK, *out.shape[3:])[:, :t]


def cascade_attention(queries: Queries, cache: KVCache, layer: int, spec: LayerAttention, *,
                      regions: CacheRegions) -> Float[Array, "B T N H"]:
  """Attention over a cache of `regions = (shared, size, in_order)`: slots `[0, shared)`
  hold what several branches see, then region j (`size` slots from `shared + j * size`)
  holds branch j's own tokens. Three branches, a query of branch 1::

      slot    0 ............ shared | region 0 | region 1 | region 2 |
      read    at once, all queries  |          | this query|          |

  The shared part is one masked product for all queries (its length is static and
  every branch sees it, so there is nothing to skip; one product runs faster than a
  walk over its blocks); then each query reads the region its own slot lies in, up
  to where it is filled, and merges it in (`_absorb_own_regions`). Exact only when
  no query sees a token outside the shared part and its own region, and the queries
  are their regions' newest tokens (the strategy's layout guarantees both; the mask
  still decides within them).
  """
  qg = _grouped(queries.q, cache.num_kv_heads, spec.scale)  # [B, T, K, R, H]
  shared = slice(0, regions.shared)
  mask = visible(queries.limit, queries.segments, queries.positions, cache.seg[:, shared],
                 cache.pos[:, shared], spec.sliding_window)  # [B, T, shared]
  keys, values = read_kv(cache, layer, lambda x, at: x[at, :, shared])  # [B, shared, K, H]
  carry = _absorb(_no_keys(qg), _scores(qg, keys, mask, spec.softcap),
                  functools.partial(_weigh, values=values))
  _, total, acc = _absorb_own_regions(carry, qg, queries, cache, layer, regions, spec)
  return _finish(acc, total, queries.q.dtype)


def _absorb_own_regions(carry, qg: Float[Array, "B T K R H"], queries: Queries, cache: KVCache,
                        layer: int, regions: CacheRegions, spec: LayerAttention,
                        max_chunk: int = 16):
  """Folds each query's own region into the online-softmax `carry`, chunk by chunk
  of at most `max_chunk` slots, only as far as the fullest region is filled (a region
  is sized for the whole budget; its branch fills it in order, the query's own slot
  last). When the pass is `in_order` (query t lies in region t) a chunk of the first
  T regions is one static view of the cache; otherwise each query gathers its own."""
  shared, size, in_order = regions
  b, t = queries.slots.shape
  chunk = max(d for d in range(1, min(max_chunk, size) + 1) if size % d == 0)
  own = (queries.slots >= shared) & (queries.slots < cache.num_slots)  # [B, T]
  region = jnp.where(own, (queries.slots - shared) // size, 0)  # [B, T]
  filled = jnp.where(own, queries.slots - shared - region * size + 1, 0).max()
  rows = jnp.arange(b)[:, None, None]

  def absorb(keys, values, k_seg, k_pos, carry):  # [B, T, C, K, H] x2, [B, T, C] x2
    mask = visible(queries.limit, queries.segments, queries.positions, k_seg, k_pos,
                   spec.sliding_window) & own[..., None]  # [B, T, C]
    scores = _capped(jnp.einsum("btkrh,btskh->bkrts", qg, keys.astype(jnp.float32)),
                     spec.softcap)

    def weigh(weights):  # XLA:CPU runs this 5x faster with the batch dims (b, t, k) leading
      return jnp.einsum("btkrs,btskh->btkrh", weights.transpose(0, 3, 1, 2, 4),
                        values.astype(jnp.float32)).transpose(0, 2, 3, 1, 4)

    return _absorb(carry, jnp.where(mask[:, None, None], scores, -jnp.inf), weigh)

  def gathered(index, carry):
    slot = shared + (region * size + index * chunk)[..., None] + jnp.arange(chunk)  # [B, T, C]
    # one gather at (layer, row, slot): indexing the stack at the layer first would copy
    # the whole layer out of it, every chunk, when `layer` is traced (the scan layer loop)
    return absorb(*read_kv(cache, layer, lambda x, at: x[at, rows, slot]), cache.seg[rows, slot],
                  cache.pos[rows, slot], carry)

  def in_order_chunk(index, carry):
    def cut(x, axis=1):  # [.., B, S, ...] -> [.., B, T, C, ...]: chunk `index` of T regions
      regions_view = jax.lax.slice_in_dim(x, shared, shared + t * size, axis=axis).reshape(
          *x.shape[:axis], t, size, *x.shape[axis + 1:])
      return jax.lax.dynamic_slice_in_dim(regions_view, index * chunk, chunk, axis=axis + 1)

    def cut_layer(x, at):  # [L, B, S, K, H] -> [B, T, C, K, H]; the layer picked last, so
      # that only the chunk is read (picked first, the whole layer would be copied out)
      return jax.lax.dynamic_index_in_dim(cut(x, axis=2), at, keepdims=False)
    return absorb(*read_kv(cache, layer, cut_layer), cut(cache.seg), cut(cache.pos), carry)

  if in_order and shared + t * size > cache.num_slots:
    raise ValueError(f"an in-order pass of {t} queries needs {t} regions of {size} slots after "
                     f"{shared}, but the cache has {cache.num_slots} slots")
  return jax.lax.fori_loop(0, -(-filled // chunk), in_order_chunk if in_order else gathered,
                           carry)


def default_attention() -> str:
  """ "block_sparse" on the cpu backend, "fused" on gpu and tpu: what `generate` uses
  unless the call names an `attention`.

  Measured on an H200 (`docs/device/`: a random 1B llama in bfloat16, greedy at batch
  1): block_sparse 6.9 ms per decoded token at a 1k context and 41 ms at 8k, fused 1.9
  and 2.1, dense 2.0 and 2.2. The block-sparse walk is a loop over key blocks, each a
  dynamic slice and a few small kernels, which a GPU runs one after another; fused and
  dense are a few large products over every slot. On CPU skipping invisible blocks is
  what pays (`experiments/bench/branches.py`). A TPU is not measured; it gets the GPU's
  choice, since XLA:TPU also prefers few large products.
  """
  return "block_sparse" if platform.is_cpu() else "fused"


def check_attention(impl: str) -> str:
  """`impl` when it names one of `ATTENTIONS`, else an `MdjaxError` naming it."""
  if impl not in ATTENTIONS:
    raise MdjaxError(f"attention must be one of {', '.join(ATTENTIONS)}, got {impl!r}")
  return impl


def attention_fn(impl: str, num_slots: int, max_block_size: int = ATTENTION_BLOCK,
                 regions: CacheRegions | None = None):
  """The attention of `impl`; the block size is the largest divisor of `num_slots`
  not above `max_block_size` (blocks must tile the cache exactly). With `regions`,
  "block_sparse" becomes `cascade_attention`; "dense" and "fused" read every slot anyway."""
  if check_attention(impl) == "dense":
    return dense_attention
  if impl == "fused":
    return fused_attention
  if regions is not None:
    return functools.partial(cascade_attention, regions=regions)
  block_size = max(d for d in range(1, min(max_block_size, num_slots) + 1) if num_slots % d == 0)
  return functools.partial(block_sparse_attention, block_size=block_size)
