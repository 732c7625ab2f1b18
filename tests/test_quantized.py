"""Quantized weights (`mdjax.models.quantized`), GGUF's blocks as they are
(`mdjax.checkpoints.gguf_native`) and the int8 KV cache (`mdjax.cache`):

- a product with a quantized weight is the product with its value, on the CPU's integer
  path and on the GPU/TPU path (the conversion in the operand), for both layouts;
- int8 and int4 models give the logits of their dequantized float twins, in either
  layer loop;
- every lossless strategy on quantized weights and an int8 cache gives greedy's tokens
  on the same model and cache; a branch in a shared int8 cache is the branch alone;
- the int8 cache's slot moves carry the scales; its bytes are what `generate` reports;
- the real GGUF files read as blocks give the float32-dequantized model's logits to
  1e-3, with no float matrix in the params;
- bad input is one line naming the option."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import cache as cache_ops
from mdjax import platform
from mdjax.cache import KVCache
from mdjax.checkpoints.hf import save_hf
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.errors import CheckpointError, MdjaxError
from mdjax.models.model import Model
from mdjax.models.random_init import init_params
from mdjax.models import quantized, transformer
from mdjax.models.quantized import QuantizedWeight
from tests.helpers import (LOSSLESS, every_strategy, random_medusa_heads, run_strategy,
                           strategy_heads)
from tests.test_draft_vocab import cut

TINY = "random-llama-tiny"  # hidden 64, intermediate 128, 2 layers, vocab 256
TOKENS = jnp.asarray([[1, 5, 9, 3, 7, 2, 40, 41], [8, 8, 9, 100, 7, 2, 3, 4]])


def dequantized(params):
  return jax.tree.map(lambda w: quantized.dequantize(w) if quantized.is_quantized(w) else w,
                      params, is_leaf=quantized.is_quantized)


def relative_error(a, b) -> float:
  return float(jnp.abs(a - b).max() / jnp.abs(b).max())


# `transformer.causal_logits` as one program per params structure (eager, each operation
# of a tiny model's forward would be a program of its own)
causal_logits = jax.jit(transformer.causal_logits, static_argnames="config")
lm_head = jax.jit(transformer.lm_head, static_argnames="config")


def real_logits(model, tokens):
  """`transformer.causal_logits` of a real model: its layers eager (each distinct operation
  one program, shared by the layers of its shapes and types; one program would compile
  every layer), its head one program (eager, a 262,144-row tied embedding would be
  dequantized or transposed whole, operation by operation)."""
  hidden = transformer.forward_causal(model.params, tokens, config=model.config)
  return lm_head(model.params, hidden, config=model.config)


def test_int4_groups_start_on_each_groups_range_and_fit_it_by_least_squares():
  """`quantize(..., offsets=True)`: the first grid spans each group's own range, its
  smallest and largest weight on levels -8 and 7 and every weight within half a step of
  its value (and of the rounding of the scale and offset to bfloat16 as they are held,
  2^-9 of each). Each least-squares fit after it lowers the squared error (up to that
  rounding), in every group, symmetric or not: with `GROUP_REFITS` fits, by 9-18% on
  these weights. A weight already on a Q4_1 grid (a step and a minimum per group of 32,
  all 16 levels used: what SmolLM2's file holds) whose step and offset bfloat16 holds
  comes back exactly. Symmetric groups do not find that grid."""
  w = jax.random.normal(jax.random.key(0), (64, 96)) + 0.5  # not centred on 0
  first = quantized.quantize(w, 4, 16, offsets=True, refits=0)
  assert first.scale.dtype == first.offset.dtype == jnp.bfloat16
  q = np.asarray(first.q).reshape(4, 16, 96)
  assert (q.min(1) == -8).all() and (q.max(1) == 7).all()
  step, offset = (np.repeat(np.asarray(a, np.float32), 16, axis=0)
                  for a in (first.scale, first.offset))
  held = 2.0 ** -9 * (np.abs(offset) + 8 * step)
  assert (np.abs(np.asarray(quantized.dequantize(first) - w)) <= step / 2 + held + 1e-6).all()

  def group_errors(weight):  # [4, 96]: each group's squared error
    return np.asarray((quantized.dequantize(weight) - w) ** 2).reshape(4, 16, 96).sum(1)

  for offsets, gain in ((True, 0.85), (False, 0.95)):
    errors = [group_errors(quantized.quantize(w, 4, 16, offsets=offsets, refits=k))
              for k in range(quantized.GROUP_REFITS + 1)]
    assert all((later <= earlier * 1.001).all() for earlier, later in zip(errors, errors[1:]))
    assert errors[-1].sum() < gain * errors[0].sum() and errors[-1].sum() > 0.7 * errors[0].sum()
  levels = np.random.default_rng(0).integers(0, 16, (2, 32, 96))
  levels[:, 0], levels[:, 1] = 0, 15
  rng = np.random.default_rng(1)
  step, offset = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)
                  for a in (rng.uniform(0.01, 0.1, (2, 1, 96)), rng.uniform(-1, 0, (2, 1, 96))))
  grid = jnp.asarray(((levels - 8) * step + offset).reshape(64, 96), jnp.float32)
  again = quantized.dequantize(quantized.quantize(grid, 4, 32, offsets=True))
  assert relative_error(again, grid) < 1e-6
  assert relative_error(quantized.dequantize(quantized.quantize(grid, 4, 32)), grid) > 1e-2


@pytest.mark.parametrize("bits, group, offsets", [(8, None, False), (4, 16, False),
                                                  (4, 16, True)])
def test_a_quantized_products_parts_add_up_to_the_product_with_its_value(bits, group, offsets):
  """`numerics.linear_parts`, the products whose parts a GPU's attention kernel adds: a
  quantized weight's parts, each scaled and offset group by group, add up to the
  product with its value (a weight with offsets comes in parts too: `splits`)."""
  w = jax.random.normal(jax.random.key(0), (64, 96))
  weight = quantized.quantize(w, bits, group, offsets=offsets)
  assert quantized.splits(weight, 4)
  x = jax.random.normal(jax.random.key(1), (3, 64))
  with platform.building_for("gpu"):
    parts = jax.jit(mdjax.models.numerics.linear_parts, static_argnums=2)(x, weight, 4)
  assert parts.shape == (4, 3, 96)
  assert relative_error(parts.sum(0), x @ quantized.dequantize(weight)) < 1e-6


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("bits, group, axis, offset", [(8, None, -2, False), (8, None, -1, False),
                                                       (4, 16, -2, False), (4, 16, -1, True),
                                                       (4, 32, -2, True)])
def test_a_quantized_product_is_the_product_with_its_value(path, bits, group, axis, offset):
  """`linear` with a quantized weight: the CPU's int8-activation path to 1e-4 of the
  largest output (two int8 terms per row and group), the fused path (traced as for a GPU)
  to float32 rounding. axis -1 is the tied head: `[V, D]` contracted on D in place."""
  w = jax.random.normal(jax.random.key(0), (64, 96))
  w = w if axis == -2 else w.T
  weight = quantized.quantize(w, bits, group, axis=axis, offsets=offset)  # offsets: as
  #                                                                 GGUF's Q4_1 / Q4_K
  value = quantized.dequantize(weight)
  x = jax.random.normal(jax.random.key(1), (3, 5, 64)) * jnp.linspace(0.1, 4, 64)  # [3, 5, D]
  expected = x @ (value if axis == -2 else value.T)
  with platform.building_for(path):
    got = jax.jit(lambda x, w: mdjax.models.numerics.linear(x, w))(x, weight)
  assert got.shape == expected.shape
  assert relative_error(got, expected) < (1e-4 if path == "cpu" else 1e-6)


@pytest.mark.parametrize("scheme, group, loop", [("int8", None, "unrolled"), ("int4", 16, "scan")])
def test_a_quantized_model_gives_its_dequantized_twins_logits(scheme, group, loop):
  model = mdjax.load(TINY, quantize=scheme, quantize_group=group, layer_loop=loop)
  assert model.quantization.startswith(scheme)
  layers = model.params["layers"]
  some = layers["wqkv"] if loop == "scan" else layers[0]["wqkv"]
  assert isinstance(some, QuantizedWeight) and isinstance(model.params["embed"], QuantizedWeight)
  assert some.bits == (8 if scheme == "int8" else 4) and some.group == (group or 64)
  logits = causal_logits(model.params, TOKENS, config=model.config)
  twin = causal_logits(dequantized(model.params), TOKENS, config=model.config)
  assert relative_error(logits, twin) < 5e-4
  floats = causal_logits(mdjax.load(TINY).params, TOKENS, config=model.config)
  assert relative_error(twin, floats) > 1e-3  # the quantization itself does change them


@pytest.fixture(scope="module")
def strategy_requests():
  draft = mdjax.load(TINY, seed=1)
  return every_strategy(draft, strategy_heads(mdjax.load(TINY)))


SCHEMES = {"int8": (None, "unrolled"), "int4": (16, "scan")}


@pytest.fixture(scope="module")
def quantized_models():
  return {scheme: mdjax.load(TINY, quantize=scheme, quantize_group=group, layer_loop=loop)
          for scheme, (group, loop) in SCHEMES.items()}


@pytest.mark.parametrize("strategy", sorted(LOSSLESS))
def test_lossless_strategies_on_quantized_weights_and_an_int8_cache_are_greedy(
    quantized_models, strategy_requests, strategy):
  """Each lossless strategy (rollbacks, compaction, trees, heads reading the quantized
  embedding) on one of the two schemes (alternating), with an int8 cache, gives greedy's
  tokens on the same model and cache."""
  scheme = sorted(SCHEMES)[sorted(LOSSLESS).index(strategy) % 2]
  model = quantized_models[scheme]
  prompts, options = strategy_requests[strategy]
  greedy = run_strategy(model, "greedy", (prompts, dict(kv_cache_dtype="int8")), 16)
  ours = run_strategy(model, strategy, (prompts, dict(options, kv_cache_dtype="int8")), 16)
  assert ours.sequences == greedy.sequences


@pytest.mark.parametrize("bits, group, offset", [(8, None, False), (4, 16, True)])
def test_a_quantized_matrixs_columns_are_its_values_columns(bits, group, offset):
  """`take_columns`, what heads with a draft vocabulary gather from an untied head."""
  weight = quantized.quantize(jax.random.normal(jax.random.key(0), (32, 40)), bits, group,
                              offsets=offset)
  ids = jnp.asarray([0, 7, 39, 12])
  np.testing.assert_array_equal(quantized.take_columns(weight, ids),
                                quantized.dequantize(weight)[:, ids])


def test_heads_reading_a_quantized_models_draft_columns_are_greedy(quantized_models):
  """Medusa heads with a draft vocabulary, sharing the model's unembedding: the strategy
  gathers its draft columns from the quantized tied embedding (as floats), and decodes
  greedy's tokens."""
  model = quantized_models["int8"]
  heads = cut(random_medusa_heads(mdjax.load(TINY), seed=2), np.arange(0, 256, 3))
  prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11]]
  greedy = mdjax.generate(model, prompts, max_new_tokens=16, eos_token_id=[])
  out = mdjax.generate(model, prompts, strategy="medusa", heads=heads, max_new_tokens=16,
                       eos_token_id=[])
  assert out.sequences == greedy.sequences


