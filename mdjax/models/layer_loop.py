"""How the decoder layers are laid out in `params["layers"]`, and so how the forward
walks them (`mdjax.models.transformer`).

* "unrolled": a list of L per-layer dicts, walked by a Python loop. The compiled
  program holds every layer: compile time grows with depth.
* "scan": one dict whose every leaf is the per-layer leaves stacked on a leading
  axis, walked by `jax.lax.scan`. The program holds one group of layers (see
  `transformer.decoder_layers`), so compile time stays nearly flat in depth::

      unrolled   [{"wqkv": [D, Q], "wo": [N H, D], ...}, ... L of them]
      scan       {"wqkv": [L, D, Q], "wo": [L, N H, D], ...}

Stacking is generic over whatever keys the per-layer dicts hold (fused `wqkv` or
split `wq`, `wk`, `wv`, ...); every layer must hold the same keys with the same
shapes (an EAGLE-1 head, whose first layer has no `attn_norm`, stays a list).

The KV cache is `[L, B, S, K, H]` under "scan"; "unrolled" reads it stacked too, but
faster held per layer (`mdjax.cache`, `KVCache.for_params`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mdjax import platform
from mdjax.errors import MdjaxError

LAYER_LOOPS = ("scan", "unrolled")
LAYER_SCOPE = "layer_"  # + the index: the named scope of an unrolled layer's operations


def layer_scope(index: int) -> str:
  """The `jax.named_scope` of unrolled layer `index`: a compiled program's op names say
  which layer each kernel computes (`mdjax.hlo_report`'s per-layer counts)."""
  return f"{LAYER_SCOPE}{index}"


def layer_loop_of(params: dict) -> str:
  """ "scan" when `params["layers"]` is stacked (a dict), "unrolled" when it is a list."""
  return "scan" if isinstance(params["layers"], dict) else "unrolled"


def count_layers(params: dict) -> int:
  """L, in either layout."""
  layers = params["layers"]
  return jax.tree.leaves(layers)[0].shape[0] if isinstance(layers, dict) else len(layers)


def stack_layers(params: dict) -> dict:
  """`params` with its list of L layer dicts stacked into one dict of `[L, ...]` arrays
  (unchanged when already stacked). The stacked arrays are new: until the list is
  dropped, the layers' weights are held twice."""
  layers = params["layers"]
  if isinstance(layers, dict):
    return params
  names = set(layers[0])
  for index, layer in enumerate(layers):
    if set(layer) != names:
      raise MdjaxError(f"cannot stack the layers for layer_loop='scan': layer {index} has "
                       f"{sorted(layer)}, layer 0 has {sorted(names)}")
  return {**params, "layers": {name: jax.tree.map(lambda *w: jnp.stack(w),
                                                 *[layer[name] for layer in layers])
                               for name in layers[0]}}  # each [L, ...] (a quantized one's parts)


def unstack_layers(params: dict) -> dict:
  """The inverse of `stack_layers`: a list of L layer dicts (unchanged when a list)."""
  layers = params["layers"]
  if not isinstance(layers, dict):
    return params
  return {**params, "layers": [{name: jax.tree.map(lambda a: a[i], w) for name, w in layers.items()}
                               for i in range(count_layers(params))]}


def check_layer_loop(loop) -> str:
  """`loop` if it names a layer loop; else `MdjaxError` naming it and the valid ones."""
  if not isinstance(loop, str) or loop not in LAYER_LOOPS:
    raise MdjaxError(f"unknown layer_loop {loop!r}; valid: {', '.join(LAYER_LOOPS)}")
  return loop


def with_layer_loop(params: dict, loop: str) -> dict:
  """`params` laid out for `loop` ("scan" or "unrolled")."""
  return stack_layers(params) if check_layer_loop(loop) == "scan" else unstack_layers(params)


def take_layers(params: dict, n: int) -> dict:
  """`params` with only its first `n` layers, in its own layout (a list: no copy; stacked:
  the first `n` layers' weights copied once, so no step slices them again)."""
  layers = params["layers"]
  if isinstance(layers, dict):
    return {**params, "layers": {name: jax.tree.map(lambda a: _first(a, n), w)
                                 for name, w in layers.items()}}
  return {**params, "layers": layers[:n]}


def _first(stacked, n: int):
  """The first `n` layers of one stacked weight [L, ...] -> [n, ...]; of its shape alone
  when it is a `jax.ShapeDtypeStruct` (a program built for another device's target)."""
  if isinstance(stacked, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((n, *stacked.shape[1:]), stacked.dtype,
                                sharding=stacked.sharding)
  return stacked[:n]


def default_layer_loop() -> str:
  """ "scan" on tpu, "unrolled" on cpu and gpu (the platform built for: `mdjax.platform`).

  A scanned layer reads its weights through a dynamic slice of the `[L, ...]` stack.
  XLA:CPU copies that slice out before the matmuls; decoding is memory-bound, so the
  copies cost time. Measured with `experiments/bench/compile.py` on 2 shared CPU cores
  (8 layers, hidden 256, batch 1): greedy 1.0 ms per token unrolled vs 1.7-2.6 ms
  scanned (a bare `decode_step`: 1.3 vs 2.3 ms).

  XLA:GPU reads the slice in place only in a one-row product, and mdjax runs no one-row
  bfloat16 product (`mdjax.models.numerics.linear`): compiled for an H200
  (`experiments/program_report.py`, random-llama-1b in bfloat16), a scanned
  `decode_step` copies every layer's weights out of the stack first at any tokens and
  batch (1.3-1.9 GB per pass, ~0.38 ms at the H200's 4.8 TB/s), where the unrolled one
  copies nothing and launches fewer kernels (326 against 443 at 1 token, batch 1).
  Unrolled costs compile time instead: 13 s against 3 s on the H200 for 16
  layers (`docs/device/`), where one-token greedy decoding ran at the same speed either
  way. TPUs keep the scan (not measured here).
  """
  return "scan" if platform.current() == "tpu" else "unrolled"
