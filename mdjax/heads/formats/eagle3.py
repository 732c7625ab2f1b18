"""The EAGLE-3 layouts: SafeAILab's ("eagle3") and vLLM speculators' ("speculators"),
onto `Eagle3Head`'s params (`mdjax.heads.eagle3`); the picture is `mdjax.heads.formats`'."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from mdjax.errors import CheckpointError, MdjaxError
from mdjax.heads import eagle3, vocab
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

# the layer's tensor names in SafeAILab's files and in vLLM speculators' files, and the key
# vLLM reads the target layers from (the input of layer i, as HF's hidden_states count)
EAGLE3_PREFIX, SPECULATORS_PREFIX = "midlayer.", "layers.0."
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"
SPECULATORS_VERSION = "0.3.0"


def _eagle3_layer(tensors: SafetensorsFile, prefix: str, c: ModelConfig) -> Params:
  """EAGLE-3's decoder layer (`prefix`: "midlayer." or "layers.0.") in `transformer`'s
  layout: q, k, v read concat(embedding, feature) [2D], fused into wqkv [2D, (N + 2K) H]."""
  d, hd = c.hidden_size, c.head_dim
  get = lambda name, *shape: tensors.get(prefix + name, shape)
  qkv = [get(f"self_attn.{x}_proj.weight", heads * hd, 2 * d).T
         for x, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads))]
  gate_up = [get(f"mlp.{x}_proj.weight", c.intermediate_size, d).T for x in ("gate", "up")]
  return {"embed_norm": get("input_layernorm.weight", d), "attn_norm": get("hidden_norm.weight", d),
          "wqkv": np.concatenate(qkv, axis=1), "wo": get("self_attn.o_proj.weight", d,
                                                         c.num_heads * hd).T,
          "mlp_norm": get("post_attention_layernorm.weight", d),
          "w_gate_up": np.concatenate(gate_up, axis=1),
          "w_down": get("mlp.down_proj.weight", d, c.intermediate_size).T}


def _eagle3_layer_to_hf(layer: Params, prefix: str, c: ModelConfig) -> dict[str, np.ndarray]:
  """The inverse of `_eagle3_layer`."""
  n, k = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  q, key, value = np.split(np.asarray(layer["wqkv"]), [n, n + k], axis=1)
  gate, up = np.split(np.asarray(layer["w_gate_up"]), 2, axis=1)
  named = {"input_layernorm.weight": layer["embed_norm"], "hidden_norm.weight": layer["attn_norm"],
           "self_attn.q_proj.weight": q.T, "self_attn.k_proj.weight": key.T,
           "self_attn.v_proj.weight": value.T, "self_attn.o_proj.weight": np.asarray(layer["wo"]).T,
           "post_attention_layernorm.weight": layer["mlp_norm"],
           "mlp.gate_proj.weight": gate.T, "mlp.up_proj.weight": up.T,
           "mlp.down_proj.weight": np.asarray(layer["w_down"]).T}
  return {prefix + name: t for name, t in named.items()}


def _eagle3_read(directory: pathlib.Path, cfg: dict, layer_cfg: dict, prefix: str,
                 model_config: ModelConfig | None, dtype) -> tuple[HeadsConfig, Params]:
  """Either EAGLE-3 layout: `layer_cfg` the head's llama config.json, `prefix` its layer's."""
  try:
    draft = hf.config_from_hf({**layer_cfg, "num_hidden_layers": 1})
  except CheckpointError as e:
    raise CheckpointError(f"{directory}: {e}") from None
  if model_config is not None:
    check_layers_match(draft, model_config, directory / CONFIG_FILE)
  if draft.qk_norm or draft.qkv_bias or draft.o_bias or draft.mlp_bias or draft.gemma_norms:
    raise CheckpointError(f"{directory / CONFIG_FILE}: only llama-type EAGLE-3 layers (no q/k "
                          "norm, no biases) are supported")
  tensors = SafetensorsFile(weights_file(directory, WEIGHTS_FILE, TORCH_FILE))
  d, vocab_size = draft.hidden_size, draft.vocab_size
  if "d2t" not in tensors:
    eagle = "fc.weight" in tensors and tensors.shape("fc.weight", 2) == (d, 2 * d)
    raise CheckpointError(f"{directory} holds no EAGLE-3 heads (no d2t draft vocabulary)" + (
        ": its fc reads two inputs, as EAGLE-1/2 heads do: read them with layout 'eagle'"
        if eagle else ""))
  size = hf.config_int(cfg, "draft_vocab_size") if "draft_vocab_size" in cfg else vocab_size
  draft_ids = vocab.from_offsets(tensors.get("d2t", (size,)))
  vocab.check(draft_ids, vocab_size, f"the EAGLE-3 heads in {str(directory)!r}")
  if "t2d" in tensors and not np.array_equal(tensors.get("t2d", (vocab_size,)).astype(bool),
                                             vocab.target_mask(draft_ids, vocab_size)):
    raise CheckpointError(f"{directory}: t2d and d2t disagree on the draft vocabulary")
  params = {"fc": tensors.get("fc.weight", (d, 3 * d)).T, "layers": [_eagle3_layer(tensors, prefix,
                                                                                  draft)],
            "final_norm": tensors.get("norm.weight", (d,)),
            "lm_head": tensors.get("lm_head.weight", (size, d)).T}
  if "fc.bias" in tensors:
    params["fc_bias"] = tensors.get("fc.bias", (d,))
  tensors.check_all_read(ignored=("embed_tokens.weight",))
  layers = _eagle3_target_layers(cfg, layer_cfg, model_config, directory)
  config = HeadsConfig(family="eagle3", base_model=base_model_of(cfg), base_family=draft.family,
                       hidden_size=d, vocab_size=vocab_size, own_unembedding=True,
                       draft_vocab_size=0 if size == vocab_size else size, target_layers=layers)
  if size == vocab_size:  # the whole vocabulary: no draft vocabulary
    return config, to_jax(params, dtype)
  return config, {**to_jax(params, dtype), "draft_ids": jnp.asarray(draft_ids)}


def _eagle3_target_layers(cfg: dict, layer_cfg: dict, model_config: ModelConfig | None,
                          directory: pathlib.Path) -> tuple[int, ...]:
  """mdjax's target layers (the residual stream after layer i) from vLLM's
  `eagle_aux_hidden_state_layer_ids` (the input of layer i: one more), or EAGLE-3's
  default for the model's depth where the files name none."""
  ids = (cfg.get(AUX_LAYERS_KEY) or layer_cfg.get(AUX_LAYERS_KEY)
         or (layer_cfg.get("eagle_config") or {}).get(AUX_LAYERS_KEY))
  if ids is not None:
    if not (isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) and i >= 1
                                                            for i in ids)):
      raise CheckpointError(f"{directory / CONFIG_FILE}: {AUX_LAYERS_KEY} must be three layer "
                            f"ids >= 1, got {ids!r}")
    return tuple(i - 1 for i in ids)
  if model_config is None:
    raise CheckpointError(f"{directory}: the files do not say which target layers the EAGLE-3 "
                          "head reads; pass the model's config (import_heads(path, "
                          "model_config=model.config)) to use EAGLE-3's default for its depth")
  return eagle3.default_target_layers(model_config.num_layers)


