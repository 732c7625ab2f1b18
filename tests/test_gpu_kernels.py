"""A few-token pass on a GPU (`mdjax.models.decode_attention`,
`mdjax.models.decode_products`): the Pallas kernels give what their references give
(run on this CPU in Pallas' interpret mode) and compile for an H200; a whole pass built
for a GPU (the references standing in for the kernels) gives the CPU's logits and cache;
and the 1B `decode_step` compiled for an H200 target (`mdjax.compile_targets`) launches,
for one token at batch 1 and 8, at most `KERNELS_IN_A_LAYER` kernels in each layer and
`KERNELS_PER_LAYER` per layer all told, the pass's own included (the goal: 10;
docs/benchmarks/programs.md)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import compile_targets, hlo_report, platform, program_report
from mdjax.cache import KVCache
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.models import decode_attention, decode_products, numerics
from mdjax.models.config import ModelConfig
from mdjax.models.layer_loop import default_layer_loop, with_layer_loop
from mdjax.models.model import Model
from mdjax.models.random_init import init_params
from mdjax.step import decode_step
from mdjax.topology import Topology, visibility_limits

TARGET = "h200"
KERNELS_IN_A_LAYER = {1: 5, 8: 5}  # by batch; before `mdjax.models.decode_products`: 9
KERNELS_PER_LAYER = {1: 5.6, 8: 5.5}  # today: 5.56 and 5.5 (5 in each layer, 9 and 8 per
#                                       pass: the embedding's gather, the slot claim, the
#                                       mask, the last layer's residual add, the final
#                                       norm and the head); before: 9.56 and 9.5
OWN_KERNELS = {1: 3, 8: 5}  # mdjax's per layer: the attention and the two normed products,
#                             and at batch 8 two residual products (`takes_parts`: no parts)


def _pass(rng, dtype, *, batch=2, slots=256, kv_heads=2, group=4, head_dim=64, tokens=3,
          parts=4):
  """A cache with rows of 100 and 200 tokens of segment 0, and a pass of `tokens`
  tokens after them (the last token of row 1: padding), its q|k|v product in `parts`:
  the kernel's arguments before the layer."""
  shape = (3, batch, slots, kv_heads, head_dim)
  cache_k, cache_v = (jnp.asarray(rng.normal(size=shape), dtype) for _ in "kv")
  qkv = jnp.asarray(rng.normal(size=(parts, batch * tokens, kv_heads * (group + 2), head_dim),
                               scale=parts**-0.5), jnp.float32)  # their sum: ~N(0, 1)
  length = jnp.array([100, 200], jnp.int32)
  seg = jnp.where(jnp.arange(slots) < length[:, None], 0, -1).astype(jnp.int32)  # [B, S]
  pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
  positions = length[:, None] + jnp.arange(tokens, dtype=jnp.int32)  # [B, T]
  segments = jnp.zeros((batch, tokens), jnp.int32).at[1, -1].set(-1)
  written = jnp.where(segments >= 0, positions, slots)  # [B, T]: slot of each token
  mask = decode_attention.pass_mask(visibility_limits(Topology.causal(batch)), positions,
                                    segments, written, seg, pos, window=None)
  freqs = np.linspace(0.01, 1.0, head_dim // 2, dtype=np.float32)[None]  # [1, H/2]
  return qkv, positions, freqs, written, length, mask, cache_k, cache_v


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("norm", [False, True])
def test_the_kernel_gives_its_reference(dtype, tolerance, norm):
  """Attention out and the cache with the new keys and values written; with `norm`, the
  projections scaled by the norm of residual rows the kernel reads itself."""
  rng = np.random.default_rng(0)
  qkv, positions, freqs, slot, length, mask, cache_k, cache_v = _pass(rng, dtype)
  rows = jnp.asarray(rng.normal(size=(*positions.shape, 96)), dtype) if norm else None
  args = (qkv, rows, positions, freqs, slot, length, 1, mask, cache_k, cache_v)
  got = decode_attention.decode_attention(*args, scale=0.125, eps=1e-6, interpret=True)
  expected = decode_attention.reference(*args, scale=0.125, eps=1e-6)
  for a, b in zip(got, expected):  # bfloat16: the kernel weighs the values in bfloat16,
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=tolerance)  # the reference in float32
  changed = np.asarray(expected[1] != cache_k).any(axis=(0, 3, 4))  # [B, S]: slots written
  assert changed.sum() == 5 and changed[0, 100:103].all() and changed[1, 200:202].all()


