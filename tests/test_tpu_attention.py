"""The TPU's few-token attention kernel (`mdjax.models.tpu_attention`), run on this CPU
by Pallas's interpreter: it gives the masked softmax over every slot of the layer
(`mdjax.models.attention.masked_attention`, what a program built for a TPU computes on
any other platform), and it reads no block past a row's filled slots. Compiled for a
v5e it runs once per layer and copies no part of the cache: tests/test_tpu_programs.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import compile_targets, platform
from mdjax.models import tpu_attention
from mdjax.models.attention import masked_attention
from mdjax.models.layer_loop import with_layer_loop
from mdjax.models.random_init import init_params
from tests.test_gpu_kernels import CONFIGS, prefill_and_three_steps

LAYERS, SLOTS, KV_HEADS, HEAD_DIM, QUERY_HEADS = 3, 384, 2, 64, 8
LENGTHS = [300, 77, 0]  # a row over two blocks and into a third, one in its first, one empty


def case(tokens: int, dtype, seed: int = 0):
  """Random K/V for every slot, queries, and a mask that sees about half of each row's
  filled slots (row 1's first token sees nothing): `(q, k, v, length, mask)`."""
  rng = np.random.default_rng(seed)
  k, v = (jnp.asarray(rng.normal(size=(LAYERS, len(LENGTHS), SLOTS, KV_HEADS, HEAD_DIM)), dtype)
          for _ in range(2))
  q = jnp.asarray(rng.normal(size=(len(LENGTHS), tokens, QUERY_HEADS, HEAD_DIM)), jnp.float32)
  length = np.asarray(LENGTHS, np.int32)
  mask = ((rng.random((len(LENGTHS), tokens, SLOTS)) < 0.5)
          & (np.arange(SLOTS) < length[:, None, None]))
  mask[1, 0] = False
  return q, k, v, jnp.asarray(length), jnp.asarray(mask)


def interpreted(*args, **static):
  """The kernel run by Pallas's interpreter, under jit as a program calls it."""
  return jax.jit(functools.partial(tpu_attention.attention, **static, interpret=True))(*args)


def poisoned(x, length, block: int):
  """`x` [L, B, S, K, H] with NaN in every block past each row's filled ones."""
  filled = -(-length // block) * block  # [B]
  past = jnp.arange(x.shape[2])[None, :] >= filled[:, None]  # [B, S]
  return jnp.where(past[None, :, :, None, None], jnp.nan, x)


@pytest.mark.parametrize("tokens", [1, 5, 11])
@pytest.mark.parametrize("dtype, tolerance", [
    (jnp.float32, 1e-5),  # products at the highest precision
    (jnp.bfloat16, 2e-2)])  # queries and weights rounded to bfloat16 for the products, as
#                            XLA:TPU's default precision rounds them; the reference does not
def test_the_kernel_is_the_masked_softmax_over_the_filled_blocks(tokens, dtype, tolerance):
  q, k, v, length, mask = case(tokens, dtype)
  block = tpu_attention.block_size(SLOTS)
  got = interpreted(q, mask, length, 1, poisoned(k, length, block), poisoned(v, length, block),
                    scale=0.125)
  want = masked_attention(q, k[1], v[1], mask, scale=0.125)
  assert got.shape == want.shape == q.shape
  np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance)
  assert not np.asarray(got[1, 0]).any() and not np.asarray(got[2]).any()  # sees nothing: 0


def test_under_vmap_each_cache_its_own_attention():
  """MTP heads run their passes as one `jax.vmap` over the heads: the kernel of each."""
  cases = [case(2, jnp.float32, seed=seed) for seed in (2, 3)]
  q, k, v, length, mask = (jnp.stack(parts) for parts in zip(*cases))
  attend = functools.partial(tpu_attention.attention, scale=0.125, interpret=True)
  got = jax.jit(jax.vmap(lambda *args: attend(*args[:3], 0, *args[3:])))(q, mask, length, k, v)
  for i, (qi, ki, vi, _, mi) in enumerate(cases):
    np.testing.assert_allclose(got[i], masked_attention(qi, ki[0], vi[0], mi, scale=0.125),
                               atol=1e-5, rtol=1e-5)


def test_soft_capped_scores():
  q, k, v, length, mask = case(2, jnp.float32, seed=1)
  got = interpreted(q * 4, mask, length, 2, k, v, scale=0.125, softcap=3.0)
  want = masked_attention(q * 4, k[2], v[2], mask, scale=0.125, softcap=3.0)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [0, 1, 127, 128, 129, 511, 512, 1024])
