"""mdjax.hlo_report reads what a compiled program launches: checked on programs this CPU
compiles (loops of known and unknown trip count, copies inside a loop) and on hand-made
HLO texts with GPU- and TPU-shaped instructions; mdjax.hlo_products names the precision
of every float32 product, on programs compiled for a GPU and a TPU target; mdjax.platform
makes mdjax's choices follow the platform a program is built for."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from mdjax import compile_targets, hlo_products, hlo_report, platform, program_report
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.errors import MdjaxError
from mdjax.models.attention import default_attention
from mdjax.models.config import default_weight_dtype
from mdjax.models.layer_loop import default_layer_loop


def _counts(fn, *args):
  return hlo_report.read(jax.jit(fn).lower(*args).compile().as_text())


def test_a_loop_of_known_trip_count_multiplies_its_body_and_asks_the_host_nothing():
  x = jnp.ones((4, 8))

  def loop(x, n):
    return jax.lax.fori_loop(0, n, lambda i, x: jnp.tanh(x * 2.0 + i), x)

  known, unknown = _counts(lambda x: loop(x, 7), x), _counts(loop, x, 7)
  assert known.host_syncs == 0 and [trip for trip, _ in known.loops] == [7]
  assert unknown.host_syncs == 1 and [trip for trip, _ in unknown.loops] == [None]
  text = jax.jit(loop).lower(x, 7).compile().as_text()
  assert hlo_report.read(text, platform="tpu").host_syncs == 0  # a TPU runs its own loops
  per_trip = known.loops[0][1]
  assert per_trip >= 1 and known.kernels >= 7 * per_trip


GPU_LOOP = """HloModule m

%slice_computation (p0: f32[16,64,64], p1: s32[]) -> f32[1,64,64] {
  %p0 = f32[16,64,64]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[1,64,64]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,64,64}
}

%compare_computation (p0: s32[], p1: s32[]) -> pred[] {
  %p0 = s32[] parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %lt = pred[] compare(%p0, %p1), direction=LT
}

