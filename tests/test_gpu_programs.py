"""The GPU program's floors, read on this CPU from programs compiled for an
H200 target (`mdjax.compile_targets`, jax's CUDA plugin: requirements-compile-targets.txt,
installed by requirements-dev.txt; no skip without it) by `mdjax.hlo_report`:

- `decode_step` of a 1B llama (Llama-3.2-1B's shape, bfloat16, the GPU's default layer
  loop and attention) copies no weights inside a loop at any tokens per pass or batch,
  and waits for the host nowhere; its kernels per layer stay at today's count or fewer
  (5 inside a layer up to 32 rows, 9 past them: tests/test_gpu_kernels.py);
- every registered strategy's whole-generation program, on the 1B shape, waits for the
  host in no step and launches at most 10 kernels per layer pass (the goal: a
  step's kernels over the layers its passes run, the target's, a draft's or a head's).
  The 16-layer counts follow from one program cut to 2 layers (a draft model's to 3),
  whose kernels name their layer (`mdjax.models.layer_loop.layer_scope`): each layer of
  the unrolled stack past the first adds the same kernels and passes (checked on
  greedy's 16 layers). Its kernels but the draft's third layer's also stay at today's
  count or fewer (the pass's own kernels, the choice of tokens and the state's
  bookkeeping: docs/benchmarks/programs.md has the 16-layer counts)."""

import dataclasses
import functools

import pytest

from mdjax import compile_targets, platform, program_report
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.models.layer_loop import default_layer_loop
from mdjax.strategies import registry

TARGET = "h200"
KERNELS_PER_LAYER_TODAY = 9.6  # a regression guard at today's worst row (153 kernels: 9.56)


@pytest.mark.parametrize("batch, tokens", [(1, 1), (1, 2), (8, 1), (32, 16)])
def test_a_1b_decode_step_copies_no_weights_and_waits_for_no_host(batch, tokens):
  config = RANDOM_MODELS["random-llama-1b"]
  with platform.building_for(compile_targets.get(TARGET).platform):
    loop = default_layer_loop()
  counts = program_report.decode_step_counts(TARGET, config, batch=batch, tokens=tokens,
                                             slots=1024, segments=4, layer_loop=loop)
  assert counts.loop_copies < 2**20, counts.loop_copy_shapes  # only bookkeeping: a topology
  #     table of a few ints (a layer's weights are 8-64 MiB, its K/V at 1k slots 2 MiB)
  assert counts.host_syncs == 0
  assert counts.kernels <= KERNELS_PER_LAYER_TODAY * config.num_layers, counts.kernels_by_kind


# kernels per step of the token loop, at random-llama-1b's shape with 2 layers: today's
# counts, a regression guard (a notch lower, each fails; how they came down: git log -p)
STEP_KERNELS_TODAY = {"greedy": 24, "sample": 47, "multi_question": 24, "parallel_sample": 26,
                      "skeleton_fill": 24, "margin_notes": 24, "medusa": 38, "lookahead": 40,
                      "beam": 34, "jacobi": 28, "prompt_lookup": 30, "entropy_branching": 42,
                      "blockwise": 49, "eagle": 124, "self_speculative": 154, "speculative": 108,
                      "speculative_tree": 139, "mixed": 144}  # self_speculative at 5 layers
#                      (drafting with 4), the draft-model strategies with a 2-layer draft
FILTERS = dict(top_p=0.9, min_p=0.05)  # sample: every filter (the report's request: top-k)
LAYERS, DRAFT_LAYERS = 16, program_report.DRAFT_LAYERS  # the report's: the 1B shape's and
#                                                         a 30-layer draft model's
GOAL = 10  # kernels per layer pass, at most
FIRST_LAYERS = {"self_speculative": 5}  # its draft, a quarter of 16 layers, takes fewer than
#                                        the target's; the others from 2 layers


def assert_no_host_sync_per_step(counts: dict):
  assert counts["host_syncs_per_step"] == 0, counts
  assert counts["steps_per_check"] > 1


def test_every_strategy_has_its_floor():
  assert set(STEP_KERNELS_TODAY) == set(registry.STRATEGIES)