def test_branches_in_a_shared_int8_cache_are_each_branch_alone(quantized_models):
  """multi_question's answers (branches in one int8 cache) equal greedy on the context
  and each question alone, in an int8 cache: the scales are per slot and head."""
  model = quantized_models["int8"]
  context, questions = [3, 4, 5, 6, 7, 8], [[20, 21], [22], [23, 24, 25]]
  out = mdjax.generate(model, [context], strategy="multi_question", questions=questions,
                       max_new_tokens=10, eos_token_id=[], kv_cache_dtype="int8")
  for question, answer in zip(questions, out.sequences):
    alone = mdjax.generate(model, [context + question], max_new_tokens=10, eos_token_id=[],
                           kv_cache_dtype="int8")
    assert answer == alone.sequences[0]


def test_an_int8_cache_moves_its_scales_with_its_slots():
  """Written K/V read back within a step of their own scale; `compact`, `move_slots` and
  `gather_slots` (rollback, accepted paths, beam's reorder) move the scales too."""
  config = mdjax.load(TINY).config
  cache = KVCache.create(config, 1, 8, "int8")
  assert cache.k.dtype == jnp.int8 and cache.k_scale.shape == cache.k.shape[:-1]
  k = jax.random.normal(jax.random.key(2), (1, 6, config.num_kv_heads, config.head_dim))
  k = k * jnp.arange(1, 7)[None, :, None, None]  # slots of different magnitudes
  cache, slot = cache_ops.claim_slots(cache, jnp.arange(6)[None], jnp.zeros((1, 6), jnp.int32))
  for layer in range(config.num_layers):
    cache = cache_ops.write_layer(cache, layer, slot, k, 2 * k)
  keys, values = cache_ops.read_kv(cache, 0, lambda x, i: x[i, 0, :6])  # [6, K, H]
  step = jnp.abs(k[0]).max(-1, keepdims=True) / 127
  assert bool((jnp.abs(keys - k[0]) <= step / 2 + 1e-6).all())
  np.testing.assert_allclose(values, 2 * keys, rtol=1e-6)
  cache = cache_ops.kill_segments(cache.replace(seg=cache.seg.at[0, 1].set(1)),
                                  jnp.asarray([[False, True]]))
  compacted = cache_ops.compact(cache, jnp.zeros(1, jnp.int32), 8)  # slot 1 dropped
  np.testing.assert_array_equal(cache_ops.read_kv(compacted, 0, lambda x, i: x[i, 0, 1:5])[0],
                                keys[2:6])
  moved = cache_ops.gather_slots(cache, jnp.zeros(1, jnp.int32), jnp.asarray([[5, 4]]), 2)
  np.testing.assert_array_equal(cache_ops.read_kv(moved, 1, lambda x, i: x[i, 0, :2])[1],
                                values[jnp.asarray([5, 4])])