def test_the_kernel_gives_its_reference_past_16_tokens():
  """24 tokens (lookahead's pass; a tree of 16 nodes and its root: 17), past a tile of 16."""
  rng = np.random.default_rng(0)
  qkv, positions, freqs, slot, length, mask, cache_k, cache_v = _pass(rng, jnp.float32, tokens=24)
  rows = jnp.asarray(rng.normal(size=(*positions.shape, 96)), jnp.float32)
  args = (qkv, rows, positions, freqs, slot, length, 1, mask, cache_k, cache_v)
  got = decode_attention.decode_attention(*args, scale=0.125, eps=1e-6, interpret=True)
  expected = decode_attention.reference(*args, scale=0.125, eps=1e-6)
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert (np.asarray(expected[1] != cache_k).any(axis=(0, 3, 4)).sum()) == 2 * 24 - 1


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1 / 64)])
@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 3), (4, 8)])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("with_parts", [False, True], ids=["no_parts", "parts"])
def test_the_normed_product_kernel_gives_its_reference(dtype, tolerance, batch, tokens, gated,
                                                       with_parts):
  """The new residual stream (with a product's parts added: a one-row product's come as
  two rows, the second ignored) and the product of its norm, in tiles narrower than the
  kernel's widest (96 wide in blocks of 32; 80 out in tiles of 16: 5 programs).
  bfloat16's gated activations agree to a rounding or two (relatively 1/64: the kernel
  rounds its own float32 sums, then the activation)."""
  rng = np.random.default_rng(0)
  width, out_width = 96, 80
  parts = jnp.asarray(rng.normal(size=(2, max(2, batch * tokens), width)), jnp.float32)
  residual = jnp.asarray(rng.normal(size=(batch, tokens, width)), dtype)
  norm = jnp.asarray(rng.normal(size=(width,)), dtype)
  weight = jnp.asarray(rng.normal(size=(width, out_width * (2 if gated else 1)),
                                  scale=width**-0.5), dtype)
  args = (parts if with_parts else None, residual, norm, weight)
  got = decode_products.normed_product(*args, eps=1e-6, gated=gated, interpret=True)
  expected = decode_products.reference(*args, eps=1e-6, gated=gated)
  assert got[1].shape == expected[1].shape == (batch, tokens, out_width)
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(expected[0], np.float32))
  assert np.abs(np.asarray(expected[1], np.float32)).max() > 1
  np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(expected[1], np.float32),
                             rtol=tolerance if gated else 1e-5, atol=1e-5 if gated else 1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 3), (4, 8)])
