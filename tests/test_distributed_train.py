"""Both trainers under JAX's multi-controller runtime: two processes of 4 CPU devices
each (gloo, a free localhost port) on one 2x4 mesh against one process of 8 devices on
the same mesh shape (`tests/multidevice/train_process_checks.py`).

    pair (processes 0, 1)   train_lm, train_heads -> OUT/pair/{lm,heads}    ┐ at once;
    reference (1 process)   train_lm, train_heads -> OUT/one/{lm,heads}     ┘ then each
    resumes the other's runs, interrupted after step 2 -> OUT/<group>/{lm,heads}_resumed

The losses and the exported weights of two processes are one process's; a checkpoint
written by two processes resumes on one, and one written by one resumes on two, to the
same weights. One module fixture starts the three; a process that cannot start fails
every test here (never a skip).
"""

import json
import pathlib

import jax
import numpy as np
import pytest

import mdjax
from mdjax.models.layer_loop import unstack_layers
from tests import helpers
from tests.multidevice.train_process_checks import KEPT, STEPS

ROLES = ("0", "1", "reference")
TIMEOUT_S = 420
# An open bug: about one launch in ten hung once the LM run had finished its steps (seen
# once in ten runs while this was written; suspected: orbax's save barrier, a collective
# over all devices under gloo). A launch in which a process hangs (killed at the timeout,
# its stacks in its log) is started once more; a second hang, a crash or any wrong result
# still fails.
HANG_RETRIES = 1
RUNS = ("lm", "heads", "lm_resumed", "heads_resumed")


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> pathlib.Path:
  """OUT, after the three processes ran (with OUT/<role>.json, .log and the runs)."""
  for attempt in range(HANG_RETRIES + 1):
    out = tmp_path_factory.mktemp("train_processes")
    helpers.write_cycle_prompts(out / "prompts.jsonl", 24)
    found = helpers.run_processes("tests.multidevice.train_process_checks", ROLES, out,
                                  TIMEOUT_S)
    hung = [role for role, run in found.items() if run["ended"] is None]
    if not hung or attempt == HANG_RETRIES:
      break
    print(f"train processes {hung} hung (attempt {attempt + 1}); their stacks: {out}")
  for role, run in found.items():
    assert run["rc"] == 0 and set(RUNS) <= set(run["json"]), (
        f"{role} did not get through:\n{run['log'][-5000:]}")
  return out


def summaries(out: pathlib.Path, role: str) -> dict:
  return json.loads((out / f"{role}.json").read_text())


def losses(run_dir: pathlib.Path) -> dict[int, float]:
  """step -> train loss; each record written once (by process 0 alone)."""
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in records if "loss" in r]
  assert len(steps) == len(set(steps)), steps
  return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_close_losses(got: dict, want: dict, steps):
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


def lm_weights(run_dir: pathlib.Path) -> dict:
  return unstack_layers(mdjax.load(str(run_dir / "export")).params)


def heads_weights(run_dir: pathlib.Path) -> dict:
  return mdjax.load_heads(str(run_dir / "export")).params


def assert_close_weights(got, want):
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-5, rtol=0), got, want)


def test_the_processes_joined_one_runtime_and_got_the_same_summaries(out):
  first, second, reference = (summaries(out, role) for role in ROLES)
  assert (first["processes"], first["devices"]) == (2, 8) and reference["processes"] == 1
  assert first["agreed"] and second["agreed"]  # process 0's decision (e.g. a time budget's)
  own = {"command": "", "train_minutes": 0}  # each process's command line and clock
  for name in RUNS:  # every process gets the whole summary
    assert first[name] | own == second[name] | own, name
  assert first["lm"]["heldout_loss"] == pytest.approx(reference["lm"]["heldout_loss"], rel=1e-5)
  assert first["heads"]["heldout_top1"] == pytest.approx(reference["heads"]["heldout_top1"],
                                                         abs=1e-6)


def test_the_lm_trainer_on_two_processes_gives_one_process_losses_and_weights(out):
  pair, one = out / "pair" / "lm", out / "one" / "lm"
  assert (pair / "tokenizer" / "tokenizer.json").read_bytes() == (
      one / "tokenizer" / "tokenizer.json").read_bytes()  # trained by process 0, read by 1
  assert_close_losses(losses(pair), losses(one), range(1, STEPS + 1))
  assert_close_weights(lm_weights(pair), lm_weights(one))


def test_the_heads_trainer_on_two_processes_gives_one_process_losses_and_weights(out):
  pair, one = out / "pair" / "heads", out / "one" / "heads"
  assert_close_losses(losses(pair), losses(one), range(1, STEPS + 1))
  assert_close_weights(heads_weights(pair), heads_weights(one))


@pytest.mark.parametrize("name, weights", [("lm", lm_weights), ("heads", heads_weights)])
@pytest.mark.parametrize("written_by, resumed_by", [("pair", "one"), ("one", "pair")])
def test_a_checkpoint_resumes_on_another_process_count_to_the_same_weights(
    out, name, weights, written_by, resumed_by):
  written, resumed = out / written_by / name, out / resumed_by / f"{name}_resumed"
  assert_close_losses(losses(resumed), losses(written), range(KEPT + 1, STEPS + 1))
  assert_close_weights(weights(resumed), weights(written))
