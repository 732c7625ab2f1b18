"""GGUF files the tests write as llama.cpp's converter would: HF weights renamed to
llama.cpp's names, llama's q/k rows permuted, gemma3's norms shifted, each matrix in the
ggml type asked for (K-quants as random blocks under sane scales). No torch needed, so
the multi-device checks write them too."""

from __future__ import annotations

import math
import pathlib

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
KQUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf's `LlamaModel.permute` of q/k rows (HF -> GGUF)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
  """Random blocks of a K-quant, `[rows, bytes per row]`: gguf 0.19 can dequantize but
  not quantize K-quants, so the tests write random quants under sane float16 scales
  (at the byte offsets `gguf.quants` reads them from)."""
  values_per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
  blocks = rng.integers(0, 256, (rows, cols // values_per_block, block_bytes), dtype=np.uint8)
  # value = d * (6-bit scale) * quant (- dmin * (6-bit min)); typically d * 32 * 8, d * 32 * 16,
  # d * 64 * 16: values ~ 1 / sqrt(cols), and dmin = d * (mean quant) centres them
  d = 1 / math.sqrt(cols) / {Q.Q4_K: 256, Q.Q5_K: 512, Q.Q6_K: 1024}[qtype]
  as_bytes = lambda x: np.frombuffer(np.float16(x).tobytes(), np.uint8)  # noqa: E731
  if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin first
    blocks[..., 0:2] = as_bytes(d)
    blocks[..., 2:4] = as_bytes(d * (7.5 if qtype == Q.Q4_K else 15.5))
  else:  # Q6_K: d last (its quants are signed)
    blocks[..., -2:] = as_bytes(d)
  return blocks.reshape(rows, -1)


def write_gguf(path: pathlib.Path, arch: str, state: dict[str, np.ndarray], config, types,
               seed: int = 0, tokenizer: dict | None = None) -> pathlib.Path:
  """A GGUF of HF weights `state` as llama.cpp's converter writes it: llama.cpp names,
  q/k rows permuted for llama, gemma3's norms with 1 added and its sliding window,
  RoPE scaling and soft-cap, each matrix stored as `types` says."""
  rng = np.random.default_rng(seed)
  rope = config.rope_parameters.get("full_attention", config.rope_parameters)
  writer = gguf.GGUFWriter(path, arch)
  writer.add_name(f"tiny {arch}")
  writer.add_block_count(config.num_hidden_layers)
  writer.add_context_length(config.max_position_embeddings)
  writer.add_embedding_length(config.hidden_size)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_attention_heads)
  writer.add_head_count_kv(config.num_key_value_heads)
  writer.add_key_length(config.head_dim)
  writer.add_value_length(config.head_dim)
  writer.add_rope_dimension_count(config.head_dim)
  writer.add_rope_freq_base(rope["rope_theta"])
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  if arch == "gemma3":
    writer.add_sliding_window(config.sliding_window)
    if rope["rope_type"] == "linear":
      writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
      writer.add_rope_scaling_factor(rope["factor"])
    if config.final_logit_softcapping:
      writer.add_final_logit_softcapping(config.final_logit_softcapping)
  writer.add_vocab_size(config.vocab_size)
  writer.add_bos_token_id(config.bos_token_id)
  writer.add_eos_token_id(config.eos_token_id)
  for key, value in (tokenizer or {}).items():
    writer.add_key_value(key, *value)
  names = gguf.get_tensor_name_map(
      next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers)
  for hf_name, value in state.items():
    base, suffix = hf_name.rsplit(".", 1)
    name = f"{names.get_name(base)}.{suffix}" if names.get_name(base) else hf_name  # a GGUF name
    if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
      value = llama_cpp_permute(value, config.num_attention_heads if ".q_proj." in hf_name
                                else config.num_key_value_heads)
    if arch == "gemma3" and hf_name.endswith("norm.weight"):
      value = value + 1  # llama.cpp's Gemma3Model.norm_shift
    kind = name.split(".")[-2]
    qtype = types.get(kind, Q.F32) if suffix == "weight" and value.ndim == 2 else Q.F32
    if qtype in KQUANTS:
      writer.add_tensor(name, random_kquant_blocks(rng, *value.shape, qtype), raw_dtype=qtype)
    elif qtype in (Q.F32, Q.F16):
      writer.add_tensor(name, value.astype(np.float32 if qtype == Q.F32 else np.float16))
    else:
      writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path
