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

q|k|v and gate|up are fused, as for a float model, when their parts share a group size
and an offset form; else they stay split (`wq`, `wk`, `wv`; `w_gate`, `w_up`: the layout
`transformer` also reads on a mesh). A matrix the file holds in float (F32, F16, BF16)
stays a float matrix of the load's dtype. Norms and biases are float.

On a mesh, each layer's weights are read into host arrays and put on their shards by
`mdjax.sharding.WeightPlacement.place` (integers, scales and offsets alike; fused
projections split where tensor > 1): no weight is put whole on one device, but each
process reads every tensor's blocks whole.
"""

from __future__ import annotations

import collections
import pathlib

import numpy as np

from mdjax import sharding
from mdjax.checkpoints import gguf as gguf_reader
from mdjax.checkpoints.gguf_blocks import FLOAT_TYPES, Blocks, read_blocks
from mdjax.checkpoints.hf_layout import norms_after_attention
from mdjax.errors import CheckpointError
from mdjax.models.config import ModelConfig, weight_dtype
from mdjax.models.model import Model
from mdjax.models.quantized import QuantizedWeight, from_parts

import jax.numpy as jnp


def load(file: str | pathlib.Path, dtype="float32", *, name: str | None = None,
         mesh=None) -> Model:
  """The model a GGUF file holds, its matrices kept as the file's blocks."""
  file = pathlib.Path(file)
  if not file.is_file():
    raise CheckpointError(f"no such GGUF file: {str(file)!r}")
  reader, arch, tensors, config = gguf_reader.open_file(file)
  layout = sharding.layout_for(mesh, config)
  blocks = _Matrices(tensors, weight_dtype(dtype), xp=jnp if layout is None else np)
  params = _params(config, blocks, place=(lambda tree: tree) if layout is None else layout.place)
  tensors.check_all_read()
  kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(blocks.kinds.items()))
  return Model(config=config, params=params, tokenizer=gguf_reader.tokenizer_of(reader, file, arch),
               name=name if name is not None else file.name, quantization=f"gguf ({kinds})",
               layout=layout)


class _Matrices:
  """The file's matrices by Hugging Face name, as `Blocks` (or float arrays)."""

  def __init__(self, tensors: gguf_reader.Tensors, dtype: np.dtype, xp):
    self.tensors, self.dtype, self.xp = tensors, dtype, xp  # xp: numpy keeps them on the host
    self.kinds: collections.Counter = collections.Counter()  # ggml type -> matrices read

  def read(self, hf_name: str, rows: int, cols: int, heads: int | None = None
           ) -> Blocks | np.ndarray:
    """Tensor `hf_name` [rows, cols] (ggml's rows: outputs); `heads`: a q or k projection
    whose rows llama.cpp permuted."""
    t = self.tensors
    gguf_name = t.gguf_name(hf_name)
    tensor = t.by_name.get(gguf_name)
    if tensor is None or tensor.tensor_type in FLOAT_TYPES:  # missing: `get` names it
      return t.get(hf_name, (rows, cols)).astype(self.dtype)
    stored = tuple(int(n) for n in reversed(tensor.shape))
    if stored != (rows, cols):
      raise CheckpointError(f"tensor {gguf_name!r} in {str(t.file)!r} has shape "
                            f"{list(stored)}, expected {[rows, cols]}")
    blocks = read_blocks(tensor.data, tensor.tensor_type, (rows, cols))
    if heads is not None and t.arch in gguf_reader.PERMUTED_QK:
      blocks = Blocks(q=gguf_reader.unpermute(blocks.q, heads),
                      scale=gguf_reader.unpermute(blocks.scale, heads),
                      offset=(None if blocks.offset is None
                              else gguf_reader.unpermute(blocks.offset, heads)),
                      group=blocks.group, bits=blocks.bits)
    t.used.add(gguf_name)
    t.progress.update()
    self.kinds[tensor.tensor_type.name] += 1
    return blocks

  def weight(self, part: Blocks | np.ndarray, axis: int = -2):
    """One matrix as the params hold it: `[D, F]` (axis -2, ggml's rows transposed) or
    `[V, D]` as stored (axis -1, the embedding)."""
    if isinstance(part, np.ndarray):
      return self.xp.asarray(part.T if axis == -2 else part)
    turn = (lambda a: None if a is None else np.ascontiguousarray(a.T)) if axis == -2 else (
        lambda a: a)
    return from_parts(turn(part.q), turn(part.scale), turn(part.offset), axis=axis,
                      bits=part.bits, dtype=self.dtype, xp=self.xp)

  def fused(self, parts: list[Blocks | np.ndarray]) -> QuantizedWeight | None:
    """The parts (outputs one after another) as one `[D, sum F]` weight, or None when they
    do not share a form (a float part, another group size or offset form)."""
    if not all(isinstance(p, Blocks) for p in parts) or len(
        {(p.group, p.offset is None) for p in parts}) != 1:
      return None
    cat = lambda field: np.concatenate([getattr(p, field) for p in parts])  # noqa: E731
    return self.weight(Blocks(q=cat("q"), scale=cat("scale"),
                              offset=None if parts[0].offset is None else cat("offset"),
                              group=parts[0].group, bits=max(p.bits for p in parts)))


def _params(c: ModelConfig, m: _Matrices, place) -> dict:
  """The params, each layer's dict (then the rest) handed to `place` as it is read."""
  d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
  norm = lambda name, n: m.xp.asarray(m.tensors.get(name, (n,)).astype(m.dtype))  # noqa: E731

  def projections(lp: dict, fused: str, names: tuple[str, ...], parts: list) -> None:
    joined = m.fused(parts)
    if joined is not None:
      lp[fused] = joined
    else:
      lp.update({name: m.weight(part) for name, part in zip(names, parts)})

  def layer(p: str) -> dict:
    lp = {"attn_norm": norm(p + "input_layernorm.weight", d),
          "wo": m.weight(m.read(p + "self_attn.o_proj.weight", d, c.num_heads * h)),
          "w_down": m.weight(m.read(p + "mlp.down_proj.weight", d, f)),
          **{name: norm(f"{p}{hf}.weight", d) for name, hf in norms_after_attention(c).items()}}
    sizes = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
    projections(lp, "wqkv", ("wq", "wk", "wv"), [
        m.read(f"{p}self_attn.{x}_proj.weight", n * h, d, heads=n if x != "v" else None)
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
