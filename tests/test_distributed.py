"""mdjax under JAX's multi-controller runtime: two processes of 4 CPU devices each
(gloo collectives, a free localhost port), one 2x4 global mesh, the same script on
both (`tests/multidevice/process_checks.py`), against one process without a mesh.

    process 0 ─┐ every registered strategy, stream, forward_logits on the 2x4 mesh;
    process 1 ─┘ prompts that differ; a checkpoint loaded onto a 1x8 mesh, each
                 process recording what it reads; then 1 is killed in the middle of
                 a generate
    reference    the same calls on one device (greedy and the lossy strategies)

The three run at once, started by one module fixture; a process that cannot start
fails every test here (never a skip).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mdjax
from mdjax.checkpoints import hf
from tests import helpers
from tests.multidevice.process_checks import HEARTBEAT_S

ROLES = ("0", "1", "reference")
TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """role -> {"json": what it wrote, "rc", "ended": time.time() or None, "log": its output}."""
  out = tmp_path_factory.mktemp("processes")
  # 8 query heads and 48 MLP rows split over 8 devices; 250 vocabulary rows padded to 256
  hf.save_hf(helpers.random_model(heads=8, kv_heads=2, vocab_size=250), out / "checkpoint")
  return helpers.run_processes("tests.multidevice.process_checks", ROLES, out, TIMEOUT_S)


def test_both_processes_and_the_reference_ran_every_check(runs):
  for role, run in runs.items():
    assert "forward_logits" in run["json"], f"{role} did not get through:\n{run['log'][-5000:]}"
  assert runs["0"]["json"]["devices"] == runs["1"]["json"]["devices"] == 8  # one global mesh
  assert runs["reference"]["rc"] == 0, runs["reference"]["log"][-5000:]


def test_every_strategy_on_two_processes_gives_the_tokens_of_one_process(runs):
  """Both processes get the whole result, equal to one process without a mesh: a lossy
  strategy's own (same seed), a lossless one's greedy."""
  reference = runs["reference"]["json"]["strategies"]
  first, second = (runs[r]["json"]["strategies"] for r in ("0", "1"))
  assert first == second
  for name, sequences in first.items():
    expected = reference["greedy" if name in helpers.LOSSLESS else name]
    assert sequences == expected and sum(map(len, sequences)) > 0, name


def test_stream_and_forward_logits_on_two_processes(runs):
  reference = runs["reference"]["json"]
  for role in ("0", "1"):
    got = runs[role]["json"]
    assert got["stream"] == reference["stream"] == reference["strategies"]["greedy"]
    np.testing.assert_allclose(got["forward_logits"], reference["forward_logits"], atol=1e-5,
                               rtol=0)


def test_prompts_that_differ_between_processes_are_a_clear_error(runs):
  for role in ("0", "1"):
    message = runs[role]["json"]["prompts_differ"]
    assert "differ between processes" in message and "process 0" in message, message
    assert "process 1" in message, message


def test_a_mesh_that_misses_another_process_devices_is_a_clear_error(runs):
  message = runs["0"]["json"]["local_mesh"]
  assert "the mesh has 4 devices but the 2 processes have 8" in message, message


def test_each_process_reads_only_the_slices_its_devices_hold(runs):
  """A 1x8 mesh puts half of each sharded weight on each process's 4 devices: each
  reads the q_proj rows of its own 4 shards, and about half the model (the norms,
  replicated, whole), each block once; the params equal a one-device load's bytes."""
  rows = {}
  for role in ("0", "1"):
    reads = runs[role]["json"]["local_reads"]
    rows[role] = [tuple(r) for r in reads["q_rows_read"]]
    assert rows[role] == [tuple(r) for r in reads["q_rows_held"]] and len(rows[role]) == 4
    assert reads["read_twice"] == 0 and 0.45 < reads["share_read"] < 0.55, reads
    assert reads["same_bytes"]
  assert sorted(rows["0"] + rows["1"]) == [(8 * i, 8 * (i + 1)) for i in range(8)]


def test_a_killed_process_stops_the_other_with_a_clear_error_in_bounded_time(runs):
  """Process 1 dies (SIGKILL) inside a generate; process 0, waiting in a collective,
  is terminated by JAX's coordination service once the heartbeats stop."""
  first, second = runs["0"], runs["1"]
  assert "generating_since" in first["json"], first["log"][-5000:]
  assert first["ended"] is not None, "process 0 still ran when the test gave up on it"
  assert second["rc"] == -9 and first["rc"] != 0, first["log"][-5000:]
  assert "another task died" in first["log"], first["log"][-5000:]
  assert first["ended"] - second["ended"] < 3 * HEARTBEAT_S + 30


def test_the_decode_cli_on_two_processes_prints_and_writes_on_process_0_only(tmp_path):
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
  port = helpers.free_port()
  runs = [subprocess.Popen(
      [sys.executable, "-m", "experiments.decode", "--config=configs/greedy.py",
       "--config.chat=False", "--config.prompt=", "--config.prompt_ids=3,4,5",
       "--config.model=random-llama-tiny", "--config.max_new_tokens=6", "--config.mesh=2,4",
       f"--config.distributed=localhost:{port},2,{i}", f"--output_json={tmp_path / f'{i}.json'}"],
      cwd=helpers.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  (out0, err0), (out1, err1) = (run.communicate(timeout=300) for run in runs)
  assert [run.returncode for run in runs] == [0, 0], err0[-3000:] + err1[-3000:]
  assert out0.strip().splitlines()[-1] == f"--- summary (JSON): {tmp_path / '0.json'}"
  summary = json.loads((tmp_path / "0.json").read_text())
  one_process = mdjax.generate(mdjax.load("random-llama-tiny"), [[3, 4, 5]], max_new_tokens=6)
  assert summary["sequences"] == one_process.sequences
  assert out1 == "" and not (tmp_path / "1.json").exists()
