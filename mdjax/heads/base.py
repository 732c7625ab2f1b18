"""Multi-token-prediction heads: what every family shares.

Heads are small networks over a frozen model's final-norm hidden states
(`mdjax.decode_step` returns them beside the logits) that guess tokens further
ahead than the next one; they share the model's unembedding (`lm_head`), so a
shipped set of heads is a few MB. A set of heads is plain data: a `HeadsConfig`
(static, hashable: strategies hold it as a jit argument) and a params pytree.

    family   params                                       predicts (fed hidden h_t)
    medusa   blocks: w [K, L, D, D], b [K, L, D]           head k: token t + 1 + k
             lm_head [K, D, V]  (own unembeddings only)   (k = 1..K; t + 1 is the model's)
    eagle    fc [2D, D], fc_bias [D], layers (decoder      the feature at t + 1, and the
             layers), final_norm [D] (see `mdjax.heads.   token after it via the lm_head
             eagle`; EAGLE-1 has no first attn_norm and
             no final_norm)
    mtp      layers (L decoder layers per head, leaves    head k: token t + 1 + k, reading
             stacked [K, ...]), final_norm [K, D] (see    h_0 .. h_t through its own
             `mdjax.heads.mtp`)                           attention (k = 1..K)

On disk (`save_heads` / `load_heads`): a directory with `heads.json` (the config),
`heads.safetensors` (the params, flattened with "." between keys) and `README.md`
(the model card: base model, data, held-out numbers), written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from mdjax.errors import CheckpointError, MdjaxError, check_count
from mdjax.files import atomic_directory
from mdjax.models.config import ModelConfig, weight_dtype

FAMILIES = ("medusa", "eagle", "mtp")
CONFIG_FILE, WEIGHTS_FILE, CARD_FILE = "heads.json", "heads.safetensors", "README.md"
ASSETS_DIR = pathlib.Path(__file__).resolve().parent.parent / "assets"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadsConfig:
  """What a set of heads is and which model it was trained on.

  `base_family`, `hidden_size` and `vocab_size` must match the model the heads run on
  (`check_model`); `base_model` names it (informational). `top_accuracy[k][j]` is head
  k's held-out accuracy of its top-(j + 1) guesses: Medusa builds its tree from it.
  `tree` is a calibrated Medusa tree (each node the path of top-k ranks from the root),
  None to build one from `top_accuracy` at run time.
  """

  family: str
  base_model: str
  base_family: str
  hidden_size: int
  vocab_size: int
  num_heads: int = 1  # medusa, mtp: K heads; eagle: 1 (it drafts autoregressively)
  num_layers: int = 1  # medusa: residual blocks per head; eagle: decoder layers; mtp: decoder
  #                      layers per head (1 in Gloeckle et al.)
  own_unembedding: bool = False  # medusa: each head has its own lm_head [D, V]
  top_accuracy: tuple[tuple[float, ...], ...] = ()
  tree: tuple[tuple[int, ...], ...] | None = None

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise MdjaxError(f"unknown heads family {self.family!r}; supported: {', '.join(FAMILIES)}")
    for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
      check_count(f"heads {name}", getattr(self, name), 1)
    if self.own_unembedding and self.family != "medusa":
      raise MdjaxError(f"only medusa heads have their own unembedding; {self.family} heads share "
                       "the model's (own_unembedding must be False)")
    object.__setattr__(self, "top_accuracy", tuple(tuple(map(float, row))
                                                   for row in self.top_accuracy))
    if self.tree is not None:
      object.__setattr__(self, "tree", tuple(tuple(map(int, node)) for node in self.tree))

  def check_model(self, config: ModelConfig) -> None:
    """Raises `MdjaxError` naming both sides when the heads cannot run on `config`."""
    for name, heads_value, model_value in (
        ("family", self.base_family, config.family),
        ("hidden size", self.hidden_size, config.hidden_size),
        ("vocabulary", self.vocab_size, config.vocab_size)):
      if heads_value != model_value:
        raise MdjaxError(f"the heads were trained on {self.base_model!r} ({name} {heads_value}) "
                         f"and cannot run on this model ({name} {model_value})")

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: dict) -> "HeadsConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
      raise CheckpointError(f"unknown heads config keys {unknown}; known: {sorted(known)}")
    return cls(**data)


@dataclasses.dataclass(frozen=True)
class Heads:
  """A set of heads: its config, its params pytree (jax arrays), its card text, the
  name it was loaded by and the directory it was read from (None: built in memory)."""

  config: HeadsConfig
  params: dict
  card: str = ""
  name: str = ""
  path: str | None = None

  def check_model(self, config: ModelConfig) -> None:
    self.config.check_model(config)


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


def cast_floats(params, dtype):
  """`params` with every floating array cast to `dtype`."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      params)


def load_heads(path_or_name: str | os.PathLike, dtype="float32") -> Heads:
  """Heads from a directory `save_heads` wrote, a directory in a public layout
  (FasterDecoding's or vLLM's Medusa, EAGLE: `mdjax.heads.formats`), or a shipped name
  (`smollm2-135m-instruct-medusa`, ...)."""
  from mdjax.heads import formats  # formats imports this module
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
