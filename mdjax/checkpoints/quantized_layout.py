"""A quantized model's params as named tensors and back: what `hf.save_hf` writes for a
model whose matrices are `QuantizedWeight`s, and `hf.load_hf_dir` reads.

The folder is a Hugging Face one (config.json, tokenizer, generation_config.json), but
its safetensors hold mdjax's params by their own names, one tensor per part, and
config.json says how to put them together under `"mdjax_quantization"`::

    layers.3.wqkv.q       int8 [D, (N + 2K) H]     (int4 values held one per byte)
    layers.3.wqkv.scale   float32 [G, (N + 2K) H]
    layers.3.wqkv.offset  float32 [G, ...]          (groups with offsets: int4, GGUF's)
    layers.3.attn_norm    float32 [D]               (a float param: as it is)
    "mdjax_quantization": {"label": "int4, groups of 64 ...",
                           "weights": {"layers.3.wqkv": {"axis": -2, "bits": 4,
                                                          "dtype": "float32"}, ...}}

transformers cannot read these folders (it has no layout for mdjax's groups); mdjax
reads them back, bit for bit: onto one device, or onto a mesh with each process reading
only the slices its devices hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mdjax.models.layer_loop import unstack_layers
from mdjax.models.quantized import from_parts, is_quantized

KEY = "mdjax_quantization"  # config.json's entry
PARTS = ("q", "scale", "offset")


def to_tensors(params: dict, label: str) -> tuple[dict[str, np.ndarray], dict]:
  """`params` as named host arrays, and the config entry that puts them together."""
  tensors, weights = {}, {}
  for name, value in _named(unstack_layers(params)):
    if not is_quantized(value):
      tensors[name] = np.asarray(value)
      continue
    weights[name] = {"axis": value.axis, "bits": value.bits, "dtype": value.dtype.name}
    for part in PARTS:
      array = getattr(value, part)
      if array is not None:
        tensors[f"{name}.{part}"] = np.asarray(array.astype(np.int8) if part == "q" else array)
  return tensors, {"label": label, "weights": weights}


def _named(params: dict):
  for name, value in params.items():
    if name == "layers":
      for i, layer in enumerate(value):
        yield from ((f"layers.{i}.{n}", w) for n, w in layer.items())
    else:
      yield name, value


def from_tensors(tensors: dict[str, Any], entry: dict, xp=None) -> dict:
  """The params `to_tensors` wrote (a list of layers), quantized weights put together, on
  the default device (`xp` jax.numpy, the default), or as recipes read later by slices
  (`xp` `mdjax.checkpoints.lazy`, `tensors` its recipes: for a mesh)."""
  import jax.numpy as jnp
  xp = jnp if xp is None else xp
  weights = entry["weights"]
  flat = {name: from_parts(tensors[f"{name}.q"], tensors[f"{name}.scale"],
                           tensors.get(f"{name}.offset"), axis=meta["axis"], bits=meta["bits"],
                           dtype=meta["dtype"], xp=xp)
          for name, meta in weights.items()}
  flat |= {name: xp.asarray(array) for name, array in tensors.items()
           if name.rsplit(".", 1)[0] not in weights}
  params, layers = {}, {}
  for name, value in flat.items():
    if name.startswith("layers."):
      _, index, param = name.split(".", 2)
      layers.setdefault(int(index), {})[param] = value
    else:
      params[name] = value
  params["layers"] = [layers[i] for i in range(len(layers))]
  return params
