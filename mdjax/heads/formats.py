"""Heads in the layouts other projects publish them in: import and export.

Each layout is a directory with a `config.json` and one safetensors file (torch
pickles, `.pt` / `.bin`, are refused: loading one runs code; the error says how to
convert). Torch `Linear` weights are stored `[out, in]`::

    medusa (FasterDecoding)   medusa_lm_head.safetensors
      {k}.{l}.linear.weight  [D, D]  {k}.{l}.linear.bias [D]   block l < L of head k
      {k}.{L}.weight         [V, D]                            head k's own unembedding
      config.json: medusa_num_heads (K), medusa_num_layers (L), base_model_name_or_path
    vllm-medusa (vLLM)        model.safetensors
      blocks.{k}.layers.{l}.weight [D, D]  blocks.{k}.layers.{l}.bias [D] (if medusa_fc_bias)
      lm_heads.{k}.weight          [V, D]  (only lm_heads.0, the model's, if original_lm_head)
      config.json: model_type "medusa", num_heads, num_hidden_layers, hidden_size, vocab_size
    eagle (SafeAILab EAGLE-1/2)  model.safetensors
      fc.weight [D, 2D]  fc.bias [D] (unless "bias": false)    on concat(embedding, feature)
      layers.{i}.<a Hugging Face decoder layer>, but layers.0 has no input_layernorm
      embed_tokens.weight [V, D]                               a copy of the model's
      config.json: the base model's, num_hidden_layers = the head's layers
    eagle3 (SafeAILab EAGLE-3)  model.safetensors
      fc.weight [D, 3D]                                        on the target's three layers
      midlayer.{input_layernorm (embedding), hidden_norm (feature), self_attn.{q,k,v}_proj
        [., 2D], o_proj, post_attention_layernorm, mlp.*}      one decoder layer
      norm.weight [D]   lm_head.weight [V_d, D]
      d2t int64 [V_d] (target id - draft id)   t2d bool [V]    the draft vocabulary
      config.json: a llama config of the layer, draft_vocab_size, and (vLLM's key)
        eagle_aux_hidden_state_layer_ids: the target layers, as inputs of layer i
    speculators (vLLM speculators)  model.safetensors: eagle3's tensors, the layer as
      layers.0.*, and fc.bias [D]
      config.json: speculators_model_type "eagle3", transformer_layer_config (the
        layer's llama config), draft_vocab_size, eagle_aux_hidden_state_layer_ids,
        speculators_config {algorithm "eagle3", proposal_methods, verifier}

and onto mdjax's heads (`mdjax.heads.base`)::

    medusa layouts   {k}.{l} weight.T, bias -> blocks.w[k, l] [D, D], blocks.b[k, l] [D]
                     head k's unembedding.T -> lm_head[k] [D, V] (own_unembedding=True);
                     vLLM's original_lm_head -> none: the model's lm_head, shared
    eagle            fc.weight.T, fc.bias   -> fc [2D, D], fc_bias [D]
                     layers.{i}             -> layers[i], as `mdjax.models.hf` maps a model's
                                               (layer 0 without attn_norm; no final_norm)
                     embed_tokens           -> not imported: the model's embedding is used
    eagle3 layouts   q, k, v_proj.T        -> layers[0].wqkv [2D, (N + 2K) H] (fused)
                     input_layernorm       -> layers[0].embed_norm; hidden_norm -> attn_norm
                     d2t                   -> draft_ids = d2t + arange (`mdjax.heads.vocab`)
                     aux layer ids i       -> HeadsConfig.target_layers i - 1 (the output of
                                              layer i - 1: mdjax counts layer outputs)

`load_heads(directory)` imports any of them (`detect_layout`); `import_heads` also takes
the model's config (to check it, or to name the base family where the files do not);
`export_heads` writes them back, atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from mdjax.errors import CheckpointError, MdjaxError
from mdjax.files import atomic_directory
from mdjax.heads import eagle3, family, vocab
from mdjax.heads.base import Heads, HeadsConfig
from mdjax.heads.decoder import decoder_config
from mdjax.models import hf, hf_layout
from mdjax.models.hf_layout import SafetensorsFile
from mdjax.models.config import ModelConfig, weight_dtype
from mdjax.models.model import Model
from mdjax.models.registry import RANDOM_MODELS
from mdjax.models.transformer import Params

CONFIG_FILE, CARD_FILE = "config.json", "README.md"
MEDUSA_FILE, MEDUSA_TORCH_FILE = "medusa_lm_head.safetensors", "medusa_lm_head.pt"
WEIGHTS_FILE, TORCH_FILE = hf_layout.WEIGHTS_FILE, "pytorch_model.bin"
# each medusa layout's name of block (k, l) and of head k's unembedding (L: layers per head)
FASTERDECODING_NAMES = ("{k}.{l}.linear", "{k}.{L}")
VLLM_NAMES = ("blocks.{k}.layers.{l}", "lm_heads.{k}")
# what `hf_layout.params_from_hf` reads of a model and an EAGLE head lacks
EAGLE_STAND_INS = ("model.embed_tokens.weight", "model.norm.weight",
                   "model.layers.0.input_layernorm.weight")
# the fields of a decoder layer an EAGLE config.json must share with the model
# EAGLE-3: its layer's tensor names in SafeAILab's files and in vLLM speculators' files, and
# the key vLLM reads the target layers from (the input of layer i, as HF's hidden_states count)
EAGLE3_PREFIX, SPECULATORS_PREFIX = "midlayer.", "layers.0."
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"
SPECULATORS_VERSION = "0.3.0"
LAYER_FIELDS = ("family", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "qkv_bias", "o_bias",
                "mlp_bias", "qk_norm")


# --------------------------------------------------------------------------- shared


def _config_json(directory: pathlib.Path) -> dict:
  file = directory / CONFIG_FILE
  if not file.is_file():
    raise CheckpointError(f"no {CONFIG_FILE} in heads directory {str(directory)!r}")
  return hf.read_json(file)


def _weights_file(directory: pathlib.Path, name: str, torch_name: str) -> pathlib.Path:
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


def _family(model_type) -> str | None:
  return {t: f for f, t in hf.MODEL_TYPES.items()}.get(model_type)


def _local_family(name: str) -> str | None:
  """The family of model `name` where it is known here without a download: a random
  model, or a Hugging Face directory (local or shipped)."""
  if name in RANDOM_MODELS:
    return RANDOM_MODELS[name].family
  for directory in (pathlib.Path(name), hf.ASSETS_DIR / name):
    if (directory / CONFIG_FILE).is_file():
      return _family(hf.read_json(directory / CONFIG_FILE).get("model_type"))
  return None


def _base_model(cfg: dict) -> str:
  return str(cfg.get("base_model_name_or_path") or cfg.get("_name_or_path") or "unknown")


def _medusa_base(cfg: dict, model_config: ModelConfig | None,
                 directory: pathlib.Path) -> tuple[str, str]:
  """(base_model, base_family) of medusa heads with config.json `cfg`: the family is
  `model_config`'s, else the config's own model_type (Medusa-2 configs copy the base
  model's), else that of the base model it names, where that is known here."""
  base_model = _base_model(cfg)
  model_family = (model_config.family if model_config is not None
                  else _family(cfg.get("model_type")) or _local_family(base_model))
  if model_family is None:
    raise CheckpointError(f"{directory}: cannot tell which model family the heads are for (base "
                          f"model {base_model!r} is not known here); pass the model's config: "
                          "import_heads(path, model_config=model.config)")
  return base_model, model_family


def _cast(tensors: dict, dtype) -> dict[str, np.ndarray]:
  return {name: np.ascontiguousarray(np.asarray(t).astype(dtype)) for name, t in tensors.items()}


def _to_jax(params: Params, dtype) -> Params:
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(dtype, copy=False)), params)


