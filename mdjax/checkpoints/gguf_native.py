"""A GGUF file's quantized blocks as they are: `mdjax.load(file, quantize="gguf")`.

Each matrix is read by `gguf_blocks.read_blocks` into integers and per-group scales (and
offsets) and held as a `mdjax.models.quantized.QuantizedWeight`: no float copy of a
weight is ever made, on the host or on the device. The params are those of
`mdjax.models.transformer` (the names `hf_layout.params_from_hf` gives a float
checkpoint), from the same tensors the float conversion reads (`gguf.Tensors`: the
names, llama's q/k row order undone, gemma3's norms less one)::

    ggml tensor [rows = outputs F, cols = inputs D], blocks along D
      -> q [D, F], scale / offset [G, F]     (transposed: groups along the contracted -2)
    token_embd [V, D] -> embed: q [V, D], scale [V, G]   (axis -1: read by row, and
                                                          contracted in place as the head)

q|k|v and gate|up are fused, as for a float model, when their parts share a form
(`quantized.same_form`: all float, or blocks of one group size and offset form); else
they stay split (`wq`, `wk`, `wv`; `w_gate`, `w_up`: the layout
`transformer` also reads on a mesh). A matrix the file holds in float (F32, F16, BF16)
stays a float matrix of the load's dtype. Norms and biases are float.

Each field (q, scale, offset) is a recipe (`mdjax.checkpoints.lazy`) over the file's
bytes, decoded when read and only in the rows and whole ggml blocks a read covers. On
one device each layer is read whole; on a mesh each weight is put on its shards by
`mdjax.sharding.WeightPlacement.place` with `lazy.put` (fused projections split where
tensor > 1), so each process decodes only the slices its own devices hold::

    wo [N*H, D] = o_proj [D, N*H] transposed, blocks of 32 along N*H; tensor = 4
      device 1 holds wo[NH/4 : NH/2, :]  -> ggml columns [NH/4, NH/2): its whole blocks

A matrix the file holds in float is read the same way, by the rows and columns a shard
covers (the file's bytes are a memory map). The config, tokenizer
and tensor table come from `gguf_header.open_header`: the file's header, parsed once per
file's bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib

import gguf
import numpy as np

from mdjax import sharding
from mdjax.checkpoints import gguf as gguf_reader
from mdjax.checkpoints import lazy
from mdjax.checkpoints.gguf_blocks import FLOAT_TYPES, Blocks, check, read_blocks
from mdjax.checkpoints.gguf_header import open_header
from mdjax.checkpoints.hf_layout import norms_after_attention
from mdjax.errors import CheckpointError
from mdjax.models.config import ModelConfig, weight_dtype
from mdjax.models.model import Model
from mdjax.models.quantized import concatenate, from_parts, same_form


def load(file: str | pathlib.Path, dtype="float32", *, name: str | None = None,
         mesh=None) -> Model:
  """The model a GGUF file holds, its matrices kept as the file's blocks."""
  file = pathlib.Path(file)
  if not file.is_file():
    raise CheckpointError(f"no such GGUF file: {str(file)!r}")
  _, tensors, config, tokenizer = open_header(file)
  layout = sharding.layout_for(mesh, config)
  blocks = _Matrices(tensors, weight_dtype(dtype))
  params = _params(config, blocks, place=lazy.placer(layout))
  tensors.check_all_read()
  kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(blocks.kinds.items()))
  return Model(config=config, params=params, tokenizer=tokenizer,
               name=name if name is not None else file.name, quantization=f"gguf ({kinds})",
               layout=layout)