def test_the_residual_product_kernel_gives_its_reference(dtype, batch, tokens):
  """x + a @ w in tiles of 16 of 80 columns (5 programs), walking 96 inputs in blocks of
  32: bfloat16 exactly (the product rounded, then added, as `linear` and the CPU do),
  float32 up to the summation's order."""
  rng = np.random.default_rng(1)
  width, out_width = 96, 80
  residual = jnp.asarray(rng.normal(size=(batch, tokens, out_width)), dtype)
  a = jnp.asarray(rng.normal(size=(batch, tokens, width)), dtype)
  weight = jnp.asarray(rng.normal(size=(width, out_width), scale=width**-0.5), dtype)
  got = decode_products.residual_product(residual, a, weight, interpret=True)
  expected = decode_products.residual_reference(residual, a, weight)
  assert got.shape == expected.shape == residual.shape and got.dtype == dtype
  assert decode_products.residual_block(width, batch * tokens, a.dtype.itemsize, 2) == 32
  assert not np.allclose(np.asarray(expected, np.float32), np.asarray(residual, np.float32))
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                             rtol=0, atol=0 if dtype == jnp.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype, rows", [(jnp.bfloat16, 3), (jnp.float32, 32)])
def test_the_residual_product_kernel_compiles_for_an_h200(dtype, rows):
  """A 1B llama's down product, at the fewest rows that take it (3) and at the most rows
  in float32, within the H200's shared memory, one kernel with nothing around it."""
  args = (jax.ShapeDtypeStruct((1, rows, 2048), dtype),
          jax.ShapeDtypeStruct((1, rows, 8192), dtype), jax.ShapeDtypeStruct((8192, 2048), dtype))
  with platform.building_for("gpu"):
    text = compile_targets.compile_for(jax.jit(decode_products.residual_product), TARGET,
                                       *args).as_text()
  assert decode_products.RESIDUAL_NAME in text
  assert hlo_report.read(text).kernels == 1


def test_the_normed_product_kernel_takes_few_rows_in_whole_tiles():
  assert decode_products.fits(1, 2048, 16384, 2, 2, True)
  assert decode_products.fits(32, 576, 960, 2, 0, False)
  assert not decode_products.fits(33, 2048, 8192, 2, 0, True)
  assert not decode_products.fits(1, 2040, 8192, 2, 0, True)
  assert decode_products.kernel_parts(1, 8192, False, 2) == 4  # a 1B llama's down parts
  assert decode_products.kernel_parts(17, 2048, True, 2) == 0  # a residual product first
  assert decode_products.residual_fits(32, 8192, 2048)
  assert not decode_products.residual_fits(33, 8192, 2048)
  assert not decode_products.residual_fits(4, 8192, 2040)


def test_the_normed_products_can_be_switched_off(monkeypatch):
  params = init_params(CONFIGS["llama"], 0, jnp.bfloat16)
  with platform.building_for("gpu"):
    assert decode_products.applies(CONFIGS["llama"], params, 4)
    monkeypatch.setenv(decode_products.OFF_SWITCH, "0")
    assert not decode_products.applies(CONFIGS["llama"], params, 4)
  assert decode_products.takes_parts(1, 4, False, 2) and decode_products.takes_parts(4, 4, True, 2)
  assert not decode_products.takes_parts(2, 8, False, 2)
  assert not decode_products.takes_parts(8, 4, True, 2)


@pytest.mark.parametrize("rows, width", [(1, 2048), (1, 8192), (17, 2048), (17, 8192),
                                         (32, 8192), (1, 576), (17, 1536)])
def test_products_come_in_as_many_parts_as_xla_splits_them_into(rows, width):
  """`part_count` parts (`linear_parts`): one Triton product compiled for an H200, not
  split in K again with a kernel to add the splits."""
  count = decode_products.part_count(width, rows)
  x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((width, 2048), jnp.bfloat16)
  split = jax.jit(numerics.linear_parts, static_argnums=2)
  with platform.building_for("gpu"):
    text = compile_targets.compile_for(split, TARGET, x, w, count).as_text()
  assert hlo_report.read(text).kernels == 1


@pytest.mark.parametrize("dtype, rows, num_parts, gated", [
    (jnp.bfloat16, 1, 2, True), (jnp.bfloat16, 32, 8, False), (jnp.float32, 32, 8, True)])
def test_the_normed_product_kernel_compiles_for_an_h200(dtype, rows, num_parts, gated):
  """Within the H200's shared memory (a Triton compile error otherwise), at one row and at
  the most rows and parts, the widest weights in float32."""
  width, out_width = 2048, 16384 if gated else 3072
  args = (jax.ShapeDtypeStruct((num_parts, max(rows, 2), width), jnp.float32),
          jax.ShapeDtypeStruct((1, rows, width), dtype), jax.ShapeDtypeStruct((width,), dtype),
          jax.ShapeDtypeStruct((width, out_width), dtype))
  product = jax.jit(functools.partial(decode_products.normed_product, eps=1e-6, gated=gated))
  with platform.building_for("gpu"):
    text = compile_targets.compile_for(product, TARGET, *args).as_text()
  assert decode_products.KERNEL_NAME in text