%body (t: (s32[], f32[16,64,64], f32[2,64])) -> (s32[], f32[16,64,64], f32[2,64]) {
  %t = (s32[], f32[16,64,64]{2,1,0}, f32[2,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = f32[16,64,64]{2,1,0} get-tuple-element(%t), index=1
  %h = f32[2,64]{1,0} get-tuple-element(%t), index=2
  %slice = f32[1,64,64]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%slice_computation
  %one = s32[] constant(1)
  %next_i = s32[] add(%i, %one)
  %gemm = (f32[2,64]{1,0}, s8[0]{0}) custom-call(%h, %slice), custom_call_target="__cublas$gemm"
  %out = f32[2,64]{1,0} get-tuple-element(%gemm), index=0
  ROOT %next = (s32[], f32[16,64,64]{2,1,0}, f32[2,64]{1,0}) tuple(%next_i, %w, %out)
}

%cond (t: (s32[], f32[16,64,64], f32[2,64])) -> pred[] {
  %t = (s32[], f32[16,64,64]{2,1,0}, f32[2,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(16)
  ROOT %lt = pred[] fusion(%i, %n), kind=kLoop, calls=%compare_computation
}

ENTRY %main (w: f32[16,64,64], h: f32[2,64]) -> f32[2,64] {
  %w = f32[16,64,64]{2,1,0} parameter(0)
  %h = f32[2,64]{1,0} parameter(1)
  %z = s32[] constant(0)
  %t = (s32[], f32[16,64,64]{2,1,0}, f32[2,64]{1,0}) tuple(%z, %w, %h)
  %loop = (s32[], f32[16,64,64]{2,1,0}, f32[2,64]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"16"}}
  %gemm_result = f32[2,64]{1,0} get-tuple-element(%loop), index=2
  %top = (f32[2,4]{1,0}, s32[2,4]{1,0}) custom-call(%gemm_result), custom_call_target="__gpu$TopK"
  ROOT %r = f32[2,64]{1,0} get-tuple-element(%loop), index=2
}
"""


def test_a_dynamic_slice_materialised_inside_a_loop_counts_as_copied_bytes():
  counts = hlo_report.read(GPU_LOOP)
  assert counts.loops == [(16, 3)]  # the slice, the step and the product, 16 times
  assert counts.kernels == 16 * 3 + 17 * 1 + 1  # the condition, 17 times; the top-k
  assert counts.loop_copies == 16 * 64 * 64 * 4  # one layer's weights per trip
  products = hlo_products.float32_products(GPU_LOOP)
  assert [(p.name, p.operands, p.precision, p.arithmetic) for p in products] == [
      ("gemm", ("f32", "f32"), "default", "tf32")]  # cuBLAS' default for float32: TF32;
  #   the top-k reading its result is no product


def test_a_tpu_loop_without_a_trip_count_is_counted_from_its_condition_start_and_step():
  """XLA:TPU writes no `known_trip_count`; a slice into VMEM (`S(1)`) is on chip."""
  text = GPU_LOOP.replace(', backend_config={"known_trip_count":{"n":"16"}}', "")
  text = text.replace("%slice = f32[1,64,64]{2,1,0}", "%slice = f32[1,64,64]{2,1,0:S(1)}")
  text = text.replace("fusion(%i, %n), kind=kLoop, calls=%compare_computation",
                      "compare(%i, %n), direction=LT")  # XLA:TPU fuses no scalar compare
  counts = hlo_report.read(text, platform="tpu")
  assert counts.loops == [(16, 3)] and counts.host_syncs == 0
  assert counts.kernels == 16 * 3 + 17 * 1 + 1
  assert (counts.loop_copies, counts.loop_copies_on_chip) == (0, 16 * 64 * 64 * 4)
  unknown = hlo_report.read(text.replace("constant(16)", "parameter(1)"), platform="gpu")
  assert unknown.loops == [(None, 3)] and unknown.host_syncs == 1


@pytest.mark.parametrize("target, rounded", [("h200", "tf32"), ("v5e", "bf16")])
def test_the_report_names_each_float32_product_its_target_rounds(target, rounded):
  """Compiled for a GPU or TPU target (`mdjax.compile_targets`): a float32 product at
  the default precision loses precision there (TF32, one bfloat16 pass), one at the
  highest does not, and a product of bfloat16 operands into float32 is exact."""
  x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
  w = jax.ShapeDtypeStruct((128, 256), jnp.float32)

  def products(x, w):
    return (x @ w, jnp.matmul(x, w, precision="highest"),
            jax.lax.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                        preferred_element_type=jnp.float32))

  text = compile_targets.compile_for(jax.jit(products), target, x, w).as_text()
  found = hlo_products.float32_products(text, platform=compile_targets.get(target).platform)
  assert sorted((p.precision, p.arithmetic, p.loses_precision) for p in found) == sorted([
      ("default", "exact", False), ("default", rounded, True), ("highest", "float32", False)])


def test_mdjax_choices_follow_the_platform_a_program_is_built_for():
  host = (default_attention(), default_layer_loop(), default_weight_dtype())
  with platform.building_for("gpu"):
    assert (default_attention(), default_layer_loop(), default_weight_dtype()) == (
        "fused", "unrolled", "bfloat16")
  with platform.building_for("tpu"):
    assert default_layer_loop() == "scan"
  assert (default_attention(), default_layer_loop(), default_weight_dtype()) == host
  with pytest.raises(MdjaxError, match="'cuda'"):
    with platform.building_for("cuda"):
      pass


def test_a_gpu_pass_of_few_tokens_counts_one_attention_kernel_per_layer():
  """The report's layer passes (`Counts.attention_kernels`): the name the compiled GPU
  program gives mdjax's decode attention is the one it looks for."""
  config = dataclasses.replace(RANDOM_MODELS["random-llama-1b"], num_layers=3)
  counts = program_report.decode_step_counts("h200", config, batch=1, tokens=2, slots=256,
                                             segments=1, layer_loop="unrolled")
  assert counts.attention_kernels == 3