def _draft_ids(heads: Heads) -> np.ndarray:
  """The heads' draft vocabulary; the whole one where they have none."""
  return np.asarray(heads.params.get("draft_ids", np.arange(heads.config.vocab_size)))


def _eagle3_tensors(heads: Heads, model: Model, prefix: str, dtype) -> dict[str, np.ndarray]:
  params = heads.params
  draft_ids = _draft_ids(heads)
  return cast({"embed_tokens.weight": model.params["embed"],
                "fc.weight": np.asarray(params["fc"]).T,
                **_eagle3_layer_to_hf(params["layers"][0], prefix, model.config),
                "norm.weight": params["final_norm"], "lm_head.weight": np.asarray(params["lm_head"]).T},
               dtype) | {"d2t": vocab.to_offsets(draft_ids),
                         "t2d": vocab.target_mask(draft_ids, model.config.vocab_size)}


def _eagle3_layer_config(heads: Heads, model: Model | None, layout: str, dtype) -> dict:
  """The head's llama config.json (as the model's, one layer, the draft vocabulary
  size and the target layers), for a layout that stores it."""
  if model is None:
    raise MdjaxError(f"exporting heads in the {layout} layout needs the model (model=): its "
                     "config.json is the model's layer type, and the model's embedding goes "
                     "beside the head")
  config = decoder_config(model.config, 1)
  return {**hf.config_to_hf(config, dtype=str(dtype)), "architectures": ["LlamaForCausalLMEagle3"],
          "draft_vocab_size": int(_draft_ids(heads).size),
          AUX_LAYERS_KEY: [layer + 1 for layer in heads.config.target_layers],
          "rope_theta": config.rope_theta}


