"""Function-preserving growth of a trained model: more key/value heads, more layers.

A grown model computes exactly the logits of the model it grew from, so training
continues from its quality with more capacity (Net2Net-style, for the llama layout):

* **Key/value heads** `K -> K'` (`K'` a multiple of `K` dividing the `N` query heads).
  Query head `i` reads kv group `i // (N / K)`; after growth it reads group
  `i // (N / K')`, whose key and value projections (and q/k/v biases, where the family
  has them) are copies of its old group's:

      K = 2, N = 6:   q0 q1 q2 | q3 q4 q5        wqkv columns [q (N*H) | k (K*H) | v (K*H)]
                      k0       | k1
      K' = 6:         q0 q1 q2 | q3 q4 q5
                      k0 k0 k0 | k1 k1 k1        (then free to drift apart in training)

* **Layers** `L -> L'`: new layers are spread evenly between the old ones. Each is a
  seeded random layer whose output projections (`wo`, `w_down`) are zero, so it adds
  nothing to the residual stream until training moves those projections:

      L = 6, L' = 8:  old0 old1 NEW old2 old3 NEW old4 old5

  gemma3 norms each block's output before the residual add, and an RMSNorm of zero
  has a gradient of 1 / sqrt(eps) (~1000): the first step would jump a zeroed block's
  output to full size. So there the projections stay random and the two output norms
  scale by zero instead (`1 + weight` with weight -1), which grows smoothly from 0.
  Models with per-layer attention kinds (`layer_types`: gemma3's sliding and full
  layers) keep every old layer's kind; a new layer takes the kind of the old layer
  before it (the first old layer's, when placed first):

      S S S S S F  ->  S S [S] S S [S] S F      (L = 6 -> 8)

Everything else (embeddings, head, norms, old layers) is copied unchanged.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.layer_loop import layer_loop_of, unstack_layers, with_layer_loop
from mdjax.models.random_init import init_params
from mdjax.models.transformer import Params


def grow(params: Params, config: ModelConfig, *, num_kv_heads: int | None = None,
         num_layers: int | None = None, seed: int = 0) -> tuple[Params, ModelConfig]:
  """`(params, config)` grown to `num_kv_heads` and `num_layers` (None = unchanged);
  the params keep their layer loop's layout (`mdjax.models.layer_loop`)."""
  loop = layer_loop_of(params)
  params = unstack_layers(params)
  num_kv_heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
  num_layers = config.num_layers if num_layers is None else num_layers
  _check(config, num_kv_heads, num_layers)
  added = num_layers - config.num_layers
  after = _places(config.num_layers, added)  # new layer j follows old layer after[j]
  layer_types = config.layer_types
  if layer_types is not None:
    new_types = [layer_types[max(a - 1, 0)] for a in after]
    layer_types = tuple(_interleave(list(layer_types), new_types, after))
  grown = dataclasses.replace(config, num_kv_heads=num_kv_heads, num_layers=num_layers,
                              layer_types=layer_types)
  layers = [_more_kv_heads(lp, config, num_kv_heads) for lp in params["layers"]]
  if added:
    new_layers = init_params(dataclasses.replace(grown, num_layers=added, layer_types=None),
                             seed)["layers"]
    layers = _interleave(layers, [_silent(lp, config) for lp in new_layers], after)
  return with_layer_loop({**params, "layers": layers}, loop), grown


def _check(config: ModelConfig, num_kv_heads: int, num_layers: int) -> None:
  n, k = config.num_heads, config.num_kv_heads
  if num_kv_heads < k or num_kv_heads % k or n % num_kv_heads:
    raise MdjaxError(f"cannot grow {k} key/value heads to {num_kv_heads}: the new count must "
                     f"be a multiple of {k} that divides the {n} query heads")
  if num_layers < config.num_layers:
    raise MdjaxError(f"cannot grow {config.num_layers} layers to {num_layers}: growth only "
                     "adds layers")


def _more_kv_heads(layer: dict, config: ModelConfig, num_kv_heads: int) -> dict:
  """`wqkv` [D, (N + 2K) * H] -> [D, (N + 2K') * H], each kv head repeated K'/K times, and
  `bqkv` [(N + 2K) * H] alike. The q/k norms ([H], one per head dimension, shared by all
  heads) need no change."""
  n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
  if num_kv_heads == k:
    return layer
  repeat = num_kv_heads // k

  def regrouped(w):  # [..., (N + 2K) * H] -> [..., (N + 2K') * H]
    q, key, value = jnp.split(w, [n * h, (n + k) * h], axis=-1)

    def repeated(x):  # [..., K*H] -> [..., K'*H], head j' = old head j' // repeat
      heads = x.reshape(*x.shape[:-1], k, h)
      return jnp.repeat(heads, repeat, axis=-2).reshape(*x.shape[:-1], num_kv_heads * h)

    return jnp.concatenate([q, repeated(key), repeated(value)], axis=-1)

  return {**layer, **{name: regrouped(layer[name]) for name in ("wqkv", "bqkv")
                      if name in layer}}


def _silent(layer: dict, config: ModelConfig) -> dict:
  """A layer that adds zero to the residual stream: zero output projections (and
  biases), or, where the outputs are normed (gemma3), output norms that scale by zero."""
  if config.gemma_norms:
    zeroed = {name: jnp.full_like(layer[name], -1.0)
              for name in ("post_attn_norm", "post_mlp_norm")}
  else:
    zeroed = {name: jnp.zeros_like(w) for name, w in layer.items()
              if name in ("wo", "w_down", "bo", "b_down")}
  return {**layer, **zeroed}


def _places(old: int, new: int) -> list[int]:
  """Where `new` layers spread evenly among `old` go: the j-th follows old layer
  round((j + 1) * old / (new + 1)) (counting from 1; 0: before them all)."""
  return [int(np.round((j + 1) * old / (new + 1))) for j in range(new)]


def _interleave(old: list, new: list, after: list[int]) -> list:
  """`old` with `new[j]` inserted after its `after[j]`-th item."""
  items = [n for n, a in zip(new, after) if a == 0]
  for i, item in enumerate(old):
    items.append(item)
    items.extend(n for n, a in zip(new, after) if a == i + 1)
  return items
