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

Everything else (embeddings, head, norms, old layers) is copied unchanged.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.random_init import init_params
from mdjax.models.transformer import Params


def grow(params: Params, config: ModelConfig, *, num_kv_heads: int | None = None,
         num_layers: int | None = None, seed: int = 0) -> tuple[Params, ModelConfig]:
  """`(params, config)` grown to `num_kv_heads` and `num_layers` (None = unchanged)."""
  num_kv_heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
  num_layers = config.num_layers if num_layers is None else num_layers
  _check(config, num_kv_heads, num_layers)
  grown = dataclasses.replace(config, num_kv_heads=num_kv_heads, num_layers=num_layers)
  layers = [_more_kv_heads(lp, config, num_kv_heads) for lp in params["layers"]]
  added = num_layers - config.num_layers
  if added:
    new_layers = init_params(dataclasses.replace(grown, num_layers=added), seed)["layers"]
    layers = _interleave(layers, [_silent(lp) for lp in new_layers])
  return {**params, "layers": layers}, grown


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


def _silent(layer: dict) -> dict:
  """A layer that adds zero to the residual stream: zero output projections (and biases)."""
  zeroed = {name: jnp.zeros_like(w) for name, w in layer.items()
            if name in ("wo", "w_down", "bo", "b_down")}
  return {**layer, **zeroed}


def _interleave(old: list, new: list) -> list:
  """`new` spread evenly among `old`: the j-th new layer follows old layer
  round((j + 1) * len(old) / (len(new) + 1))."""
  after = [int(np.round((j + 1) * len(old) / (len(new) + 1))) for j in range(len(new))]
  layers = []
  for i, layer in enumerate(old):
    layers.append(layer)
    layers.extend(n for n, a in zip(new, after) if a == i + 1)
  layers[:0] = [n for n, a in zip(new, after) if a == 0]
  return layers
