"""The GPU's few-token attention kernel (`mdjax.models.decode_attention`) over an int8
KV cache (`mdjax.cache.quantize_kv`): run on this CPU in Pallas' interpret mode, it gives
XLA's path (`decode_attention.reference`: `write_layer`, then attention over what
`read_kv` gives back), the attention out and the int8 keys, values and scales it writes,
these bit for bit where the keys and values are the same floats (ties rounded to even);
a pass built for a GPU over an int8 cache gives the CPU's logits and cache; and a 1B
one-token step compiled for an H200 runs one attention kernel a layer, with no
dequantized layer among its temporaries."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import hlo_report, platform, program_report
from mdjax.cache import KVCache, quantize_kv
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.models import decode_attention
from mdjax.models.config import ModelConfig
from mdjax.models.layer_loop import with_layer_loop
from mdjax.models.random_init import init_params
from mdjax.topology import Topology, visibility_limits
from tests.test_gpu_kernels import prefill_and_three_steps

TARGET = "h200"


def _pass(rng, *, batch=2, slots=256, kv_heads=2, group=4, head_dim=64, tokens=3, parts=4,
          window=None):
  """An int8 cache (3 layers) with rows of 100 and 200 tokens of segment 0, and a pass of
  `tokens` tokens after them (the last token of row 1: padding), its q|k|v product in
  `parts`: the kernel's arguments before the layer, `cache` last."""
  shape = (3, batch, slots, kv_heads, head_dim)
  (k, k_scale), (v, v_scale) = (quantize_kv(rng.normal(size=shape)) for _ in "kv")
  qkv = jnp.asarray(rng.normal(size=(parts, batch * tokens, kv_heads * (group + 2), head_dim),
                               scale=parts**-0.5), jnp.float32)  # their sum: ~N(0, 1)
  length = jnp.array([100, 200][:batch], jnp.int32)
  seg = jnp.where(jnp.arange(slots) < length[:, None], 0, -1).astype(jnp.int32)  # [B, S]
  pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
  positions = length[:, None] + jnp.arange(tokens, dtype=jnp.int32)  # [B, T]
  segments = jnp.zeros((batch, tokens), jnp.int32).at[1:, -1].set(-1)
  written = jnp.where(segments >= 0, positions, slots)  # [B, T]: slot of each token
  mask = decode_attention.pass_mask(visibility_limits(Topology.causal(batch)), positions,
                                    segments, written, seg, pos, window=window)
  freqs = np.linspace(0.01, 1.0, head_dim // 2, dtype=np.float32)[None]  # [1, H/2]
  return qkv, positions, freqs, written, length, mask, k, v, k_scale, v_scale


@pytest.mark.parametrize("dtype, batch, tokens, window", [
    (jnp.float32, 1, 1, None), (jnp.bfloat16, 2, 3, None), (jnp.float32, 2, 24, None),
    (jnp.bfloat16, 2, 3, 50)])
def test_the_kernel_over_an_int8_cache_gives_xlas_path(dtype, batch, tokens, window):
  """The model's dtype is the residual rows' (the norm's row scale read by the kernel);
  `window`: a sliding window of 50 positions (rows of 100 and 200 tokens). The int8 keys
  and values are XLA's; in float32, their scales differ by float32's rounding of the keys
  (the parts added and the norm's scale taken in another order: 1e-8)."""
  rng = np.random.default_rng(0)
  qkv, positions, freqs, slot, length, mask, *cache = _pass(rng, batch=batch, tokens=tokens,
                                                             window=window)
  rows = jnp.asarray(rng.normal(size=(*positions.shape, 96)), dtype)
  args = (qkv, rows, positions, freqs, slot, length, 1, mask, *cache)
  static = dict(scale=0.125, eps=1e-6, dtype=dtype)
  got = decode_attention.decode_attention(*args, **static, interpret=True)
  expected = decode_attention.reference(*args, **static)
  assert [x.dtype for x in got] == [dtype, jnp.int8, jnp.int8, jnp.float32, jnp.float32]
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(expected[0], np.float32),
                             atol=1e-5 if dtype == jnp.float32 else 1e-2)
  for a, b in zip(got[1:3], expected[1:3]):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(got[3:], expected[3:]):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  changed = np.asarray(expected[1] != cache[0]).any(axis=(0, 3, 4))  # [B, S]: slots written
  assert changed.sum() == batch * tokens - (batch > 1)
  assert changed[0, 100:100 + tokens].all()


