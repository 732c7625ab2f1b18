"""Hugging Face checkpoints: config.json + safetensors <-> `Model`.

A Hugging Face directory holds `config.json`, the weights as one `model.safetensors`
or as shards listed in `model.safetensors.index.json`, and optionally
`generation_config.json` and tokenizer files. Its tensors map onto mdjax's params as
`mdjax.checkpoints.hf_layout` draws; this module reads and writes the config.json side and
the directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Any

from mdjax import generation_config, sharding
from mdjax.checkpoints import lazy, quantized_layout
from mdjax.checkpoints.hf_layout import (SafetensorsCheckpoint, params_from_hf, params_to_hf,
                                         write_weights)
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.errors import CheckpointError, MdjaxError
from mdjax.files import atomic_directory
from mdjax.models.config import LAYER_TYPES, ModelConfig, RopeScaling, weight_dtype
from mdjax.models.model import Model
from mdjax.models.quantized import quantize_weights, scheme_label

ASSETS_DIR = pathlib.Path(__file__).resolve().parent.parent / "assets"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3": "gemma3_text"}  # family -> config.json model_type
# config.json key and the one value supported of each family's MLP activation
ACTIVATIONS = {"gemma3": ("hidden_activation", "gelu_pytorch_tanh")}
DEFAULT_ACTIVATION = ("hidden_act", "silu")
# what transformers' Gemma3TextConfig assumes for keys a config.json leaves out
GEMMA3_DEFAULTS = dict(head_dim=256, num_key_value_heads=4, max_position_embeddings=131_072,
                       tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                       sliding_window=4096, query_pre_attn_scalar=256)
GEMMA3_ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# --------------------------------------------------------------------------- config


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
  """A `ModelConfig` from a parsed config.json (llama, mistral, qwen2, qwen3, gemma3_text).

  Accepts the current layout (`rope_parameters: {rope_type, rope_theta, ...}`, for
  gemma3 one such dict per layer type) and the older one (top-level `rope_theta` +
  `rope_scaling: {type | rope_type, ...}`; gemma3 adds `rope_local_base_freq`).
  """
  model_type = cfg.get("model_type")
  family = {t: f for f, t in MODEL_TYPES.items()}.get(model_type)
  if family is None:
    hint = (" (a multimodal Gemma3ForConditionalGeneration checkpoint; only text-only "
            "gemma3_text ones load)" if model_type == "gemma3" else "")
    raise CheckpointError(f"unsupported model_type {model_type!r}{hint}; supported: "
                          f"{', '.join(MODEL_TYPES.values())}")
  if family == "gemma3":
    cfg = {**GEMMA3_DEFAULTS, **cfg}
  act_key, act_supported = ACTIVATIONS.get(family, DEFAULT_ACTIVATION)
  act = cfg.get(act_key, act_supported)
  if act != act_supported:
    raise CheckpointError(f"unsupported {act_key} {act!r} for {family}; only {act_supported!r} "
                          "is supported")
  if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
    raise CheckpointError(
        f"{family} with use_sliding_window=true is unsupported (sliding window on only some "
        "layers); only mistral's all-layer sliding window is")

  hidden, heads = config_int(cfg, "hidden_size"), config_int(cfg, "num_attention_heads")
  head_dim = cfg.get("head_dim")
  if head_dim is None:
    # transformers' Qwen3Config defaults a missing head_dim to 128, the others derive it
    head_dim = 128 if family == "qwen3" and "head_dim" not in cfg else hidden // heads
  attention_bias = bool(cfg.get("attention_bias", False))
  kwargs = dict(
      family=family,
      vocab_size=config_int(cfg, "vocab_size"),
      hidden_size=hidden,
      intermediate_size=config_int(cfg, "intermediate_size"),
      num_layers=config_int(cfg, "num_hidden_layers"),
      num_heads=heads,
      num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
      head_dim=int(head_dim),
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      bos_token_id=cfg.get("bos_token_id"),
      eos_token_id=_token_ids(cfg.get("eos_token_id")),
      pad_token_id=cfg.get("pad_token_id"),
  )
  if cfg.get("max_position_embeddings") is not None:
    kwargs["max_position_embeddings"] = int(cfg["max_position_embeddings"])
  if family == "gemma3":
    kwargs.update(_gemma3_from_hf(cfg), qk_norm=True, qkv_bias=attention_bias,
                  o_bias=attention_bias)
  else:
    kwargs["rope_theta"], kwargs["rope_scaling"] = _rope_from_hf(cfg)
  if family == "llama":
    kwargs.update(qkv_bias=attention_bias, o_bias=attention_bias,
                  mlp_bias=bool(cfg.get("mlp_bias", False)))
  elif family == "mistral":
    window = cfg.get("sliding_window")
    kwargs.update(sliding_window=None if window is None else int(window))
  elif family == "qwen2":
    kwargs.update(qkv_bias=True)
  elif family == "qwen3":
    kwargs.update(qk_norm=True, qkv_bias=attention_bias, o_bias=attention_bias)
  try:
    return ModelConfig(**kwargs)
  except MdjaxError as e:
    raise CheckpointError(f"invalid {family} config: {e}") from None


def config_to_hf(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
  """config.json (current transformers layout) for `config`.

  Raises `MdjaxError` when the family cannot express `config` (e.g. a llama with
  q/k/v bias but no output bias), naming the fields that would not round-trip.
  """
  c = config
  rope = rope_to_hf(c.rope_theta, c.rope_scaling)
  eos = list(c.eos_token_id)
  cfg = {
      "architectures": [ARCHITECTURES[c.family]],
      "model_type": MODEL_TYPES[c.family],
      "vocab_size": c.vocab_size,
      "hidden_size": c.hidden_size,
      "intermediate_size": c.intermediate_size,
      "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": c.max_position_embeddings,
      "rms_norm_eps": c.rms_norm_eps,
      "rope_parameters": rope,
      "tie_word_embeddings": c.tie_word_embeddings,
      "bos_token_id": c.bos_token_id,
      "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
      "pad_token_id": c.pad_token_id,
      "dtype": dtype,
  }
  if c.family in ("llama", "qwen3"):
    cfg["attention_bias"] = c.qkv_bias
  if c.family == "llama":
    cfg["mlp_bias"] = c.mlp_bias
  if c.family == "mistral":
    cfg["sliding_window"] = c.sliding_window
  if c.family in ("qwen2", "qwen3"):
    cfg["use_sliding_window"] = False
  if c.family == "gemma3":
    del cfg["hidden_act"]
    sliding_rope = (rope if c.sliding_rope_theta is None
                    else rope_to_hf(c.sliding_rope_theta, c.sliding_rope_scaling))
    cfg.update(hidden_activation=ACTIVATIONS["gemma3"][1], attention_bias=c.qkv_bias,
               rope_parameters={"full_attention": rope, "sliding_attention": sliding_rope},
               layer_types=None if c.layer_types is None else list(c.layer_types),
               sliding_window=c.sliding_window, query_pre_attn_scalar=c.query_pre_attn_scalar,
               attn_logit_softcapping=c.attn_logit_softcapping,
               final_logit_softcapping=c.final_logit_softcapping)
  back = config_from_hf(cfg)
  lost = [f.name for f in dataclasses.fields(c) if getattr(back, f.name) != getattr(c, f.name)]
  if lost:
    raise MdjaxError(f"a {c.family} Hugging Face config cannot express this model: "
                     + ", ".join(f"{n}={getattr(c, n)!r}" for n in lost))
  return cfg


def rope_to_hf(theta: float, scaling: RopeScaling) -> dict[str, Any]:
  """config.json's rope dict (current layout) of `theta` and `scaling`."""
  rope = {"rope_type": scaling.rope_type, "rope_theta": theta}
  if scaling.rope_type != "default":
    rope["factor"] = scaling.factor
  if scaling.rope_type == "llama3":
    rope.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_position_embeddings)
  return rope