def test_generate_reports_an_int8_caches_bytes():
  model = mdjax.load(TINY)
  c = model.config
  outs = {dtype: mdjax.generate(model, [[5, 6, 7]], max_new_tokens=4, kv_cache_dtype=dtype)
          for dtype in ("float32", "int8")}
  floats, ints = (outs[d].stats["kv_cache_bytes"] for d in ("float32", "int8"))
  assert ints / floats == (c.head_dim + 4) / (4 * c.head_dim)


@pytest.mark.real_models
@pytest.mark.parametrize("name, kinds", [("smollm2-135m-instruct", {"Q4_1", "Q8_0"}),
                                         ("gemma3-270m", {"Q4_K", "Q5_0", "Q6_K", "Q8_0"})])
def test_gguf_blocks_as_they_are_give_the_dequantized_models_logits(name, kinds, tmp_path):
  """quantize="gguf": every matrix a `QuantizedWeight` read from the file's blocks (the
  types the file holds), logits within 1e-3 (relative to each position's largest) of
  the float32 model the file dequantizes to, the same argmax. SmolLM2's, loaded again
  onto a mesh from the header its first load cached, holds the same blocks and
  tokenizes as the float model (tests/multidevice/mesh_checks.py splits quantized
  weights over 8 devices and runs them)."""
  def native(**options):  # SmolLM2's file lies in its package: its header cached afresh
    with pytest.MonkeyPatch.context() as patch:
      if name == "smollm2-135m-instruct":
        patch.setenv("MDJAX_CACHE", str(tmp_path))
      return mdjax.load(name, quantize="gguf", **options)

  model = native()
  assert all(kind in model.quantization for kind in kinds), model.quantization
  matrices = [w for lp in model.params["layers"] for n, w in lp.items() if n.startswith("w")]
  assert all(isinstance(w, QuantizedWeight) for w in matrices + [model.params["embed"]])
  floats = mdjax.load(name, dtype="float32")
  tokens = jnp.asarray([floats.tokenizer.encode("The capital of France is Paris, and the")])
  logits = real_logits(model, tokens)
  expected = real_logits(floats, tokens)
  error = jnp.abs(logits - expected).max(-1) / jnp.abs(expected).max(-1)
  assert float(error.max()) < 1e-3
  np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))
  if kinds == {"Q4_1", "Q8_0"}:  # loaded onto a mesh (of this one device): the same blocks,
    with pytest.MonkeyPatch.context() as patch:  # and the header cached by the first load
      patch.setattr(gguf, "GGUFReader", None)  # (mdjax/checkpoints/gguf_header.py): no parse
      on_mesh = native(mesh=jax.make_mesh((1, 1), ("data", "tensor")))
    assert on_mesh.layout is not None and on_mesh.quantization == model.quantization
    assert on_mesh.config == model.config
    jax.tree.map(np.testing.assert_array_equal, on_mesh.params, model.params)
    text, chat = "café 日本語 🤖 <|im_start|>", [{"role": "user", "content": "Hi"}]
    for tokenizer in (on_mesh.tokenizer, model.tokenizer):
      assert tokenizer(text)["input_ids"] == floats.tokenizer(text)["input_ids"]
      assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == (
          floats.tokenizer.apply_chat_template(chat, add_generation_prompt=True))


