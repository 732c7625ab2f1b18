"""SafeAILab's EAGLE-1/2 layout ("eagle"), onto `EagleHead`'s params
(`mdjax.heads.eagle`); the picture is `mdjax.heads.formats`'."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from mdjax.errors import CheckpointError, MdjaxError
from mdjax.heads.base import Heads, HeadsConfig
from mdjax.heads.decoder import decoder_config
from mdjax.heads.formats.common import (CONFIG_FILE, TORCH_FILE, WEIGHTS_FILE, CheckpointFormat,
                                        base_model_of, cast, check_layers_match, config_json,
                                        register, to_jax, weights_file, write_config)
from mdjax.checkpoints import hf, hf_layout
from mdjax.checkpoints.hf_layout import SafetensorsFile
from mdjax.models.config import ModelConfig
from mdjax.models.model import Model
from mdjax.models.transformer import Params

# what `hf_layout.params_from_hf` reads of a model and an EAGLE head lacks
EAGLE_STAND_INS = ("model.embed_tokens.weight", "model.norm.weight",
                   "model.layers.0.input_layernorm.weight")


class _EagleAsModel:
  """An EAGLE checkpoint as a `TensorSource` of a model's tensors: HF's `model.layers.{i}.`
  is EAGLE's `layers.{i}.`, and what EAGLE lacks (`EAGLE_STAND_INS`) reads as ones, for
  the caller to drop."""

  def __init__(self, tensors: SafetensorsFile):
    self.tensors = tensors

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name in EAGLE_STAND_INS:
      return np.ones(shape, np.float32)
    return self.tensors.get(name.removeprefix("model."), shape)


def _eagle_layers(draft: ModelConfig, tensors: SafetensorsFile, dtype) -> list[Params]:
  """The decoder layers in `transformer`'s layout, layer 0 without attn_norm."""
  # a one-token vocabulary keeps the stand-in embedding [1, D]
  reader = dataclasses.replace(draft, vocab_size=1, tie_word_embeddings=True)
  layers = hf_layout.params_from_hf(reader, _EagleAsModel(tensors), dtype)["layers"]
  del layers[0]["attn_norm"]
  return layers


def _eagle_layers_to_hf(config: ModelConfig, layers: list[Params], dtype) -> dict[str, np.ndarray]:
  """The inverse of `_eagle_layers`, by EAGLE's tensor names."""
  d = config.hidden_size
  writer = dataclasses.replace(config, vocab_size=1, tie_word_embeddings=True)
  stand_in = {"embed": np.ones((1, d)), "final_norm": np.ones(d),
              "layers": [{"attn_norm": np.ones(d), **layers[0]}, *layers[1:]]}
  tensors = hf_layout.params_to_hf(writer, stand_in, dtype)
  return {name.removeprefix("model."): t for name, t in tensors.items()
          if name not in EAGLE_STAND_INS}


def _read_eagle(directory: pathlib.Path, model_config: ModelConfig | None,
                dtype) -> tuple[HeadsConfig, Params]:
  file = weights_file(directory, WEIGHTS_FILE, TORCH_FILE)
  cfg = config_json(directory)
  try:
    draft = hf.config_from_hf(cfg)
  except CheckpointError as e:
    raise CheckpointError(f"{directory}: {e}") from None
  if model_config is not None:
    check_layers_match(draft, model_config, directory / CONFIG_FILE)
  tensors = SafetensorsFile(file)
  d = draft.hidden_size
  if "d2t" in tensors or tensors.shape("fc.weight", 2) == (d, 3 * d):
    raise CheckpointError(f"{directory} holds EAGLE-3 heads (an fc over three target layers, a "
                          "d2t draft vocabulary), not EAGLE-1/2 heads: read them with layout "
                          "'eagle3' (or let load_heads detect it)")
  params = {"fc": tensors.get("fc.weight", (d, 2 * d)).T,  # [2D, D]
            "fc_bias": tensors.get("fc.bias", (d,)) if cfg.get("bias", True) else np.zeros(d),
            "layers": _eagle_layers(draft, tensors, dtype)}
  tensors.check_all_read(ignored=("embed_tokens.weight",))
  config = HeadsConfig(family="eagle", base_model=base_model_of(cfg), base_family=draft.family,
                       hidden_size=d, vocab_size=draft.vocab_size, num_layers=draft.num_layers)
  return config, to_jax(params, dtype)


def _check_eagle_shape(params: Params) -> None:
  if "final_norm" in params:
    raise MdjaxError("the eagle layout has no final norm and these heads have one (init_eagle "
                     "adds one); only EAGLE-1-shaped heads export")
  layers = params["layers"]
  if "attn_norm" in layers[0] or any("attn_norm" not in layer for layer in layers[1:]):
    raise MdjaxError("the eagle layout's layer 0, and only it, has no attn_norm (input "
                     "norm); these heads' layers differ")


def _write_eagle(heads: Heads, directory: pathlib.Path, model: Model | None, dtype) -> None:
  if model is None:
    raise MdjaxError("exporting eagle heads needs the model (model=): the layout's config.json "
                     "is the model's, and EAGLE's loader wants the model's embedding beside them")
  _check_eagle_shape(heads.params)
  config = decoder_config(model.config, heads.config.num_layers)
  tensors = {"embed_tokens.weight": model.params["embed"],
             "fc.weight": np.asarray(heads.params["fc"]).T, "fc.bias": heads.params["fc_bias"],
             **_eagle_layers_to_hf(config, heads.params["layers"], dtype)}
  hf_layout.write_weights(directory, cast(tensors, dtype), None)
  rope = hf.rope_to_hf(config.rope_theta, config.rope_scaling)
  # rope_theta / rope_scaling too: EAGLE's own config class reads only the older keys
  write_config(directory, {
      **hf.config_to_hf(config, dtype=str(dtype)), "rope_theta": config.rope_theta,
      "rope_scaling": None if config.rope_scaling.rope_type == "default" else rope,
      "bias": True, "base_model_name_or_path": heads.config.base_model})


def _is_eagle(directory: pathlib.Path) -> bool:
  """A config.json that is none of the other layouts' (vLLM Medusa's model_type, a
  speculators_model_type), beside weights with an fc and no EAGLE-3 d2t (or a pickle)."""
  if not (directory / CONFIG_FILE).is_file():
    return False
  cfg = config_json(directory)
  if cfg.get("model_type") == "medusa" or "speculators_model_type" in cfg:
    return False
  if (directory / WEIGHTS_FILE).is_file():
    tensors = SafetensorsFile(directory / WEIGHTS_FILE)
    return "fc.weight" in tensors and "d2t" not in tensors
  return (directory / TORCH_FILE).is_file()


register("eagle", CheckpointFormat("eagle", _read_eagle, _write_eagle, _is_eagle))