def config_int(cfg: dict[str, Any], key: str) -> int:
  """`cfg[key]`, which must be an integer (a `CheckpointError` naming it if not)."""
  value = cfg.get(key)
  if not isinstance(value, int) or isinstance(value, bool):
    raise CheckpointError(f"config.json: {key} must be an integer, got {value!r}")
  return value


def _token_ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
  """(rope_theta, RopeScaling) from either config.json layout."""
  params = cfg.get("rope_parameters")
  if params is None:
    params = cfg.get("rope_scaling") or {}
  return _rope(params, cfg.get("rope_theta", 10000.0))


def _gemma3_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
  """The gemma3-only `ModelConfig` fields: per-layer attention kinds, each kind's RoPE,
  the query scale and soft-caps. Like transformers, the older layout's `rope_theta`,
  `rope_local_base_freq` and `rope_scaling` (full-attention layers only) fill what
  `rope_parameters` leaves out."""
  if cfg.get("use_bidirectional_attention"):
    raise CheckpointError("gemma3 with use_bidirectional_attention=true is unsupported "
                          "(only causal attention is)")
  if cfg.get("attn_logit_softcapping") is not None:
    # transformers' Gemma3 reads it but never applies it (Gemma 2 does): either choice
    # would silently disagree with one of them
    raise CheckpointError(f"gemma3 with attn_logit_softcapping={cfg['attn_logit_softcapping']!r} "
                          "is unsupported: transformers' Gemma3 ignores it, Gemma 2 applies it; "
                          "Gemma 3 checkpoints leave it null")
  layer_types = cfg.get("layer_types")
  if layer_types is None:  # older configs: every `sliding_window_pattern`-th layer is full
    pattern = cfg.get("sliding_window_pattern", 6)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
      raise CheckpointError(f"config.json: sliding_window_pattern must be an integer >= 1, "
                            f"got {pattern!r}")
    layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                   for i in range(config_int(cfg, "num_hidden_layers"))]
  unknown = [t for t in layer_types if t not in LAYER_TYPES]
  if unknown:
    raise CheckpointError(f"unsupported layer type {unknown[0]!r} in layer_types; supported: "
                          f"{', '.join(LAYER_TYPES)}")
  params = cfg.get("rope_parameters") or {}
  stray = sorted(set(params) - set(LAYER_TYPES))
  if stray:
    raise CheckpointError(f"gemma3 rope_parameters must be keyed by layer type "
                          f"({', '.join(LAYER_TYPES)}), got keys {stray}")
  full = {**(params.get("full_attention") or {}), **(cfg.get("rope_scaling") or {})}
  rope_theta, rope_scaling = _rope(
      full, cfg.get("rope_theta", GEMMA3_ROPE_THETA["full_attention"]), "full_attention layers")
  sliding_theta, sliding_scaling = _rope(
      params.get("sliding_attention") or {},
      cfg.get("rope_local_base_freq", GEMMA3_ROPE_THETA["sliding_attention"]),
      "sliding_attention layers")
  window = cfg.get("sliding_window")
  return dict(layer_types=tuple(layer_types),
              sliding_window=None if window is None else int(window),
              rope_theta=rope_theta, rope_scaling=rope_scaling, sliding_rope_theta=sliding_theta,
              sliding_rope_scaling=sliding_scaling,
              query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
              final_logit_softcapping=cfg.get("final_logit_softcapping"))