def _read_eagle3(directory: pathlib.Path, model_config: ModelConfig | None,
                 dtype) -> tuple[HeadsConfig, Params]:
  cfg = config_json(directory)
  return _eagle3_read(directory, cfg, cfg, EAGLE3_PREFIX, model_config, dtype)


def _write_eagle3(heads: Heads, directory: pathlib.Path, model: Model | None, dtype) -> None:
  cfg = _eagle3_layer_config(heads, model, "eagle3", dtype)
  if "fc_bias" in heads.params and np.any(np.asarray(heads.params["fc_bias"])):
    raise MdjaxError("the eagle3 layout's fc has no bias and these heads have one; export them "
                     "in the speculators layout")
  safetensors.numpy.save_file(_eagle3_tensors(heads, model, EAGLE3_PREFIX, dtype),
                              directory / WEIGHTS_FILE, metadata=hf_layout.WEIGHTS_METADATA)
  write_config(directory, {**cfg, "base_model_name_or_path": heads.config.base_model})


def _read_speculators(directory: pathlib.Path, model_config: ModelConfig | None,
                      dtype) -> tuple[HeadsConfig, Params]:
  cfg = config_json(directory)
  kind = cfg.get("speculators_model_type")
  algorithm = (cfg.get("speculators_config") or {}).get("algorithm", kind)
  if kind != "eagle3" or algorithm != "eagle3":
    raise CheckpointError(f"{directory / CONFIG_FILE}: speculators_model_type {kind!r}, algorithm "
                          f"{algorithm!r}: only 'eagle3' is supported (mdjax's eagle3 family)")
  for option in ("norm_before_residual", "norm_before_fc"):
    if cfg.get(option):
      raise CheckpointError(f"{directory / CONFIG_FILE}: {option}=true is unsupported")
  if cfg.get("target_hidden_size") not in (None, cfg["transformer_layer_config"].get("hidden_size")):
    raise CheckpointError(f"{directory / CONFIG_FILE}: target_hidden_size "
                          f"{cfg['target_hidden_size']!r} differs from the head's: unsupported")
  verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
  named = {"base_model_name_or_path": verifier.get("name_or_path") or base_model_of(cfg)}
  return _eagle3_read(directory, {**cfg, **named}, cfg["transformer_layer_config"],
                      SPECULATORS_PREFIX, model_config, dtype)


def _write_speculators(heads: Heads, directory: pathlib.Path, model: Model | None,
                       dtype) -> None:
  layer_cfg = _eagle3_layer_config(heads, model, "speculators", dtype)
  tensors = _eagle3_tensors(heads, model, SPECULATORS_PREFIX, dtype)
  tensors["fc.bias"] = cast({"b": heads.params.get("fc_bias", np.zeros(heads.config.hidden_size))},
                             dtype)["b"]
  hf_layout.write_weights(directory, tensors, None)
  depth = max(1, len(heads.config.top_accuracy))
  write_config(directory, {
      "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
      "speculators_version": SPECULATORS_VERSION, "draft_vocab_size": layer_cfg["draft_vocab_size"],
      "norm_before_residual": False, "target_hidden_size": None,
      AUX_LAYERS_KEY: layer_cfg[AUX_LAYERS_KEY],
      "transformer_layer_config": {k: v for k, v in layer_cfg.items()
                                   if k not in ("architectures", "draft_vocab_size")},
      "speculators_config": {
          "algorithm": "eagle3", "default_proposal_method": "greedy",
          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": depth,
                                "verifier_accept_k": 1, "accept_tolerance": 0.0}],
          "verifier": {"name_or_path": heads.config.base_model,
                       "architectures": [hf.ARCHITECTURES.get(model.config.family, "")]}}})


def _is_speculators(directory: pathlib.Path) -> bool:
  return (directory / CONFIG_FILE).is_file() and "speculators_model_type" in config_json(directory)


def _is_eagle3(directory: pathlib.Path) -> bool:
  return (not _is_speculators(directory) and (directory / WEIGHTS_FILE).is_file()
          and "d2t" in SafetensorsFile(directory / WEIGHTS_FILE))


register("eagle3", CheckpointFormat("eagle3", _read_eagle3, _write_eagle3, _is_eagle3))
register("speculators", CheckpointFormat("eagle3", _read_speculators, _write_speculators,
                                         _is_speculators))
