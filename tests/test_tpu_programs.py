"""The TPU program's floors, read on this CPU from programs compiled for Colab's TPU (a
v5e-1: `mdjax.compile_targets`, libtpu from requirements-compile-targets.txt, installed
by requirements-dev.txt; no skip without it) by `mdjax.hlo_report` and
`mdjax.hlo_products`, with the compiler's memory analysis:

- a program built for a TPU takes the TPU's paths (the layers scanned, the fused
  attention, `STEPS_PER_CHECK` steps between two checks), not the CPU's (unrolled, a
  block-sparse walk of data-dependent length, a check every step), and waits for no host;
- `decode_step` of a 1B llama (Llama-3.2-1B's shape, bfloat16, 8 rows of 2 tokens: the
  several-row products for which XLA:GPU copies a scanned layer's weights) copies no
  weights, waits for no host, fits a v5e and copies no part of its KV cache (a TPU
  writes a layer's new K/V by selects where the layer lies, `mdjax.cache.write_layer`:
  a scatter made XLA:TPU copy K and V into another layout before the layer loop and
  back after it, twice the cache per pass: docs/benchmarks/programs.md);
- its attention is mdjax's TPU kernel, once per layer, reading the cache where it lies
  and only each row's filled blocks (`mdjax.models.tpu_attention`);
- a float32 step computes every product in float32 (`mdjax.models.numerics`; inside the
  attention kernel too: compiled at the highest precision, which the report cannot see).

Shapes are the smallest that show each property; one 1B compile (~15 s) per run."""

import jax
import jax.numpy as jnp
import pytest

from mdjax import compile_targets, hlo_products, platform, program_report
from mdjax.cache import KVCache
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.generate import STEPS_PER_CHECK
from mdjax.models.random_init import init_params

TARGET = "v5e"
MiB = 2**20


def _bytes(tree) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def one_b():
  """The 1B step's report, its weights' bytes and its cache's K and V bytes."""
  config, batch, slots = RANDOM_MODELS["random-llama-1b"], 8, 1024
  report = program_report.decode_step_report(TARGET, config, batch=batch, tokens=2,
                                             slots=slots, segments=4, layer_loop="scan")
  weights = _bytes(jax.eval_shape(lambda: init_params(config, 0, jnp.bfloat16)))
  with platform.building_for(compile_targets.get(TARGET).platform):  # a CPU's cache: float32
    cache = jax.eval_shape(lambda: KVCache.create(config, batch, slots, jnp.bfloat16))
  return report, weights, _bytes((cache.k, cache.v))


def test_a_1b_step_copies_no_weights_and_waits_for_no_host(one_b):
  report, weights, _ = one_b
  assert report["weight_bytes"] == weights
  config = RANDOM_MODELS["random-llama-1b"]  # untied: of the embedding, the 16 rows gathered
  rows = config.vocab_size * config.hidden_size
  assert report["weight_bytes_read"] == weights - 2 * rows + 2 * rows * 16 // config.vocab_size
  assert report["host_syncs"] == 0
  assert report["weight_copy_bytes"] == 0, report["loop_copy_shapes"]
  assert report["loop_copy_bytes"] == 0  # into device memory: a layer's K/V goes to VMEM


def test_a_1b_step_fits_a_v5e_and_copies_no_cache(one_b):
  report, weights, kv = one_b
  memory = report["memory"]
  assert weights + kv <= memory["argument"] <= weights + kv + MiB  # and a few int tables
  assert memory["alias"] >= kv  # the donated cache is updated in its own buffers
  assert memory["output"] - memory["alias"] <= 4 * MiB  # logits and hidden states
  # 2.1 MiB: the float32 logits (2 MiB), the hidden states, pos and seg, less than one
  # layer's K (8 MiB); with a scatter writing the cache, 2 * kv
  assert report["copy_bytes"] <= 3 * MiB, report["copy_shapes"]
  assert memory["temp"] <= 2 * MiB  # 1.1 MiB; with a scatter, 2 * kv
  assert memory["total"] <= compile_targets.get(TARGET).memory_bytes


def test_a_1b_step_attends_by_one_kernel_per_layer_that_reads_only_filled_slots(one_b):
  """`mdjax.models.tpu_attention`, once per layer (16), fed the cache where it lies: the
  copies the test above bounds are the few MiB of logits and tables, not K or V."""
  report, _, _ = one_b
  assert report["attention_kernels"] == RANDOM_MODELS["random-llama-1b"].num_layers


def test_a_float32_step_computes_every_product_in_float32():
  compiled, _ = program_report.compile_decode_step(
      TARGET, RANDOM_MODELS["random-llama-tiny"], batch=1, tokens=2, slots=128, segments=2,
      layer_loop="scan", dtype=jnp.float32)
  products = hlo_products.float32_products(compiled.as_text(), platform="tpu")
  assert len(products) >= 4 + 1  # a layer's weights, its attention, the unembedding
  assert {p.arithmetic for p in products} == {"float32"}, hlo_products.grouped(products)


def test_greedy_built_for_a_tpu_takes_its_paths_and_waits_for_no_host():
  config = RANDOM_MODELS["random-llama-tiny"]
  with platform.building_for(compile_targets.get(TARGET).platform):
    model = program_report.abstract_model(config, "tiny")
  report = program_report.generation_counts(TARGET, model, "greedy", [list(range(3, 19))], {},
                                            max_new_tokens=16)
  assert report["steps_per_check"] == STEPS_PER_CHECK  # a trip count read from XLA:TPU's loop
  assert report["host_syncs_per_step"] == report["host_syncs_around"] == 0
  trips = [loop["trip_count"] for loop in report["loops"]]
  assert config.num_layers in trips  # the layers scanned
  assert trips.count(None) == 1  # only the check for every row done: no block-sparse walk