class _Gpu:
  def __init__(self, capability: str):
    self.compute_capability = capability


@pytest.mark.parametrize("capability, kib", [("9.0", 227), ("8.0", 163), ("7.5", 64),
                                             ("11.7", 99)])
def test_the_normed_product_kernel_loads_what_the_gpus_shared_memory_holds(monkeypatch,
                                                                           capability, kib):
  """Four steps' loads (what Triton asks for) within the GPU's shared memory less 16 KiB:
  a T4's 64 KiB takes no 32 rows; an unlisted GPU, 99 KiB."""
  monkeypatch.setattr(decode_products.jax, "devices", lambda kind=None: [_Gpu(capability)])
  decode_products.stage_bytes.cache_clear()
  try:
    assert decode_products.stage_bytes() == (kib - 16) * 1024 // 4
    block = decode_products.block_columns(2048, 16, 4, True, 2)  # a 1B llama's gate|up
    per_column = 16 * (4 * 4 + 2) + 2 * 2 * 64  # bytes: 16 rows of 4 parts and x, 2 tiles
    assert 4 * block * per_column <= (kib - 16) * 1024 < 8 * block * per_column or block == 128
    assert decode_products.fits(32, 2048, 16384, 2, 8, True) == (kib >= 163)
    assert decode_products.fits(1, 2048, 16384, 2, 2, True)
  finally:
    decode_products.stage_bytes.cache_clear()


def test_the_kernel_takes_caches_in_blocks_of_a_power_of_two():
  assert decode_attention.fits(1, 128, 64) and decode_attention.fits(16, 1152, 64)
  assert not decode_attention.fits(1, 96, 64)  # one block of 96: Triton cannot lower it
  assert not decode_attention.fits(33, 128, 64) and not decode_attention.fits(1, 128, 48)


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


def prefill_and_three_steps(config: ModelConfig, params, target: str, attention: str,
                            cache_dtype=jnp.float32):
  """Built for `target` with `attention`: a prefill of two rows (one padded) into a cache of
  `cache_dtype`, then three one-token steps (the second with a padding row): the four
  steps' logits and the cache after them."""
  with platform.building_for(target):
    cache = KVCache.create(config, 2, 64, cache_dtype)
    tokens = jnp.array([[5, 6, 7, 8, 9, 10, 0, 0], list(range(11, 19))], jnp.int32)
    segments = jnp.array([[0] * 6 + [-1] * 2, [0] * 8], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    logits, _, cache = decode_step(params, cache, tokens, positions, segments,
                                   Topology.causal(2), config=config, attention=attention)
    out = [logits]
    for i in range(3):
      logits, _, cache = decode_step(
          params, cache, jnp.array([[20 + i], [30 + i]], jnp.int32),
          jnp.array([[6 + i], [8 + i]], jnp.int32), jnp.array([[0], [-(i == 1)]], jnp.int32),
          Topology.causal(2), config=config, attention=attention)
      out.append(logits)
    return out, cache


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
@pytest.mark.parametrize("model", list(CONFIGS))
def test_a_pass_built_for_a_gpu_gives_the_cpus_logits_and_cache(model, layer_loop):
  """A prefill (with padding) then three one-token steps (one with a padding row),
  built for a GPU (kernel path, the reference run here) and for the CPU."""
  config = CONFIGS[model]
  params = with_layer_loop(init_params(config, 0, jnp.float32), layer_loop)
  expected, expected_cache = prefill_and_three_steps(config, params, "cpu", "dense")
  got, cache = prefill_and_three_steps(config, params, "gpu", "fused")
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, atol=1e-5)
  # gemma3's keys, |k| up to 3.7 after its k norm, differ by up to 3e-6: float32 rounding
  # (the GPU scales the product's float32 sum by the attention norm's row scale)
  atol = 1e-6 if model == "llama" else 1e-5
  np.testing.assert_allclose(cache.k, expected_cache.k, atol=atol)
  np.testing.assert_allclose(cache.v, expected_cache.v, atol=atol)
  for name in ("pos", "seg", "length"):
    np.testing.assert_array_equal(getattr(cache, name), getattr(expected_cache, name))


