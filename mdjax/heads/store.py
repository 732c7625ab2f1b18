"""mdjax's own file format for heads, and `load_heads`, which also reads the public
layouts (`mdjax.heads.formats`) and the shipped heads by name.

On disk (`save_heads` / `load_heads`): a directory with `heads.json` (the config),
`heads.safetensors` (the params, flattened with "." between keys: `flatten`) and
`README.md` (the model card: base model, data, held-out numbers), written atomically::

    heads.json          {"family": "medusa", "base_model": ..., "num_heads": 4, ...}
    heads.safetensors   blocks.w [K, L, D, D], blocks.b [K, L, D]      (medusa)
                        layers.0.wqkv [...], ..., final_norm [D]        (a list: "0", "1", ...)
    README.md
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from mdjax.errors import CheckpointError
from mdjax.files import atomic_directory
from mdjax.heads import formats
from mdjax.heads.base import Heads, HeadsConfig, cast_floats
from mdjax.heads.formats import CARD_FILE
from mdjax.models.config import weight_dtype

CONFIG_FILE, WEIGHTS_FILE = "heads.json", "heads.safetensors"
ASSETS_DIR = pathlib.Path(__file__).resolve().parent.parent / "assets"


def flatten(params, prefix: str = "") -> dict[str, np.ndarray]:
  """A nested dict/list pytree as {"a.0.b": array}."""
  if isinstance(params, dict):
    items = params.items()
  elif isinstance(params, (list, tuple)):
    items = enumerate(params)
  else:
    return {prefix[:-1]: np.asarray(params)}
  out = {}
  for key, value in items:
    out.update(flatten(value, f"{prefix}{key}."))
  return out


def unflatten(flat: dict[str, np.ndarray]):
  """The inverse of `flatten`: integer keys become lists."""
  tree: dict = {}
  for key, value in flat.items():
    node, parts = tree, key.split(".")
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = value

  def listify(node):
    if not isinstance(node, dict):
      return jnp.asarray(node)
    if node and all(k.isdigit() for k in node):
      return [listify(node[str(i)]) for i in range(len(node))]
    return {k: listify(v) for k, v in node.items()}
  return listify(tree)


def save_heads(heads: Heads, path: str | os.PathLike, dtype=None) -> None:
  """Writes `heads` as a directory (replaced atomically): config, weights (cast to
  `dtype`, "float32" or "bfloat16", when given), card."""
  params = jax.device_get(heads.params)
  if dtype is not None:
    params = cast_floats(params, weight_dtype(dtype))
  with atomic_directory(path) as staging:
    (staging / CONFIG_FILE).write_text(json.dumps(heads.config.to_json(), indent=2) + "\n")
    safetensors.numpy.save_file(flatten(params), str(staging / WEIGHTS_FILE))
    (staging / CARD_FILE).write_text(heads.card or f"# {pathlib.Path(path).name}\n")


def shipped_heads() -> list[str]:
  """Names of the heads shipped under `mdjax/assets`."""
  if not ASSETS_DIR.is_dir():
    return []
  return sorted(p.name for p in ASSETS_DIR.iterdir() if (p / CONFIG_FILE).is_file())


def load_heads(path_or_name: str | os.PathLike, dtype="float32") -> Heads:
  """Heads from a directory `save_heads` wrote, a directory in a public layout
  (FasterDecoding's or vLLM's Medusa, EAGLE: `mdjax.heads.formats`), or a shipped name
  (`smollm2-135m-instruct-medusa`, ...)."""
  dtype = weight_dtype(dtype)
  text = str(path_or_name)
  directory = ASSETS_DIR / text if text in shipped_heads() else pathlib.Path(text)
  if not (directory / CONFIG_FILE).is_file():
    if directory.is_dir() and formats.detect_layout(directory) is not None:
      return formats.import_heads(directory, dtype=dtype)
    raise CheckpointError(f"no heads at {text!r}: expected a directory holding {CONFIG_FILE} or "
                          f"heads in a public layout ({', '.join(formats.LAYOUTS)}), or a "
                          f"shipped name ({', '.join(shipped_heads()) or 'none shipped'})")
  try:
    config = HeadsConfig.from_json(json.loads((directory / CONFIG_FILE).read_text()))
    params = cast_floats(unflatten(safetensors.numpy.load_file(str(directory / WEIGHTS_FILE))),
                         dtype)
  except (OSError, ValueError, TypeError, safetensors.SafetensorError) as e:
    raise CheckpointError(f"cannot read the heads in {directory}: {e}") from None
  card = (directory / CARD_FILE).read_text() if (directory / CARD_FILE).is_file() else ""
  return Heads(config=config, params=params, card=card, name=text, path=str(directory))
