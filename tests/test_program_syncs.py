"""The whole-generation program has no host sync per step where one costs (a GPU): its
token loop runs `STEPS_PER_CHECK` steps in a loop of known trip count between two reads
of "every row done", and a choice of pass width is no data-dependent loop. Compiled on
this CPU as a GPU would build it (`mdjax.platform.building_for`), read with
`mdjax.hlo_report`; and the tokens are those of the CPU's program, a row finishing
between two checks included."""

import numpy as np
import pytest

import mdjax
from mdjax import hlo_report, platform
from mdjax.generate import STEP_LOOP, STEPS_PER_CHECK, program, steps_per_check
from tests import helpers

PROMPTS = [list(range(3, 19)), [9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def model():
  return mdjax.load("random-llama-tiny")


def _step_loop(model, strategy, **options) -> tuple[hlo_report.Loop, hlo_report.Counts]:
  fn, args = program(model, PROMPTS, strategy, 12, eos_token_id=[], **options)
  text = fn.trace(*args).lower().compile().as_text()
  return hlo_report.find_loop(text, STEP_LOOP), hlo_report.read(text)


def test_the_cpu_checks_every_step():
  assert steps_per_check() == 1
  with platform.building_for("gpu"):
    assert steps_per_check() == STEPS_PER_CHECK > 1


SELF_SPECULATIVE = dict(draft_layers=1, num_draft_tokens=4, confidence_threshold=0.3)  # chains
#                   that stop early: a loop ending when no row drafts on would ask the host


@pytest.mark.parametrize("strategy, options", [("greedy", {}),
                                               ("multi_question", dict(questions=[[20], [21, 22]])),
                                               ("self_speculative", SELF_SPECULATIVE)])
def test_off_the_cpu_the_steps_run_in_a_loop_of_known_trip_count(model, strategy, options):
  with platform.building_for("gpu"):
    loop, whole = _step_loop(model, strategy, **options)
  assert loop.trip_count == STEPS_PER_CHECK
  assert loop.iteration.host_syncs == 0  # no while of unknown trip count, no conditional
  assert whole.host_syncs == 1  # the check every STEPS_PER_CHECK steps


def test_on_the_cpu_the_token_loop_is_checked_every_step(model):
  loop, _ = _step_loop(model, "greedy")
  assert loop.trip_count is None


@pytest.mark.parametrize("strategy, options", [
    ("greedy", {}), ("multi_question", dict(questions=[[20], [21, 22], [23]])),
    ("prompt_lookup", dict(prompt_lookup_num_tokens=3, max_ngram_size=2)),
    ("self_speculative", SELF_SPECULATIVE)])
def test_rows_finishing_between_checks_give_the_cpu_programs_tokens(model, strategy, options):
  prompts = PROMPTS[:1] if strategy == "multi_question" else PROMPTS
  # 11 new tokens: not a multiple of STEPS_PER_CHECK; an EOS from the first row's output
  # ends it after at most 5
  cpu = mdjax.generate(model, prompts, strategy, max_new_tokens=11, eos_token_id=[],
                       attention="fused", **options)
  eos = cpu.sequences[0][4]
  cpu = mdjax.generate(model, prompts, strategy, max_new_tokens=11, eos_token_id=eos,
                       attention="fused", **options)
  with platform.building_for("gpu"):
    gpu = mdjax.generate(model, prompts, strategy, max_new_tokens=11, eos_token_id=eos,
                         attention="fused", **options)
  assert gpu.sequences == cpu.sequences
  assert len(cpu.sequences[0]) <= 5
  np.testing.assert_array_equal(gpu.stats["target_passes"], cpu.stats["target_passes"])


@pytest.fixture(scope="module")
def requests(model):
  draft = helpers.random_model("llama", 5, vocab_size=model.config.vocab_size, layers=1,
                               std=0.05)
  return helpers.every_strategy(draft, helpers.strategy_heads(model))


@pytest.mark.parametrize("strategy", list(helpers.every_strategy(None, {h: None for h in
                                                                       ("medusa", "mtp",
                                                                        "eagle")})))
def test_every_strategy_built_for_a_gpu_gives_the_cpu_programs_output(model, requests, strategy):
  """Off the CPU a step may run after every row is done (it is selected away) and a
  pass runs at its widest: every registered strategy, its rows ending at an EOS between
  two checks, gives the CPU program's sequences and pass count (sampling ones too: the
  same keys are drawn in the same steps)."""
  prompts, options = requests[strategy]
  prompts = prompts or (helpers.STRATEGY_PROMPTS[:1] if strategy == "multi_question"
                        else helpers.STRATEGY_PROMPTS)
  run = lambda eos: mdjax.generate(model, prompts, strategy, max_new_tokens=11,
                                   eos_token_id=eos, seed=3, attention="fused", **options)
  eos = run([]).sequences[0][3]
  cpu = run(eos)
  with platform.building_for("gpu"):
    gpu = run(eos)
  assert gpu.sequences == cpu.sequences
  np.testing.assert_array_equal(gpu.stats["target_passes"], cpu.stats["target_passes"])