def test_bad_quantization_options_are_one_line_naming_them():
  cases = [(dict(quantize="int3"), "quantize='int3'"),
           (dict(quantize="int8", quantize_group=32), "quantize_group=32"),
           (dict(quantize="int4", quantize_group=48), "group=48 does not divide"),
           (dict(quantize="gguf"), "quantize='gguf'")]
  for options, phrase in cases:
    with pytest.raises((MdjaxError, CheckpointError)) as error:
      mdjax.load(TINY, **options)
    assert phrase in str(error.value) and "\n" not in str(error.value)
  model = mdjax.load(TINY, quantize="int8")
  with pytest.raises(MdjaxError, match="quantized already"):
    quantized.quantize_params(model.params, "int4")
  with pytest.raises(MdjaxError, match="unknown kv_cache_dtype 'int4'; valid: float32"):
    mdjax.generate(model, [[5, 6]], max_new_tokens=2, kv_cache_dtype="int4")


def test_a_quantized_model_saved_and_loaded_gives_the_same_logits(tmp_path):
  """`save_hf` of a quantized model (mdjax's own tensors: `quantized_layout`) and orbax's
  save of its params pytree both load back to bit-identical logits; quantizing the loaded
  model again is refused by name."""
  import orbax.checkpoint as ocp
  model = mdjax.load(TINY, quantize="int4", quantize_group=16)
  expected = causal_logits(model.params, TOKENS, config=model.config)
  save_hf(model, tmp_path / "hf")
  loaded = mdjax.load(str(tmp_path / "hf"))
  assert loaded.quantization == "int4, groups of 16 with offsets; embedding and head int8"
  np.testing.assert_array_equal(
      causal_logits(loaded.params, TOKENS, config=loaded.config), expected)
  with pytest.raises(MdjaxError, match="quantized already"):
    mdjax.load(str(tmp_path / "hf"), quantize="int8")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "params", model.params)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "params", jax.eval_shape(lambda: model.params))
  assert isinstance(restored["embed"], QuantizedWeight)
  np.testing.assert_array_equal(
      causal_logits(restored, TOKENS, config=model.config), expected)