def test_a_row_reads_its_filled_blocks_and_no_other(length):
  """The blocks a row's steps ask for: each filled block once, in order, then its last
  filled block again (the same block index: the pipeline fetches nothing)."""
  block, steps = 128, 8
  asked = [int(tpu_attention.last_block(jnp.int32(length), jnp.int32(j), block))
           for j in range(steps)]
  fetched = [b for i, b in enumerate(asked) if i == 0 or b != asked[i - 1]]
  assert fetched == list(range(max(1, -(-length // block))))


@pytest.mark.parametrize("slots, block", [(64, 64), (384, 128), (768, 256), (1024, 512),
                                          (200, None)])
def test_the_block_is_the_largest_that_tiles_the_cache(slots, block):
  assert tpu_attention.block_size(slots) == block


@pytest.mark.parametrize("tokens, dtype, kv_heads, head_dim, softcap", [
    (1, jnp.bfloat16, 8, 64, None),  # a 1B llama's decoded token
    (32, jnp.float32, 8, 64, None),  # the most tokens, float32 at the highest precision
    (3, jnp.bfloat16, 1, 256, 50.0)])  # Gemma 3 270M's one KV head of 256, a soft cap
def test_the_kernel_compiles_for_a_v5e(tokens, dtype, kv_heads, head_dim, softcap):
  """Mosaic lowers the kernel at the shapes a program gives it (one pallas call, nothing
  it does not accept), over a 16-layer cache of 8 rows of 4,096 slots."""
  q = jax.ShapeDtypeStruct((8, tokens, 4 * kv_heads, head_dim), jnp.float32)
  kv = jax.ShapeDtypeStruct((16, 8, 4096, kv_heads, head_dim), dtype)
  args = (q, jax.ShapeDtypeStruct((8, tokens, 4096), jnp.bool_),
          jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32), kv, kv)
  attend = jax.jit(functools.partial(tpu_attention.attention, scale=0.125, softcap=softcap))
  text = compile_targets.compile_for(attend, "v5e", *args).as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == 1
  assert tpu_attention.KERNEL_NAME in text


@pytest.mark.parametrize("model", list(CONFIGS))
def test_a_pass_built_for_a_tpu_gives_the_cpus_logits_and_cache(model, monkeypatch):
  """A prefill (with padding), then three one-token steps (one with a padding row), built
  for a TPU (the scanned layers, the selects that write the cache, the kernel's path
  for a cache of any size: the masked softmax it equals runs here) and for the CPU;
  gemma3 with its sliding windows."""
  config = CONFIGS[model]
  params = with_layer_loop(init_params(config, 0, jnp.float32), "scan")
  monkeypatch.setattr(tpu_attention, "MIN_CACHE_BYTES", 0)
  with platform.building_for("tpu"):
    assert tpu_attention.applies(1, 64, 0, jnp.float32)
    assert not tpu_attention.applies(1, 64, 0, jnp.int8)
  expected, expected_cache = prefill_and_three_steps(config, params, "cpu", "dense")
  got, cache = prefill_and_three_steps(config, params, "tpu", "fused")
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, atol=1e-5)
  for name in ("k", "v", "pos", "seg", "length"):
    np.testing.assert_array_equal(getattr(cache, name), getattr(expected_cache, name))
