"""Model architecture: a frozen dataclass, hashable so it can be a static jit argument."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from mdjax import platform
from mdjax.errors import MdjaxError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
WEIGHT_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def default_weight_dtype() -> str:
  """"bfloat16" on accelerators (GPU, TPU), "float32" on CPU."""
  return "float32" if platform.is_cpu() else "bfloat16"


def weight_dtype(dtype) -> np.dtype:
  """The dtype for "float32", "bfloat16" or a jnp/np dtype; others are rejected."""
  try:
    resolved = jnp.dtype(WEIGHT_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
  except TypeError:
    resolved = None
  if resolved not in [jnp.dtype(d) for d in WEIGHT_DTYPES.values()]:
    raise MdjaxError(f"unsupported dtype {dtype!r}; supported: {', '.join(WEIGHT_DTYPES)}")
  return resolved


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """RoPE frequency scaling (`rope_type` as in Hugging Face's config.json)."""

  rope_type: str = "default"
  factor: float = 1.0
  # llama3 only
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """A decoder-only llama-family transformer.

  Covers llama (incl. llama3 RoPE scaling, tied or untied head), mistral
  (sliding window), qwen2 (q/k/v bias), qwen3 (RMSNorm on q and k per head) and
  gemma3 (the family implies its layer structure: RMSNorms scaling by `1 + weight`,
  four per layer, embeddings scaled by sqrt(hidden_size), GeGLU with tanh-approximated
  GELU; its config adds per-layer sliding/full attention, each kind with its own RoPE,
  a query scale and soft-capping).

  Per-layer values are tuples, so the config stays hashable (a static jit argument).
  """

  family: str = "llama"
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  qkv_bias: bool = False  # qwen2; llama's attention_bias also sets o_bias
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False  # qwen3
  sliding_window: int | None = None  # a query at p sees keys with p - pos < window
  # per layer "full_attention" | "sliding_attention" (gemma3); None: every layer alike,
  # sliding iff sliding_window is set (mistral)
  layer_types: tuple[str, ...] | None = None
  # RoPE of the sliding layers when layer_types is set (gemma3's local RoPE); None:
  # rope_theta / rope_scaling, as on every other layer
  sliding_rope_theta: float | None = None
  sliding_rope_scaling: RopeScaling = RopeScaling()
  query_pre_attn_scalar: float | None = None  # gemma3: scores scaled by this ** -0.5
  attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
  final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
  bos_token_id: int | None = None
  eos_token_id: tuple[int, ...] = ()
  pad_token_id: int | None = None

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise MdjaxError(f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}")
    for scaling in (self.rope_scaling, self.sliding_rope_scaling):
      if scaling.rope_type not in ROPE_TYPES:
        raise MdjaxError(
            f"unsupported rope_type {scaling.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if self.layer_types is not None:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))  # hashable
      if len(self.layer_types) != self.num_layers:
        raise MdjaxError(f"layer_types has {len(self.layer_types)} entries for "
                         f"num_layers={self.num_layers}")
      unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
      if unknown:
        raise MdjaxError(f"unsupported layer type {unknown[0]!r}; supported: "
                         f"{', '.join(LAYER_TYPES)}")
      if "sliding_attention" in self.layer_types and self.sliding_window is None:
        raise MdjaxError("layer_types has sliding_attention layers but sliding_window is None")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise MdjaxError(f"model config sliding_window must be >= 1, got {self.sliding_window}")
    if self.family == "gemma3" and not self.qk_norm:
      raise MdjaxError("gemma3 normalizes q and k per head: it needs qk_norm=True")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
      if getattr(self, name) < 1:
        raise MdjaxError(f"model config {name} must be >= 1, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise MdjaxError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise MdjaxError(f"head_dim must be even for RoPE, got {self.head_dim}")

  @property
  def gemma_norms(self) -> bool:
    """RMSNorms scale by `1 + weight` (identity at 0), and each layer's attention and MLP
    outputs are normed too, before their residual add (gemma3)."""
    return self.family == "gemma3"

  @property
  def attention_scale(self) -> float:
    """What q . k is multiplied by before the softmax."""
    return (self.head_dim if self.query_pre_attn_scalar is None
            else self.query_pre_attn_scalar) ** -0.5

  @property
  def num_params(self) -> int:
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    norms = 4 if self.gemma_norms else 2
    per_layer = attn + 3 * d * f + norms * d + (2 * h if self.qk_norm else 0)
    head = 0 if self.tie_word_embeddings else self.vocab_size * d
    return self.num_layers * per_layer + self.vocab_size * d + head + d

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of `layer` (None: it sees its whole causal past)."""
    if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
      return None
    return self.sliding_window

  def inv_freq(self, layer: int | None = None) -> np.ndarray:
    """RoPE inverse frequencies `[head_dim // 2]` (float32) of `layer`, scaling applied
    (None: of the full-attention layers)."""
    theta, scaling = self.rope_theta, self.rope_scaling
    if (layer is not None and self.layer_types is not None
        and self.layer_types[layer] == "sliding_attention" and self.sliding_rope_theta is not None):
      theta, scaling = self.sliding_rope_theta, self.sliding_rope_scaling
    return rope_inv_freq(theta, self.head_dim, scaling)


def rope_inv_freq(theta: float, head_dim: int, scaling: RopeScaling) -> np.ndarray:
  """RoPE inverse frequencies `[head_dim // 2]` (float32) with `scaling` applied."""
  exponents = np.arange(0, head_dim, 2, dtype=np.float32) / head_dim
  inv_freq = 1.0 / (theta**exponents)
  if scaling.rope_type == "linear":
    inv_freq = inv_freq / scaling.factor
  elif scaling.rope_type == "llama3":
    inv_freq = _llama3_scaled(inv_freq, scaling)
  return inv_freq.astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
  """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, smooth in between."""
  low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled)