@functools.cache  # per test process
def _requests(num_layers: int, draft_layers: int):
  config = dataclasses.replace(RANDOM_MODELS["random-llama-1b"], num_layers=num_layers)
  with platform.building_for(compile_targets.get(TARGET).platform):
    model = program_report.abstract_model(config, f"random-llama-1b, {num_layers} layers")
  return model, program_report.strategy_requests(model, prompt_tokens=64,
                                                 draft_layers=draft_layers)


@functools.cache  # per test process: greedy's program is read twice
def _step_counts(strategy: str, num_layers: int, draft_layers: int = 2) -> dict:
  """`program_report.generation_counts` of `strategy`'s whole-generation program at the
  1B shape cut to `num_layers`, a draft model cut to `draft_layers` (the report's
  request; sample with every filter, self_speculative drafting with 4 layers)."""
  model, requests = _requests(num_layers, draft_layers)
  prompts, options = requests[strategy]
  extra = {"sample": FILTERS, "self_speculative": dict(draft_layers=LAYERS // 4)}
  counts = program_report.generation_counts(TARGET, model, strategy, prompts,
                                            {**options, **extra.get(strategy, {})},
                                            max_new_tokens=64)  # greedy's cache: 128 slots
  assert_no_host_sync_per_step(counts)
  return counts


def _by_layer(counts: dict, index: int) -> tuple[int, int]:
  """(kernels, layer passes) per step under layer `index`'s named scope, every model's."""
  return counts["kernels_by_layer"].get(index, 0), counts["layer_passes_by_layer"].get(index, 0)


def _layer_costs(strategy: str) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
  """(kernels, layer passes) per step of the smallest program (`FIRST_LAYERS`, a 2-layer
  draft model), and what one more target layer and one more draft layer add, read from
  one program by the layers' named scopes: the target's last layer, and a draft model's
  third layer, which the target does not have (the draft given 3 layers). Every layer
  past the first runs the same kernels (the first's norm has no product to add before
  it), so a scope's count is what one more such layer adds."""
  first = FIRST_LAYERS.get(strategy, 2)
  has_draft = "draft" in _requests(first, 2)[1][strategy][1]
  counts = _step_counts(strategy, first, 3 if has_draft else 2)
  draft = _by_layer(counts, 2) if has_draft else (0, 0)
  target = tuple(t - d for t, d in zip(_by_layer(counts, first - 1), draft))  # the draft's
  #                                                  layer of that index runs there too
  whole = (counts["kernels_per_step"], counts["layer_passes_per_step"] or 0)
  return tuple(w - d for w, d in zip(whole, draft)), target, draft


def _extrapolated(strategy: str, num_layers: int, draft_layers: int) -> tuple[int, int]:
  """(kernels, layer passes) per step at `num_layers` layers (a draft model's at
  `draft_layers`): the smallest program's, and each layer more's."""
  first = FIRST_LAYERS.get(strategy, 2)
  smallest, target, draft = _layer_costs(strategy)
  return tuple(smallest[i] + (num_layers - first) * target[i] + (draft_layers - 2) * draft[i]
               for i in (0, 1))


@pytest.mark.parametrize("strategy", sorted(STEP_KERNELS_TODAY))
def test_a_generation_step_launches_at_most_10_kernels_per_layer_pass(strategy):
  """At the 1B shape (module docstring), no host sync in a step (shape-independent), and
  today's kernels or fewer in the smallest program: the sampling filters (top_k and
  top_p as data, per row: a sort each), the attention kernel over cache regions, the output
  buffer's selects. Greedy's extrapolation is checked against its 16-layer program
  (the others' give docs/benchmarks/programs.md's counts exactly: eagle 194 and 20,
  speculative, with a 30-layer draft, 738 and 136)."""
  smallest = _layer_costs(strategy)[0][0]
  assert smallest <= STEP_KERNELS_TODAY[strategy], smallest
  kernels, passes = _extrapolated(strategy, LAYERS, DRAFT_LAYERS)
  assert kernels <= GOAL * passes, (kernels, passes)
  if strategy == "greedy":
    deep = _step_counts(strategy, LAYERS)
    assert (deep["kernels_per_step"], deep["layer_passes_per_step"]) == _extrapolated(
        strategy, LAYERS, 2)
