"""The Hugging Face tensor layout: HF-named tensors <-> `mdjax.models.transformer` params.

Each HF tensor maps onto the per-layer, fused, transposed layout of
`mdjax.models.transformer`::

    model.embed_tokens.weight                    [V, D]     -> embed       [V, D]
    model.layers.{i}.self_attn.q_proj.weight     [N*H, D]  \\
    model.layers.{i}.self_attn.k_proj.weight     [K*H, D]   -> layers[i].wqkv [D, (N+2K)*H]
    model.layers.{i}.self_attn.v_proj.weight     [K*H, D]  /
    model.layers.{i}.self_attn.o_proj.weight     [D, N*H]   -> layers[i].wo   [N*H, D]
    model.layers.{i}.mlp.gate_proj.weight        [F, D]    \\
    model.layers.{i}.mlp.up_proj.weight          [F, D]     -> layers[i].w_gate_up [D, 2F]
    model.layers.{i}.mlp.down_proj.weight        [D, F]     -> layers[i].w_down [F, D]
    lm_head.weight                               [V, D]     -> lm_head     [D, V]

(biases, norms and q/k norms map the same way without the transpose). Gemma3
(model_type `gemma3_text`) has four norms per layer::

    model.layers.{i}.input_layernorm.weight             -> layers[i].attn_norm
    model.layers.{i}.post_attention_layernorm.weight    -> layers[i].post_attn_norm
    model.layers.{i}.pre_feedforward_layernorm.weight   -> layers[i].mlp_norm
    model.layers.{i}.post_feedforward_layernorm.weight  -> layers[i].post_mlp_norm

Loaders read through a `TensorSource`, tensors by HF name: a checkpoint directory's
safetensors (`SafetensorsCheckpoint`, `mdjax.checkpoints.hf`), one safetensors file
(`SafetensorsFile`: heads), a GGUF file dequantized (`mdjax.checkpoints.gguf`) or an EAGLE
head seen as a model's layers (`mdjax.heads.formats`). A safetensors header is
checked before any of its tensors is read, so a truncated or corrupt file is
reported by name. `params_from_hf` describes each param as a recipe over the source's
tensors (`mdjax.checkpoints.lazy`: the transposes, fusions and padding above), so a load
onto a mesh reads only the slices each process's devices hold (`lazy.SlicedTensorSource`).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import ml_dtypes  # noqa: F401 -- registers bfloat16 with numpy, which BF16 tensors need
import numpy as np
import safetensors
import safetensors.numpy

from mdjax import sharding
from mdjax.checkpoints import lazy
from mdjax.errors import CheckpointError
from mdjax.models.config import ModelConfig
from mdjax.models.layer_loop import unstack_layers
from mdjax.models.transformer import Params

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# the header metadata transformers writes into its own checkpoints
WEIGHTS_METADATA = {"format": "pt"}


# --------------------------------------------------------------------------- safetensors


class SafetensorsFile:
  """One safetensors file's tensors by name, shape-checked as they are read; what was
  never read is reported by `check_all_read` (a config that does not describe its file)."""

  def __init__(self, file: pathlib.Path):
    try:
      # pread, not a memory map: a file changed under a map faults (SIGBUS) when read
      self._opened = safetensors.safe_open(file, framework="np", backend="pread")
    except safetensors.SafetensorError as e:
      raise CheckpointError(f"corrupt safetensors file {file} ({file.stat().st_size} bytes, "
                            f"truncated or not safetensors): {e}") from None
    self.file, self.names, self.read = file, set(self._opened.keys()), set()

  def __contains__(self, name: str) -> bool:
    return name in self.names

  def shape(self, name: str, ndim: int) -> tuple[int, ...]:
    """The shape of tensor `name`, which must have `ndim` dimensions."""
    shape = self._shape(name)
    if len(shape) != ndim:
      raise CheckpointError(f"tensor {name!r} in {self.file} has shape {list(shape)}, expected "
                            f"{ndim} dimensions")
    return shape

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `name`, checked to have `shape`: a fresh in-memory array."""
    return self._read(name, shape, lambda: self._opened.get_tensor(name))

  def get_slice(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """`get(name, shape)[index]`, reading only the slice's bytes."""
    return self._read(name, shape, lambda: self._opened.get_slice(name)[index])

  def _read(self, name: str, shape: tuple[int, ...], read: Callable[[], np.ndarray]) -> np.ndarray:
    """`read()` of tensor `name` once it is checked to have `shape`; `CheckpointError`
    naming it when it has another shape or a dtype numpy lacks."""
    found = self._shape(name)
    if found != tuple(shape):
      raise CheckpointError(f"tensor {name!r} in {self.file} has shape {list(found)}, expected "
                            f"{list(shape)}")
    try:
      tensor = read()
    except (safetensors.SafetensorError, AttributeError) as e:  # AttributeError: no numpy dtype
      dtype = self._opened.get_slice(name).get_dtype()
      raise CheckpointError(
          f"cannot read tensor {name!r} ({dtype}) from {self.file}: {e}") from None
    self.read.add(name)
    return tensor

  def check_all_read(self, ignored: tuple[str, ...] = ()) -> None:
    """Raises naming a tensor never read (nor `ignored`)."""
    left = sorted(self.names - self.read - set(ignored))
    if left:
      raise CheckpointError(f"unexpected tensor {left[0]!r} in {self.file} ({len(left)} in all): "
                            "its config.json describes no such tensor")

  def recipe(self, name: str) -> lazy.Tensor:
    """Tensor `name` in its stored shape and dtype, nothing read yet."""
    stored = self._opened.get_slice(name)
    dtype = stored[:0].dtype  # an empty slice: the dtype as numpy names it, no bytes read
    return lazy.Tensor(self, name, tuple(stored.get_shape()), dtype)

  def _shape(self, name: str) -> tuple[int, ...]:
    if name not in self.names:
      raise CheckpointError(f"missing tensor {name!r} in {self.file}")
    return tuple(self._opened.get_slice(name).get_shape())


class SafetensorsCheckpoint:
  """The tensors of a checkpoint directory, by HF name, across shards: one
  `WEIGHTS_FILE`, or the shards an `INDEX_FILE` lists."""

  def __init__(self, directory: pathlib.Path):
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"corrupt shard index {index}: {e!r}") from None
      self.source = index
      self.files = {name: directory / shard for name, shard in weight_map.items()}
    elif single.is_file():
      self.source = single
      self.files = None
    else:
      raise CheckpointError(f"no weights in {directory}: neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    self._open: dict[pathlib.Path, SafetensorsFile] = {}

  def _file(self, file: pathlib.Path) -> SafetensorsFile:
    """`file` opened with its header checked; raises `CheckpointError` naming it."""
    if file not in self._open:
      if not file.is_file():
        raise CheckpointError(f"missing safetensors shard {file} (listed in {self.source})")
      self._open[file] = SafetensorsFile(file)
    return self._open[file]

  def validate(self) -> None:
    """Checks every file's header, so corruption is reported before any tensor is read."""
    for file in self._all_files():
      self._file(file)

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `name`, checked to have `shape`: a fresh in-memory array."""
    return self._holding(name).get(name, shape)

  def read_all(self) -> dict[str, np.ndarray]:
    """Every tensor by name, whatever its shape (mdjax's own quantized tensors)."""
    return {name: self._file(f).get(name, self._file(f)._shape(name))
            for f in self._all_files() for name in sorted(self._file(f).names)}

  def recipes(self) -> dict[str, lazy.Tensor]:
    """Every tensor by name in its stored shape and dtype, nothing read yet (mdjax's own
    quantized tensors, put on a mesh slice by slice)."""
    return {name: self._file(f).recipe(name)
            for f in self._all_files() for name in sorted(self._file(f).names)}

  def _all_files(self) -> list[pathlib.Path]:
    """The checkpoint's safetensors files: the one file, or every shard the index lists."""
    return [self.source] if self.files is None else sorted(set(self.files.values()))

  def get_slice(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """`get(name, shape)[index]`, reading only the slice's bytes."""
    return self._holding(name).get_slice(name, shape, index)

  def _holding(self, name: str) -> SafetensorsFile:
    """The file that holds tensor `name`."""
    if self.files is not None and name not in self.files:
      raise CheckpointError(f"missing tensor {name!r} in {self.source}")
    return self._file(self.source if self.files is None else self.files[name])


def write_weights(directory: pathlib.Path, tensors: dict[str, np.ndarray],
                   max_shard_bytes: int | None) -> None:
  """One `model.safetensors`, or shards of at most `max_shard_bytes` (a tensor larger
  than that gets a shard of its own) plus `model.safetensors.index.json`."""
  total = sum(a.nbytes for a in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    safetensors.numpy.save_file(tensors, directory / WEIGHTS_FILE, metadata=WEIGHTS_METADATA)
    return
  shards: list[dict[str, np.ndarray]] = [{}]
  for name, array in tensors.items():
    if shards[-1] and sum(a.nbytes for a in shards[-1].values()) + array.nbytes > max_shard_bytes:
      shards.append({})
    shards[-1][name] = array
  weight_map = {}
  for i, shard in enumerate(shards, start=1):
    file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
    safetensors.numpy.save_file(shard, directory / file, metadata=WEIGHTS_METADATA)
    weight_map.update(dict.fromkeys(shard, file))
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


# --------------------------------------------------------------------------- params


def norms_after_attention(config: ModelConfig) -> dict[str, str]:
  """A layer's norms besides `attn_norm` (HF's input_layernorm): mdjax param name ->
  HF name after `model.layers.{i}.`."""
  if config.gemma_norms:
    return {"post_attn_norm": "post_attention_layernorm", "mlp_norm": "pre_feedforward_layernorm",
            "post_mlp_norm": "post_feedforward_layernorm"}
  return {"mlp_norm": "post_attention_layernorm"}


def params_from_hf(config: ModelConfig, source: lazy.TensorSource, dtype,
                    place: Callable[[dict], dict] = lazy.placer(None)) -> Params:
  """HF tensors -> the per-layer, fused, transposed params of `transformer`. Each is
  described as a recipe over `source` (`mdjax.checkpoints.lazy`), read only when `place`
  turns each layer's dict, then the rest, into arrays: on one device or on a mesh,
  each process reading only its devices' slices (`mdjax.checkpoints.lazy.placer`), or on the
  host (`lazy.materialize`)."""
  c = config
  d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
  qkv_sizes = (c.num_heads * h, c.num_kv_heads * h, c.num_kv_heads * h)
  dtype = np.dtype(dtype)

  def get(name, *shape):
    return lazy.Tensor(source, name, shape, dtype)

  def layer(p):
    lp = {
        "attn_norm": get(p + "input_layernorm.weight", d),
        "wqkv": lazy.concatenate(
            [get(f"{p}self_attn.{x}_proj.weight", n, d).T for x, n in zip("qkv", qkv_sizes)],
            axis=1),  # [D, (N + 2K) * H]
        "wo": get(p + "self_attn.o_proj.weight", d, c.num_heads * h).T,
        **{name: get(f"{p}{hf}.weight", d) for name, hf in norms_after_attention(c).items()},
        "w_gate_up": lazy.concatenate(
            [get(f"{p}mlp.{x}_proj.weight", f, d).T for x in ("gate", "up")], axis=1),  # [D, 2F]
        "w_down": get(p + "mlp.down_proj.weight", d, f).T,
    }
    if c.qkv_bias:
      lp["bqkv"] = lazy.concatenate(
          [get(f"{p}self_attn.{x}_proj.bias", n) for x, n in zip("qkv", qkv_sizes)])
    if c.o_bias:
      lp["bo"] = get(p + "self_attn.o_proj.bias", d)
    if c.mlp_bias:
      lp["b_gate_up"] = lazy.concatenate(
          [get(f"{p}mlp.{x}_proj.bias", f) for x in ("gate", "up")])
      lp["b_down"] = get(p + "mlp.down_proj.bias", d)
    if c.qk_norm:
      lp["q_norm"] = get(p + "self_attn.q_norm.weight", h)
      lp["k_norm"] = get(p + "self_attn.k_norm.weight", h)
    return place(lp)

  layers = [layer(f"model.layers.{i}.") for i in range(c.num_layers)]
  top = {"embed": get("model.embed_tokens.weight", c.vocab_size, d),
         "final_norm": get("model.norm.weight", d)}
  if not c.tie_word_embeddings:
    top["lm_head"] = get("lm_head.weight", c.vocab_size, d).T  # [D, V]
  return {**place(top), "layers": layers}


def params_to_hf(config: ModelConfig, params: Params, dtype) -> dict[str, np.ndarray]:
  """The inverse of `params_from_hf`: HF name -> numpy array of `dtype`."""
  c = config
  h = c.head_dim
  qkv_split = np.cumsum([c.num_heads * h, c.num_kv_heads * h])
  params = sharding.one_device_layout(params, config)
  out = {"model.embed_tokens.weight": np.asarray(params["embed"])}
  for i, layer in enumerate(unstack_layers(params)["layers"]):  # either layer loop's layout
    p = f"model.layers.{i}."
    lp = {name: np.asarray(w) for name, w in layer.items()}
    out[p + "input_layernorm.weight"] = lp["attn_norm"]
    for x, w in zip("qkv", np.split(lp["wqkv"], qkv_split, axis=1)):
      out[f"{p}self_attn.{x}_proj.weight"] = w.T
    if c.qkv_bias:
      for x, b in zip("qkv", np.split(lp["bqkv"], qkv_split)):
        out[f"{p}self_attn.{x}_proj.bias"] = b
    if c.qk_norm:
      out[p + "self_attn.q_norm.weight"] = lp["q_norm"]
      out[p + "self_attn.k_norm.weight"] = lp["k_norm"]
    out[p + "self_attn.o_proj.weight"] = lp["wo"].T
    if c.o_bias:
      out[p + "self_attn.o_proj.bias"] = lp["bo"]
    for name, hf_name in norms_after_attention(c).items():
      out[f"{p}{hf_name}.weight"] = lp[name]
    for x, w in zip(("gate", "up"), np.split(lp["w_gate_up"], 2, axis=1)):
      out[f"{p}mlp.{x}_proj.weight"] = w.T
    if c.mlp_bias:
      for x, b in zip(("gate", "up"), np.split(lp["b_gate_up"], 2)):
        out[f"{p}mlp.{x}_proj.bias"] = b
      out[p + "mlp.down_proj.bias"] = lp["b_down"]
    out[p + "mlp.down_proj.weight"] = lp["w_down"].T
  out["model.norm.weight"] = np.asarray(params["final_norm"])
  if not c.tie_word_embeddings:
    out["lm_head.weight"] = np.asarray(params["lm_head"]).T
  return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}