def test_the_kernel_quantizes_what_it_writes_as_quantize_kv_does():
  """Keys and values the kernel and XLA compute alike (one part, no norm, RoPE at angle 0)
  are written bit for bit as `quantize_kv` writes them, halves rounded to even: a key
  of largest magnitude 127 has scale 1, and 2.5, 3.5, -0.5, 1.5 become 2, 4, 0, 2."""
  rng = np.random.default_rng(1)
  qkv, positions, freqs, slot, length, mask, *cache = _pass(rng, parts=1)
  ties = jnp.zeros((64,), jnp.float32).at[:6].set(jnp.array([127, 2.5, 3.5, -0.5, 1.5, -2.5]))
  qkv = qkv.at[0, 0, 2 * 4].set(ties)  # row 0's first token, kv head 0's key
  args = (qkv, None, positions, np.zeros_like(freqs), slot, length, 2, mask, *cache)
  got = decode_attention.decode_attention(*args, scale=0.125, dtype=jnp.float32, interpret=True)
  expected = decode_attention.reference(*args, scale=0.125, dtype=jnp.float32)
  for a, b in zip(got[1:], expected[1:]):
    np.testing.assert_array_equal(a, b)
  k, k_scale = quantize_kv(qkv[0, :, 8:10].reshape(2, 3, 2, 64))  # the keys: [B, T, K(, H)]
  np.testing.assert_array_equal(got[1][2, 0, 100:103], k[0])
  np.testing.assert_array_equal(got[3][2, 1, 200:202], k_scale[1, :2])
  assert got[3][2, 0, 100, 0] == 1.0
  np.testing.assert_array_equal(got[1][2, 0, 100, 0, :7], [127, 2, 4, 0, 2, -2, 0])


# the kernel's smallest head (32); gemma3's layers: q/k norms (its projections come to the
# kernel apart, not as a product's parts), a sliding window and two RoPE tables
CONFIGS = {
    "llama": dataclasses.replace(RANDOM_MODELS["random-llama-tiny"], head_dim=32),
    "gemma3": ModelConfig(family="gemma3", vocab_size=97, hidden_size=64, intermediate_size=96,
                          num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                          sliding_window=5, layer_types=("sliding_attention", "full_attention",
                                                         "sliding_attention"),
                          sliding_rope_theta=100.0, query_pre_attn_scalar=12,
                          max_position_embeddings=256),
}


@pytest.mark.parametrize("model, layer_loop", [("llama", "unrolled"), ("llama", "scan"),
                                               ("gemma3", "unrolled")])
def test_a_pass_over_an_int8_cache_built_for_a_gpu_gives_the_cpus_logits_and_cache(
    model, layer_loop):
  """A prefill (with padding), then three one-token steps (one with a padding row) over an
  int8 cache, built for a GPU (the kernel's path: `reference` runs here) and for the CPU
  (`write_layer`, then attention over `read_kv`)."""
  config = CONFIGS[model]
  params = with_layer_loop(init_params(config, 0, jnp.float32), layer_loop)
  with platform.building_for("gpu"):
    assert decode_attention.applies(config, KVCache.create(config, 2, 64, jnp.int8), 1)
  expected, expected_cache = prefill_and_three_steps(config, params, "cpu", "dense", jnp.int8)
  got, cache = prefill_and_three_steps(config, params, "gpu", "fused", jnp.int8)
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, atol=1e-5)
  for name in ("k_scale", "v_scale"):  # float32's rounding: the keys differ by 1e-7
    np.testing.assert_allclose(getattr(cache, name), getattr(expected_cache, name), rtol=1e-6)
  for name in ("k", "v", "pos", "seg", "length"):
    np.testing.assert_array_equal(getattr(cache, name), getattr(expected_cache, name))


@pytest.mark.parametrize("batch", [1, 8])
def test_a_1b_step_over_an_int8_cache_launches_a_bfloat16_caches_kernels(batch):
  """The 1B shape (2 layers) over 8,192 slots, compiled for an H200: over an int8 cache,
  the kernels a bfloat16 cache launches, the attention kernel in each layer among them,
  and temporaries under a dequantized layer's K (B x 8192 x 8 x 64 bfloat16: B MiB;
  XLA's attention over `read_kv` held 8 B MiB)."""
  config = dataclasses.replace(RANDOM_MODELS["random-llama-1b"], num_layers=2)
  shape = dict(batch=batch, tokens=1, slots=8192, segments=4, layer_loop="unrolled")
  compiled, _ = program_report.compile_decode_step(TARGET, config, kv_dtype=jnp.int8, **shape)
  counts = hlo_report.read(compiled.as_text(), platform="gpu")
  assert counts.attention_kernels == 2, counts.kernels_by_kind
  assert counts.kernels == program_report.decode_step_counts(TARGET, config, **shape).kernels
  assert program_report.memory(compiled)["temp"] < batch * 8192 * 8 * 64 * 2