def _write_config(directory: pathlib.Path, cfg: dict) -> None:
  (directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


def _model_unembedding(heads: Heads, model: Model | None, layout: str) -> np.ndarray:
  """The model's unembedding as torch stores it, [V, D], for heads that share it."""
  if model is None:
    raise MdjaxError(f"these medusa heads share the model's unembedding, which the {layout} "
                     "layout stores in its file: pass model= to export_heads")
  params = model.params
  return np.asarray(params["lm_head"]).T if "lm_head" in params else np.asarray(params["embed"])


# --------------------------------------------------------------------------- medusa


def _medusa_blocks(tensors: SafetensorsFile, block: str, *, heads: int, layers: int, hidden: int,
                   bias: bool) -> Params:
  """blocks.w [K, L, D, D] (each torch weight transposed) and blocks.b [K, L, D] (zero
  where the layout has no biases)."""
  names = [[block.format(k=k, l=l) for l in range(layers)] for k in range(heads)]
  w = np.array([[tensors.get(f"{n}.weight", (hidden, hidden)).T for n in row] for row in names])
  b = (np.array([[tensors.get(f"{n}.bias", (hidden,)) for n in row] for row in names]) if bias
       else np.zeros((heads, layers, hidden), w.dtype))
  return {"w": w, "b": b}


def _medusa_unembeddings(tensors: SafetensorsFile, head: str, *, heads: int, layers: int,
                         hidden: int, vocab: int) -> np.ndarray:
  """Each head's own unembedding, lm_head [K, D, V]."""
  return np.array([tensors.get(f"{head.format(k=k, L=layers)}.weight", (vocab, hidden)).T
                   for k in range(heads)])


def _medusa_blocks_to_hf(params: Params, block: str) -> dict[str, np.ndarray]:
  w = np.asarray(params["blocks"]["w"])  # [K, L, D, D]
  b = np.asarray(params["blocks"]["b"])  # [K, L, D]
  out = {}
  for k, l in np.ndindex(w.shape[:2]):
    name = block.format(k=k, l=l)
    out[f"{name}.weight"], out[f"{name}.bias"] = w[k, l].T, b[k, l]  # torch Linear: [out, in]
  return out


def _read_medusa(directory: pathlib.Path, model_config: ModelConfig | None,
                 dtype) -> tuple[HeadsConfig, Params]:
  cfg = _config_json(directory)
  tensors = SafetensorsFile(_weights_file(directory, MEDUSA_FILE, MEDUSA_TORCH_FILE))
  heads, layers = hf.config_int(cfg, "medusa_num_heads"), hf.config_int(cfg, "medusa_num_layers")
  block, head = FASTERDECODING_NAMES
  vocab, hidden = tensors.shape(f"{head.format(k=0, L=layers)}.weight", 2)
  base_model, base_family = _medusa_base(cfg, model_config, directory)
  config = HeadsConfig(family="medusa", base_model=base_model, base_family=base_family,
                       hidden_size=hidden, vocab_size=vocab, num_heads=heads, num_layers=layers,
                       own_unembedding=True)
  sizes = dict(heads=heads, layers=layers, hidden=hidden)
  params = {"blocks": _medusa_blocks(tensors, block, bias=True, **sizes),
            "lm_head": _medusa_unembeddings(tensors, head, vocab=vocab, **sizes)}
  tensors.check_all_read()
  return config, _to_jax(params, dtype)


def _write_medusa(heads: Heads, directory: pathlib.Path, model: Model | None, dtype) -> None:
  c = heads.config
  block, head = FASTERDECODING_NAMES
  if c.own_unembedding:
    unembeddings = np.swapaxes(np.asarray(heads.params["lm_head"]), 1, 2)  # [K, V, D]
  else:  # the layout has no shared unembedding: every head gets the model's
    unembeddings = [_model_unembedding(heads, model, "medusa")] * c.num_heads
  tensors = _medusa_blocks_to_hf(heads.params, block)
  tensors.update({f"{head.format(k=k, L=c.num_layers)}.weight": u
                  for k, u in enumerate(unembeddings)})
  safetensors.numpy.save_file(_cast(tensors, dtype), directory / MEDUSA_FILE,
                              metadata=hf_layout.WEIGHTS_METADATA)
  _write_config(directory, {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
                            "base_model_name_or_path": c.base_model})


def _read_vllm_medusa(directory: pathlib.Path, model_config: ModelConfig | None,
                      dtype) -> tuple[HeadsConfig, Params]:
  file = _weights_file(directory, WEIGHTS_FILE, TORCH_FILE)
  cfg = _config_json(directory)
  heads, layers = hf.config_int(cfg, "num_heads"), hf.config_int(cfg, "num_hidden_layers")
  hidden, vocab = hf.config_int(cfg, "hidden_size"), hf.config_int(cfg, "vocab_size")
  if cfg.get("truncated_vocab_size") not in (None, vocab):
    raise CheckpointError(f"{directory / CONFIG_FILE}: truncated_vocab_size="
                          f"{cfg['truncated_vocab_size']!r} (a draft vocabulary with a token_map) "
                          f"is unsupported; only the full vocabulary ({vocab}) is")
  shared = bool(cfg.get("original_lm_head", False))
  base_model, base_family = _medusa_base(cfg, model_config, directory)
  config = HeadsConfig(family="medusa", base_model=base_model, base_family=base_family,
                       hidden_size=hidden, vocab_size=vocab, num_heads=heads, num_layers=layers,
                       own_unembedding=not shared)
  tensors = SafetensorsFile(file)
  block, head = VLLM_NAMES
  sizes = dict(heads=heads, layers=layers, hidden=hidden)
  params = {"blocks": _medusa_blocks(tensors, block, bias=bool(cfg.get("medusa_fc_bias", False)),
                                     **sizes)}
  if not shared:
    params["lm_head"] = _medusa_unembeddings(tensors, head, vocab=vocab, **sizes)
  # original_lm_head: lm_heads.0 is a copy of the model's, which mdjax shares instead
  tensors.check_all_read(ignored=("lm_heads.0.weight",) if shared else ())
  return config, _to_jax(params, dtype)


def _write_vllm_medusa(heads: Heads, directory: pathlib.Path, model: Model | None,
                       dtype) -> None:
  c = heads.config
  block, head = VLLM_NAMES
  tensors = _medusa_blocks_to_hf(heads.params, block)
  if c.own_unembedding:
    tensors.update({f"{head.format(k=k)}.weight": u.T
                    for k, u in enumerate(np.asarray(heads.params["lm_head"]))})
  else:
    tensors[f"{head.format(k=0)}.weight"] = _model_unembedding(heads, model, "vllm-medusa")
  hf_layout.write_weights(directory, _cast(tensors, dtype), None)
  _write_config(directory, {
      "architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": c.num_heads,
      "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size,
      "vocab_size": c.vocab_size, "medusa_fc_bias": True,
      "original_lm_head": not c.own_unembedding, "base_model_name_or_path": c.base_model})


# --------------------------------------------------------------------------- eagle


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


def _check_layers_match(draft: ModelConfig, model_config: ModelConfig,
                        file: pathlib.Path) -> None:
  """The head runs as the model's layer type (`decoder_config`): its config.json must agree."""
  differ = [f"{n}={getattr(draft, n)!r} (the model's: {getattr(model_config, n)!r})"
            for n in LAYER_FIELDS if getattr(draft, n) != getattr(model_config, n)]
  if differ:
    raise CheckpointError(f"{file}: the EAGLE layers are not the model's: " + ", ".join(differ))


def _read_eagle(directory: pathlib.Path, model_config: ModelConfig | None,
                dtype) -> tuple[HeadsConfig, Params]:
  file = _weights_file(directory, WEIGHTS_FILE, TORCH_FILE)
  cfg = _config_json(directory)
  try:
    draft = hf.config_from_hf(cfg)
  except CheckpointError as e:
    raise CheckpointError(f"{directory}: {e}") from None
  if model_config is not None:
    _check_layers_match(draft, model_config, directory / CONFIG_FILE)
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
  config = HeadsConfig(family="eagle", base_model=_base_model(cfg), base_family=draft.family,
                       hidden_size=d, vocab_size=draft.vocab_size, num_layers=draft.num_layers)
  return config, _to_jax(params, dtype)


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
  hf_layout.write_weights(directory, _cast(tensors, dtype), None)
  rope = hf.rope_to_hf(config.rope_theta, config.rope_scaling)
  # rope_theta / rope_scaling too: EAGLE's own config class reads only the older keys
  _write_config(directory, {
      **hf.config_to_hf(config, dtype=str(dtype)), "rope_theta": config.rope_theta,
      "rope_scaling": None if config.rope_scaling.rope_type == "default" else rope,
      "bias": True, "base_model_name_or_path": heads.config.base_model})


# --------------------------------------------------------------------------- eagle3


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
    _check_layers_match(draft, model_config, directory / CONFIG_FILE)
  if draft.qk_norm or draft.qkv_bias or draft.o_bias or draft.mlp_bias or draft.gemma_norms:
    raise CheckpointError(f"{directory / CONFIG_FILE}: only llama-type EAGLE-3 layers (no q/k "
                          "norm, no biases) are supported")
  tensors = SafetensorsFile(_weights_file(directory, WEIGHTS_FILE, TORCH_FILE))
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
  config = HeadsConfig(family="eagle3", base_model=_base_model(cfg), base_family=draft.family,
                       hidden_size=d, vocab_size=vocab_size, own_unembedding=True,
                       draft_vocab_size=0 if size == vocab_size else size, target_layers=layers)
  if size == vocab_size:  # the whole vocabulary: no draft vocabulary
    return config, _to_jax(params, dtype)
  return config, {**_to_jax(params, dtype), "draft_ids": jnp.asarray(draft_ids)}


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
  return _cast({"embed_tokens.weight": model.params["embed"],
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
  cfg = _config_json(directory)
  return _eagle3_read(directory, cfg, cfg, EAGLE3_PREFIX, model_config, dtype)


def _write_eagle3(heads: Heads, directory: pathlib.Path, model: Model | None, dtype) -> None:
  cfg = _eagle3_layer_config(heads, model, "eagle3", dtype)
  if "fc_bias" in heads.params and np.any(np.asarray(heads.params["fc_bias"])):
    raise MdjaxError("the eagle3 layout's fc has no bias and these heads have one; export them "
                     "in the speculators layout")
  safetensors.numpy.save_file(_eagle3_tensors(heads, model, EAGLE3_PREFIX, dtype),
                              directory / WEIGHTS_FILE, metadata=hf_layout.WEIGHTS_METADATA)
  _write_config(directory, {**cfg, "base_model_name_or_path": heads.config.base_model})


def _read_speculators(directory: pathlib.Path, model_config: ModelConfig | None,
                      dtype) -> tuple[HeadsConfig, Params]:
  cfg = _config_json(directory)
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
  base = {"base_model_name_or_path": verifier.get("name_or_path") or _base_model(cfg)}
  return _eagle3_read(directory, {**cfg, **base}, cfg["transformer_layer_config"],
                      SPECULATORS_PREFIX, model_config, dtype)


def _write_speculators(heads: Heads, directory: pathlib.Path, model: Model | None,
                       dtype) -> None:
  layer_cfg = _eagle3_layer_config(heads, model, "speculators", dtype)
  tensors = _eagle3_tensors(heads, model, SPECULATORS_PREFIX, dtype)
  tensors["fc.bias"] = _cast({"b": heads.params.get("fc_bias", np.zeros(heads.config.hidden_size))},
                             dtype)["b"]
  hf_layout.write_weights(directory, tensors, None)
  depth = max(1, len(heads.config.top_accuracy))
  _write_config(directory, {
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


# --------------------------------------------------------------------------- public


def _is_medusa(directory: pathlib.Path) -> bool:
  return (directory / MEDUSA_FILE).is_file() or (directory / MEDUSA_TORCH_FILE).is_file()


def _is_vllm_medusa(directory: pathlib.Path) -> bool:
  return (directory / CONFIG_FILE).is_file() and _config_json(directory).get(
      "model_type") == "medusa"


def _is_speculators(directory: pathlib.Path) -> bool:
  return (directory / CONFIG_FILE).is_file() and "speculators_model_type" in _config_json(directory)


def _is_eagle3(directory: pathlib.Path) -> bool:
  return (not _is_speculators(directory) and (directory / WEIGHTS_FILE).is_file()
          and "d2t" in SafetensorsFile(directory / WEIGHTS_FILE))


def _is_eagle(directory: pathlib.Path) -> bool:
  if (not (directory / CONFIG_FILE).is_file() or _is_vllm_medusa(directory)
      or _is_speculators(directory) or _is_eagle3(directory)):
    return False
  if (directory / WEIGHTS_FILE).is_file():
    return "fc.weight" in SafetensorsFile(directory / WEIGHTS_FILE)
  return (directory / TORCH_FILE).is_file()


@dataclasses.dataclass(frozen=True)
class Layout:
  """A public layout: `detect` recognises a directory in it (and no other layout's; a
  directory holding only a torch pickle still counts, so that reading it says how to
  convert it), `read` and `write` convert. The family that declares the layout's name
  (`HeadFamily.layouts`) is the one it holds."""

  read: Callable[[pathlib.Path, ModelConfig | None, np.dtype], tuple[HeadsConfig, Params]]
  write: Callable[[Heads, pathlib.Path, Model | None, np.dtype], None]
  detect: Callable[[pathlib.Path], bool]


_LAYOUTS = {"medusa": Layout(_read_medusa, _write_medusa, _is_medusa),
            "vllm-medusa": Layout(_read_vllm_medusa, _write_vllm_medusa, _is_vllm_medusa),
            "eagle": Layout(_read_eagle, _write_eagle, _is_eagle),
            "eagle3": Layout(_read_eagle3, _write_eagle3, _is_eagle3),
            "speculators": Layout(_read_speculators, _write_speculators, _is_speculators)}
LAYOUTS = tuple(_LAYOUTS)


def _layout(name: str) -> Layout:
  if name not in _LAYOUTS:
    raise MdjaxError(f"unknown heads layout {name!r}; supported: {', '.join(LAYOUTS)}")
  return _LAYOUTS[name]


def detect_layout(path: str | os.PathLike) -> str | None:
  """The public layout of the heads in directory `path`, None where it holds none."""
  directory = pathlib.Path(path)
  return next((name for name, layout in _LAYOUTS.items() if layout.detect(directory)), None)


def import_heads(path: str | os.PathLike, layout: str | None = None,
                 model_config: ModelConfig | None = None, *, dtype="float32") -> Heads:
  """Heads from directory `path` in a public `layout` (`LAYOUTS`; None: detected).

  `model_config`, the model the heads will run on, is checked against them and names
  their base family where the files do not (FasterDecoding's and vLLM's Medusa configs
  name only the base model).
  """
  directory = pathlib.Path(path)
  if not directory.is_dir():
    raise CheckpointError(f"no heads directory at {str(path)!r}")
  if layout is None:
    layout = detect_layout(directory)
    if layout is None:
      raise CheckpointError(
          f"no heads in a known layout in {str(path)!r}: expected {MEDUSA_FILE} (FasterDecoding "
          f"Medusa), or {CONFIG_FILE} with {WEIGHTS_FILE} (vLLM Medusa: model_type \"medusa\"; "
          "EAGLE: an fc.weight tensor)")
  config, params = _layout(layout).read(directory, model_config, weight_dtype(dtype))
  if model_config is not None:
    config.check_model(model_config)
  card = (directory / CARD_FILE).read_text() if (directory / CARD_FILE).is_file() else ""
  return Heads(config=config, params=params, card=card, name=str(path), path=str(path))


def export_heads(heads: Heads, path: str | os.PathLike, layout: str, *,
                 model: Model | None = None, dtype="float32") -> None:
  """Writes `heads` as directory `path` (replaced atomically) in public `layout`.

  `model` (the one the heads run on) is needed where the layout stores parts of it:
  eagle (its config and embedding) and medusa heads that share its unembedding.
  """
  spec, holds = _layout(layout), family.with_layout(layout)
  if heads.config.family != holds:
    raise MdjaxError(f"the {layout} layout holds {holds} heads; these are "
                     f"{heads.config.family} heads")
  if model is not None:
    heads.check_model(model.config)
  np_dtype = weight_dtype(dtype)
  with atomic_directory(path) as staging:
    spec.write(heads, staging, model, np_dtype)
    if heads.card:
      (staging / CARD_FILE).write_text(heads.card)