def _rope(params: dict[str, Any], theta, where: str = "") -> tuple[float, RopeScaling]:
  """(rope_theta, RopeScaling) of one rope dict (`rope_type` or `type`, `factor`, ...;
  `theta` where it has no `rope_theta`); `where` names the layers it is for in errors."""
  where = f" for {where}" if where else ""
  theta = float(params.get("rope_theta", theta))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return theta, RopeScaling()
  needed = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")}.get(rope_type)
  if needed is None:
    raise CheckpointError(
        f"unsupported rope_type {rope_type!r}{where}; supported: default, linear, llama3")
  missing = [k for k in needed if params.get(k) is None]
  if missing:
    raise CheckpointError(
        f"rope_type {rope_type!r}{where} needs {', '.join(missing)} in the rope config")
  values = {k: float(params[k]) for k in needed}
  if rope_type == "llama3":
    values["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
  return theta, RopeScaling(rope_type=rope_type, **values)


# --------------------------------------------------------------------------- public


def read_json(file: pathlib.Path) -> dict[str, Any]:
  """The JSON object in `file` (a `CheckpointError` naming it if corrupt)."""
  try:
    value = json.loads(file.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"corrupt {file}: {e}") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"corrupt {file}: not a JSON object")
  return value


def load_hf_dir(path: str | os.PathLike, dtype="float32", *, name: str | None = None,
                mesh=None, quantize: str | None = None, quantize_group: int | None = None
                ) -> Model:
  """Loads a Hugging Face-format directory as a `Model` with weights of `dtype`, each
  weight put straight onto its sharding when a `mesh` is given (`mdjax.sharding`).

  `quantize` ("int8" or "int4", groups of `quantize_group`): each layer's matrices are
  quantized as soon as the layer is read (`mdjax.models.quantized.quantize_weights`), so
  the float model is never held whole: at most one layer's float weights beside the
  quantized ones."""
  directory = pathlib.Path(path)
  if not directory.exists():
    raise CheckpointError(f"no such checkpoint directory: {str(path)!r}")
  if not directory.is_dir():
    raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory")
  np_dtype = weight_dtype(dtype)
  config_file = directory / "config.json"
  if not config_file.is_file():
    raise CheckpointError(f"no config.json in checkpoint directory {str(path)!r}")
  cfg = read_json(config_file)
  defaults = generation_config.read(directory)
  if "eos_token_id" in defaults:  # the generation config's EOS ids are the model's own
    cfg["eos_token_id"] = defaults["eos_token_id"]
  try:
    config = config_from_hf(cfg)
  except CheckpointError as e:
    raise CheckpointError(f"{config_file}: {e}") from None
  weights = SafetensorsCheckpoint(directory)
  weights.validate()
  layout = sharding.layout_for(mesh, config)
  quantization = cfg.get(quantized_layout.KEY)
  if quantization is not None and quantize is not None:
    raise MdjaxError(f"quantize={quantize!r}: {directory} is quantized already "
                     f"({quantization['label']}); load its float checkpoint to quantize it "
                     "again")
  label = None if quantization is None else quantization["label"]  # `Model.quantization`
  if quantization is not None and layout is None:
    params = quantized_layout.from_tensors(weights.read_all(), quantization)
  elif quantization is not None:  # each process reads only its devices' slices
    params = layout.place(quantized_layout.from_tensors(weights.recipes(), quantization, xp=lazy),
                          lazy.put)
  else:
    read = lazy.placer(layout)
    place = read if quantize is None else (
        lambda tree: quantize_weights(read(tree), quantize, quantize_group))
    params = params_from_hf(config, weights, np_dtype, place)
    if quantize is not None:
      label = scheme_label(quantize, quantize_group)
  tokenizer = None
  if any((directory / f).is_file() for f in TOKENIZER_FILES):
    import transformers  # only checkpoints with a tokenizer need it
    try:
      tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # noqa: BLE001 -- transformers raises many types for bad files
      raise CheckpointError(f"cannot load the tokenizer in {directory}: {e}") from None
  return Model(config=config, params=params, tokenizer=tokenizer, path=str(directory),
               name=name if name is not None else directory.name, layout=layout,
               generation_defaults=defaults,
               quantization=label)