def test_a_checkpoint_is_quantized_layer_by_layer_as_it_is_read(tmp_path, monkeypatch):
  """`quantize=` on a checkpoint gives the params of quantizing its float model after the
  load, bit for bit, and the float model is never held whole: when a layer's weights are
  quantized, no float matrix quantized before them is still alive."""
  import gc
  import weakref
  from mdjax.checkpoints import hf
  save_hf(mdjax.load(TINY), tmp_path / "hf")
  floats = mdjax.load(str(tmp_path / "hf"))
  quantized_before, calls = [], []

  def watched(weights, scheme, group):
    gc.collect()
    calls.append(sorted(weights))
    alive = [ref() for ref in quantized_before if ref() is not None]
    assert not alive, f"{len(alive)} float matrices of earlier layers still held"
    out = quantized.quantize_weights(weights, scheme, group)
    quantized_before.extend(weakref.ref(w) for name, w in weights.items()
                            if name in quantized.MATRICES or name == "embed")
    return out

  monkeypatch.setattr(hf, "quantize_weights", watched)
  for scheme, group in (("int8", None), ("int4", 16)):
    calls.clear()
    model = mdjax.load(str(tmp_path / "hf"), quantize=scheme, quantize_group=group)
    assert len(calls) == model.config.num_layers + 1  # each layer, then the embedding's dict
    assert model.quantization == quantized.scheme_label(scheme, group)
    expected = quantized.quantize_params(floats.params, scheme, group)
    jax.tree.map(np.testing.assert_array_equal, model.params, expected)


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 16)])
def test_a_program_built_for_a_gpu_gives_the_dequantized_twins_tokens(scheme, group):
  """Built as a GPU builds it (head_dim 32: the GPU's attention kernel runs; the
  conversion in the operand; int8's q|k|v product in parts the kernel adds, scaled per
  column), run on this CPU: greedy gives the tokens of the float model holding the
  dequantized weights, and so does the CPU's own integer path."""
  config = dataclasses.replace(RANDOM_MODELS[TINY], head_dim=32)
  params = quantized.quantize_params(init_params(config, 0), scheme, group)
  model = Model(config=config, params=params, name="tiny-32", quantization=scheme)
  twin = Model(config=config, params=dequantized(params), name="tiny-32")
  run = lambda m: mdjax.generate(m, [[5, 6, 7, 8, 9]], max_new_tokens=12, eos_token_id=[],
                                 attention="fused").sequences  # noqa: E731
  expected = run(twin)
  with platform.building_for("gpu"):
    assert run(model) == expected
  assert run(model) == expected
