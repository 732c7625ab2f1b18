"""What every public heads layout shares: the `CheckpointFormat` record and its registry
(`FORMATS`, filled by `mdjax.heads.formats.medusa`, `.eagle` and `.eagle3`), the
file names, and the helpers that read configs and weights files and convert arrays.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.checkpoints import hf, hf_layout
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.errors import CheckpointError, MdjaxError
from mdjax.heads.base import Heads, HeadsConfig
from mdjax.models.config import ModelConfig
from mdjax.models.model import Model
from mdjax.models.transformer import Params

CONFIG_FILE, CARD_FILE = "config.json", "README.md"
WEIGHTS_FILE, TORCH_FILE = hf_layout.WEIGHTS_FILE, "pytorch_model.bin"
# the fields of a decoder layer a head's config.json must share with the model (EAGLE's)
LAYER_FIELDS = ("family", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "qkv_bias", "o_bias",
                "mlp_bias", "qk_norm")


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
  """How one public layout stores heads on disk: `detect` recognises a directory in it
  (and no other layout's; a directory holding only a torch pickle still counts, so
  that reading it says how to convert it), `read` and `write` convert; `family` is the
  head family (`HeadsConfig.family`) it holds."""

  family: str
  read: Callable[[pathlib.Path, ModelConfig | None, np.dtype], tuple[HeadsConfig, Params]]
  write: Callable[[Heads, pathlib.Path, Model | None, np.dtype], None]
  detect: Callable[[pathlib.Path], bool]


FORMATS: dict[str, CheckpointFormat] = {}  # by layout name, in the order they are tried


def register(name: str, checkpoint_format: CheckpointFormat) -> None:
  """Makes `checkpoint_format` the public layout `name`."""
  FORMATS[name] = checkpoint_format


def get(name: str) -> CheckpointFormat:
  """The layout registered as `name`."""
  if name not in FORMATS:
    raise MdjaxError(f"unknown heads layout {name!r}; supported: {', '.join(FORMATS)}")
  return FORMATS[name]


def config_json(directory: pathlib.Path) -> dict:
  file = directory / CONFIG_FILE
  if not file.is_file():
    raise CheckpointError(f"no {CONFIG_FILE} in heads directory {str(directory)!r}")
  return hf.read_json(file)


def weights_file(directory: pathlib.Path, name: str, torch_name: str) -> pathlib.Path:
  """`directory / name`; where only the torch pickle `torch_name` is there, an error
  that says how to convert it."""
  file = directory / name
  if file.is_file():
    return file
  if (directory / torch_name).is_file():
    raise CheckpointError(
        f"{directory / torch_name} is a torch pickle, which mdjax does not read (loading one "
        f"runs code); convert it to {name}: safetensors.torch.save_file({{k: v.clone() for k, v "
        f"in torch.load('{torch_name}').items()}}, '{name}')")
  raise CheckpointError(f"missing weights file {file}")


def model_type_family(model_type) -> str | None:
  return {t: f for f, t in hf.MODEL_TYPES.items()}.get(model_type)


def local_family(name: str) -> str | None:
  """The family of model `name` where it is known here without a download: a random
  model, or a Hugging Face directory (local or shipped)."""
  if name in RANDOM_MODELS:
    return RANDOM_MODELS[name].family
  for directory in (pathlib.Path(name), hf.ASSETS_DIR / name):
    if (directory / CONFIG_FILE).is_file():
      return model_type_family(hf.read_json(directory / CONFIG_FILE).get("model_type"))
  return None


def base_model_of(cfg: dict) -> str:
  return str(cfg.get("base_model_name_or_path") or cfg.get("_name_or_path") or "unknown")


def cast(tensors: dict, dtype) -> dict[str, np.ndarray]:
  return {name: np.ascontiguousarray(np.asarray(t).astype(dtype)) for name, t in tensors.items()}


def to_jax(params: Params, dtype) -> Params:
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(dtype, copy=False)), params)


def write_config(directory: pathlib.Path, cfg: dict) -> None:
  (directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")



def check_layers_match(draft: ModelConfig, model_config: ModelConfig,
                        file: pathlib.Path) -> None:
  """The head runs as the model's layer type (`decoder_config`): its config.json must agree."""
  differ = [f"{n}={getattr(draft, n)!r} (the model's: {getattr(model_config, n)!r})"
            for n in LAYER_FIELDS if getattr(draft, n) != getattr(model_config, n)]
  if differ:
    raise CheckpointError(f"{file}: the EAGLE layers are not the model's: " + ", ".join(differ))