def save_hf(model: Model, path: str | os.PathLike, dtype="float32",
            max_shard_bytes: int | None = None) -> None:
  """Exports `model` as a Hugging Face directory that transformers and `load_hf_dir` read.

  `max_shard_bytes` splits the weights into shards with an index (e.g. to keep every
  file of a shipped model small for git).

  Written into a temporary directory beside `path` and renamed into place, so `path`
  never holds a half-written checkpoint. An existing `path` is replaced.
  """
  np_dtype = weight_dtype(dtype)
  config = config_to_hf(model.config, dtype=str(np_dtype))
  if model.quantization is not None:  # mdjax's own tensors (`quantized_layout`)
    tensors, config[quantized_layout.KEY] = quantized_layout.to_tensors(
        sharding.one_device_layout(model.params, model.config), model.quantization)
  else:
    tensors = params_to_hf(model.config, model.params, np_dtype)
  with atomic_directory(path) as staging:
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_weights(staging, tensors, max_shard_bytes)
    if model.tokenizer is not None:
      model.tokenizer.save_pretrained(str(staging))


def shipped_names() -> list[str]:
  """Names of the models shipped under `mdjax/assets`."""
  if not ASSETS_DIR.is_dir():
    return []
  return sorted(p.name for p in ASSETS_DIR.iterdir() if (p / "config.json").is_file())


def resolve(path_or_name: str | os.PathLike) -> pathlib.Path:
  """The checkpoint directory for a local directory, a shipped model name or a hub id.

  A hub id (`owner/name`) is fetched with `huggingface_hub.snapshot_download`
  (json, safetensors and tokenizer files only).
  """
  path = pathlib.Path(path_or_name)
  if path.is_dir():
    return path
  if path.exists():
    raise CheckpointError(f"checkpoint path {str(path_or_name)!r} is not a directory")
  text = str(path_or_name)
  if text in shipped_names():
    return ASSETS_DIR / text
  if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", text):  # owner/name
    import huggingface_hub  # only hub ids need it
    try:
      return pathlib.Path(huggingface_hub.snapshot_download(text, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # noqa: BLE001 -- offline, unknown or gated repo: all "cannot get it"
      raise CheckpointError(f"{text!r} is not a local directory and could not be fetched from the "
                            f"Hugging Face hub: {type(e).__name__}: {e}") from None
  known = shipped_names() + list(RANDOM_MODELS)
  raise CheckpointError(f"no such model directory or known name: {text!r}; known names: "
                        f"{', '.join(known)}")
