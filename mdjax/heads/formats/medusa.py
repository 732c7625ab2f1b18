"""The Medusa layouts: FasterDecoding's ("medusa") and vLLM's ("vllm-medusa"), onto
`MedusaHeads`' params (`mdjax.heads.medusa`); the picture is `mdjax.heads.formats`'."""

from __future__ import annotations

import pathlib

import numpy as np
import safetensors.numpy

from mdjax.errors import CheckpointError, MdjaxError
from mdjax.heads.base import Heads, HeadsConfig
from mdjax.heads.formats.common import (CONFIG_FILE, TORCH_FILE, WEIGHTS_FILE, CheckpointFormat,
                                        base_model_of, cast, config_json, local_family,
                                        model_type_family, register, to_jax, weights_file,
                                        write_config)
from mdjax.checkpoints import hf, hf_layout
from mdjax.checkpoints.hf_layout import SafetensorsFile
from mdjax.models.config import ModelConfig
from mdjax.models.model import Model
from mdjax.models.transformer import Params

MEDUSA_FILE, MEDUSA_TORCH_FILE = "medusa_lm_head.safetensors", "medusa_lm_head.pt"
# each layout's name of block (k, l) and of head k's unembedding (L: layers per head)
FASTERDECODING_NAMES = ("{k}.{l}.linear", "{k}.{L}")
VLLM_NAMES = ("blocks.{k}.layers.{l}", "lm_heads.{k}")


def _medusa_base(cfg: dict, model_config: ModelConfig | None,
                 directory: pathlib.Path) -> tuple[str, str]:
  """(base_model, base_family) of medusa heads with config.json `cfg`: the family is
  `model_config`'s, else the config's own model_type (Medusa-2 configs copy the base
  model's), else that of the base model it names, where that is known here."""
  base_model = base_model_of(cfg)
  model_family = (model_config.family if model_config is not None
                  else model_type_family(cfg.get("model_type")) or local_family(base_model))
  if model_family is None:
    raise CheckpointError(f"{directory}: cannot tell which model family the heads are for (base "
                          f"model {base_model!r} is not known here); pass the model's config: "
                          "import_heads(path, model_config=model.config)")
  return base_model, model_family



def _model_unembedding(heads: Heads, model: Model | None, layout: str) -> np.ndarray:
  """The model's unembedding as torch stores it, [V, D], for heads that share it."""
  if model is None:
    raise MdjaxError(f"these medusa heads share the model's unembedding, which the {layout} "
                     "layout stores in its file: pass model= to export_heads")
  params = model.params
  return np.asarray(params["lm_head"]).T if "lm_head" in params else np.asarray(params["embed"])



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
  cfg = config_json(directory)
  tensors = SafetensorsFile(weights_file(directory, MEDUSA_FILE, MEDUSA_TORCH_FILE))
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
  return config, to_jax(params, dtype)


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
  safetensors.numpy.save_file(cast(tensors, dtype), directory / MEDUSA_FILE,
                              metadata=hf_layout.WEIGHTS_METADATA)
  write_config(directory, {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
                            "base_model_name_or_path": c.base_model})


def _read_vllm_medusa(directory: pathlib.Path, model_config: ModelConfig | None,
                      dtype) -> tuple[HeadsConfig, Params]:
  file = weights_file(directory, WEIGHTS_FILE, TORCH_FILE)
  cfg = config_json(directory)
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
  return config, to_jax(params, dtype)


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
  hf_layout.write_weights(directory, cast(tensors, dtype), None)
  write_config(directory, {
      "architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": c.num_heads,
      "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size,
      "vocab_size": c.vocab_size, "medusa_fc_bias": True,
      "original_lm_head": not c.own_unembedding, "base_model_name_or_path": c.base_model})


def _is_medusa(directory: pathlib.Path) -> bool:
  return (directory / MEDUSA_FILE).is_file() or (directory / MEDUSA_TORCH_FILE).is_file()


def _is_vllm_medusa(directory: pathlib.Path) -> bool:
  return (directory / CONFIG_FILE).is_file() and config_json(directory).get(
      "model_type") == "medusa"


register("medusa", CheckpointFormat("medusa", _read_medusa, _write_medusa, _is_medusa))
register("vllm-medusa", CheckpointFormat("medusa", _read_vllm_medusa, _write_vllm_medusa,
                                         _is_vllm_medusa))