class _Region:
  """A quantized ggml tensor [rows, cols] (its raw bytes, a view of the file) decoded by
  region as reads ask: the rows asked for, the whole blocks covering the columns asked
  for. Each region is decoded once and kept while the weight's recipes live (one layer's
  placement): q, scale and offset are put one after another, each shard by shard."""

  def __init__(self, data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]):
    self.format = check(data, qtype, shape)
    self.qtype, self.shape = qtype, shape
    self.block, self.type_size = gguf.GGML_QUANT_SIZES[qtype]
    self.raw = data.reshape(shape[0], shape[1] // self.block * self.type_size)
    self.decoded: dict[tuple[int, int, int, int], Blocks] = {}

  def decode(self, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[Blocks, int]:
    """`Blocks` of rows [r0, r1) and of the whole blocks covering columns [c0, c1); the
    column they start at."""
    (r0, r1), (c0, c1) = rows, cols
    first, last = c0 // self.block, -(-c1 // self.block)
    key = (r0, r1, first, last)
    if key not in self.decoded:
      raw = self.raw[r0:r1, first * self.type_size:last * self.type_size]
      self.decoded[key] = read_blocks(raw, self.qtype, (r1 - r0, (last - first) * self.block))
    return self.decoded[key], first * self.block


@dataclasses.dataclass(frozen=True, eq=False)
class _Field(lazy.Lazy):
  """One field of a quantized ggml tensor as `Blocks` holds it: "q" [rows, cols], or
  "scale" / "offset" [rows, cols // group]; a read decodes only the region it covers."""

  region: _Region
  field: str

  @property
  def shape(self) -> tuple[int, int]:
    rows, cols = self.region.shape
    return (rows, cols) if self.field == "q" else (rows, cols // self.region.format.group)

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(np.int8 if self.field == "q" else np.float32)

  def read(self, block: lazy.Block) -> np.ndarray:
    per = 1 if self.field == "q" else self.region.format.group  # columns of q per entry
    rows, (c0, c1) = block
    decoded, first = self.region.decode(rows, (c0 * per, c1 * per))
    start = first // per
    return getattr(decoded, self.field)[:, c0 - start:c1 - start]


def _fields(tensor, shape: tuple[int, int]) -> Blocks:
  """A quantized ggml tensor of numpy `shape` as `Blocks` whose q, scale and offset are
  recipes (`_Field`), nothing decoded yet."""
  region = _Region(tensor.data, tensor.tensor_type, shape)
  fmt = region.format
  return Blocks(q=_Field(region, "q"), scale=_Field(region, "scale"),
                offset=None if fmt.symmetric else _Field(region, "offset"),
                group=fmt.group, bits=fmt.bits)


@dataclasses.dataclass(frozen=True, eq=False)
class _FloatMatrix(lazy.Lazy):
  """A matrix the file holds in float (F32, F16, BF16) [rows, cols], in `dtype`: a read
  views only the rows and columns it covers (`gguf.Tensors.get_slice`)."""

  tensors: gguf_reader.Tensors
  name: str  # Hugging Face's
  shape: tuple[int, int]
  dtype: np.dtype

  def read(self, block: lazy.Block) -> np.ndarray:
    index = tuple(slice(*b) for b in block)
    return self.tensors.get_slice(self.name, self.shape, index).astype(self.dtype, copy=False)


class _Matrices:
  """The file's matrices by Hugging Face name, as `Blocks` of recipes (or float arrays)."""

  def __init__(self, tensors: gguf_reader.Tensors, dtype: np.dtype):
    self.tensors, self.dtype = tensors, dtype
    self.kinds: collections.Counter = collections.Counter()  # ggml type -> matrices read

  def read(self, hf_name: str, rows: int, cols: int) -> Blocks | _FloatMatrix:
    """Tensor `hf_name` [rows, cols] (ggml's rows: outputs), in Hugging Face's row order."""
    t = self.tensors
    gguf_name, tensor = t.tensor(hf_name, (rows, cols))
    t.used.add(gguf_name)
    t.progress.update()
    if tensor.tensor_type in FLOAT_TYPES:
      return _FloatMatrix(t, hf_name, (rows, cols), self.dtype)
    self.kinds[tensor.tensor_type.name] += 1
    blocks = _fields(tensor, (rows, cols))
    order = t.row_order(hf_name, rows)  # HF's row i is ggml's order[i]
    if order is not None:
      blocks = dataclasses.replace(blocks, **{
          f: lazy.take(getattr(blocks, f), order, axis=0) for f in ("q", "scale", "offset")
          if getattr(blocks, f) is not None})
    return blocks

  def weight(self, part: Blocks | _FloatMatrix, axis: int = -2):
    """One matrix as the params hold it: `[D, F]` (axis -2, ggml's rows transposed) or
    `[V, D]` as stored (axis -1, the embedding); recipes, read when placed."""
    if isinstance(part, _FloatMatrix):
      return part.T if axis == -2 else part
    turn = (lambda a: None if a is None else a.T) if axis == -2 else (lambda a: a)
    return from_parts(turn(part.q), turn(part.scale), turn(part.offset), axis=axis,
                      bits=part.bits, dtype=self.dtype, xp=lazy)


def _params(c: ModelConfig, m: _Matrices, place) -> dict:
  """The params, each layer's dict (then the rest) handed to `place` as it is read."""
  d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
  norm = lambda name, n: m.tensors.get(name, (n,)).astype(m.dtype)  # noqa: E731

  def projections(lp: dict, fused: str, names: tuple[str, ...], parts: list) -> None:
    weights = [m.weight(part) for part in parts]  # fused as a float checkpoint's are, when
    if same_form(weights):                        # they share a form (else split: a GGUF
      lp[fused] = concatenate(weights, xp=lazy)   # file may mix float and block types)
    else:
      lp.update(zip(names, weights))

  def layer(p: str) -> dict:
    lp = {"attn_norm": norm(p + "input_layernorm.weight", d),
          "wo": m.weight(m.read(p + "self_attn.o_proj.weight", d, c.num_heads * h)),
          "w_down": m.weight(m.read(p + "mlp.down_proj.weight", d, f)),
          **{name: norm(f"{p}{hf}.weight", d) for name, hf in norms_after_attention(c).items()}}
    sizes = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
    projections(lp, "wqkv", ("wq", "wk", "wv"), [
        m.read(f"{p}self_attn.{x}_proj.weight", n * h, d)
        for x, n in sizes.items()])
    projections(lp, "w_gate_up", ("w_gate", "w_up"),
                [m.read(f"{p}mlp.{x}_proj.weight", f, d) for x in ("gate", "up")])
    if c.qk_norm:
      lp["q_norm"], lp["k_norm"] = (norm(f"{p}self_attn.{x}_norm.weight", h) for x in "qk")
    if c.qkv_bias or c.o_bias or c.mlp_bias:
      raise CheckpointError(f"quantize='gguf' reads no biases yet ({c.family} with biases); "
                            "load this file without quantize")
    return place(lp)

  params = {"embed": m.weight(m.read("model.embed_tokens.weight", c.vocab_size, d), axis=-1),
            "final_norm": norm("model.norm.weight", d)}
  layers = [layer(f"model.layers.{i}.") for i in range(c.num_layers)]
  if not c.tie_word_embeddings:
    params["lm_head"] = m.weight(m.read("lm_head.weight", c.vocab_size, d))
  return {**place(params), "layers": layers}