def test_the_residual_streams_an_eagle3_target_keeps_are_the_cpus():
  """`aux_layers` (layer 1 twice, then 0) on the normed-product kernels' path: the
  residual stream after a layer is its down product's parts added, as the CPU adds it."""
  config = CONFIGS["llama"]
  params = with_layer_loop(init_params(config, 0, jnp.float32), "unrolled")

  def run(target: str, attention: str):
    with platform.building_for(target):
      cache = KVCache.create(config, 2, 64, jnp.float32)
      tokens = jnp.array([[5, 6, 7], [8, 9, 10]], jnp.int32)
      positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
      return decode_step(params, cache, tokens, positions, jnp.zeros((2, 3), jnp.int32),
                         Topology.causal(2), config=config, attention=attention,
                         aux_layers=(1, 1, 0))

  expected, got = run("cpu", "dense"), run("gpu", "fused")
  assert got[3].shape == (2, 3, 3, config.hidden_size)
  for index in (0, 1, 3):  # logits, hidden, aux
    np.testing.assert_allclose(got[index], expected[index], atol=1e-5)


@pytest.mark.parametrize("strategy, options", [
    ("multi_question", dict(questions=[[20, 21], [22], [23, 24, 25]])),
    ("parallel_sample", dict(num_samples=3, temperature=0.9, top_k=20, top_p=0.8))])
def test_branches_in_cache_regions_built_for_a_gpu_give_the_cpus_tokens(strategy, options):
  """Branches in cache regions (`mdjax.cache.CacheRegions`): built for a GPU, each pass
  runs the attention kernel over every filled slot under the mask (the reference run
  here), top-k and top-p by the GPU's sort; on the CPU, the cascade and the bisection."""
  config = CONFIGS["llama"]

  def run(target: str):
    with platform.building_for(target):
      params = with_layer_loop(init_params(config, 0, jnp.float32), default_layer_loop())
      out = mdjax.generate(Model(config=config, params=params), [list(range(5, 17))], strategy,
                           max_new_tokens=12, eos_token_id=[], **options)
    return out.sequences

  assert run("gpu") == run("cpu")


@functools.cache
def _one_token_step(batch: int, num_layers: int = 16):
  config = dataclasses.replace(RANDOM_MODELS["random-llama-1b"], num_layers=num_layers)
  with platform.building_for(compile_targets.get(TARGET).platform):
    loop = default_layer_loop()
  return program_report.decode_step_counts(TARGET, config, batch=batch, tokens=1, slots=1024,
                                           segments=4, layer_loop=loop)


@pytest.mark.parametrize("batch", [1, 8])
def test_a_1b_one_token_step_launches_few_kernels_per_layer(batch):
  counts = _one_token_step(batch)
  assert counts.kernels <= KERNELS_PER_LAYER[batch] * 16, counts.kernels_by_kind
  assert counts.kernels_by_kind["custom-call"] == OWN_KERNELS[batch] * 16
  assert counts.loop_copies == 0, counts.loop_copy_shapes


@pytest.mark.parametrize("batch", [1, 8])
def test_a_layer_of_a_one_token_step_launches_few_kernels(batch):
  """A layer's kernels: those of the 16-layer 1B shape less a 2-layer one's, per layer
  (XLA fuses the first and last layers with what is around them a little differently)."""
  in_a_layer = (_one_token_step(batch).kernels - _one_token_step(batch, 2).kernels) / 14
  assert in_a_layer <= KERNELS_IN_A_LAYER[batch]
