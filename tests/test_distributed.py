"""mdjax under JAX's multi-controller runtime: two processes of 4 CPU devices each
(gloo collectives, a free localhost port), one 2x4 global mesh, the same script on
both (`tests/multidevice/process_checks.py`), against one process without a mesh.

    process 0 ─┐ every registered strategy, stream, forward_logits on the 2x4 mesh;
    process 1 ─┘ prompts that differ; a checkpoint loaded onto a 1x8 mesh, each
                 process recording what it reads; then 1 is killed in the middle of
                 a generate
    reference    the same calls on one device (greedy and the lossy strategies), in
                 this process while the two run

One module fixture starts the pair, computes the reference, and runs the decode CLI on
two processes of its own while process 0 waits for the runtime to notice that process 1
died; a process that cannot start fails every test here (never a skip).
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import mdjax
from mdjax.checkpoints import hf
from mdjax.strategies import STRATEGIES
from tests import helpers
from tests.multidevice import process_checks
from tests.multidevice.process_checks import HEARTBEAT_S

PAIR = ("0", "1")
TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """role -> {"json": what it wrote, "rc", "ended": time.time() or None, "log": its output}
  for the pair; "reference" -> {"json": `process_checks.one_process()`}; "cli" -> the
  decode CLI's two processes' {"dir": OUT/cli, "runs": `decode_cli`}, run while process 0
  waits for the runtime to notice that process 1 died (the CPU is idle then)."""
  out = tmp_path_factory.mktemp("processes")
  # 8 query heads and 48 MLP rows split over 8 devices; 250 vocabulary rows padded to 256
  hf.save_hf(helpers.random_model(heads=8, kv_heads=2, vocab_size=250), out / "checkpoint")
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pair = pool.submit(helpers.run_processes, "tests.multidevice.process_checks", PAIR, out,
                       TIMEOUT_S)
    reference = process_checks.one_process()
    while not pair.done() and "generating_since" not in read_json(out / "1.json"):
      time.sleep(0.5)
    cli = {"dir": out / "cli", "runs": decode_cli(out / "cli")}
  return {**pair.result(), "reference": {"json": reference}, "cli": cli}


def read_json(path) -> dict:
  return json.loads(path.read_text()) if path.exists() else {}


def decode_cli(out) -> list[tuple[int, str, str]]:
  """`experiments.decode` on two processes of 4 CPU devices, one 2x4 mesh, each told to
  write OUT/<process>.json: each one's (returncode, stdout, stderr)."""
  out.mkdir()
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
  port = helpers.free_port()
  runs = [subprocess.Popen(
      [sys.executable, "-m", "experiments.decode", "--config=configs/greedy.py",
       "--config.chat=False", "--config.prompt=", "--config.prompt_ids=3,4,5",
       "--config.model=random-llama-tiny", "--config.max_new_tokens=6", "--config.mesh=2,4",
       f"--config.distributed=localhost:{port},2,{i}", f"--output_json={out / f'{i}.json'}"],
      cwd=helpers.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  found = []
  for run in runs:
    try:
      stdout, stderr = run.communicate(timeout=300)
    except subprocess.TimeoutExpired:
      run.kill()
      stdout, stderr = run.communicate()
    found.append((run.returncode, stdout, stderr))
  return found


def test_both_processes_and_the_reference_ran_every_check(runs):
  for role in PAIR:
    run = runs[role]
    assert "forward_logits" in run["json"], f"{role} did not get through:\n{run['log'][-5000:]}"
  assert runs["0"]["json"]["devices"] == runs["1"]["json"]["devices"] == 8  # one global mesh
  assert set(runs["reference"]["json"]) == {"strategies", "stream", "forward_logits",
                                            "one_layer_greedy"}


def test_every_strategy_on_two_processes_gives_the_tokens_of_one_process(runs):
  """Both processes get the whole result, equal to one process without a mesh: a lossy
  strategy's own (same seed), a lossless one's greedy (of the first layer alone, where
  it runs on that: `process_checks.one_layer`)."""
  reference = runs["reference"]["json"]
  first, second = (runs[r]["json"]["strategies"] for r in PAIR)
  assert first == second and set(first) == set(STRATEGIES)
  for name, sequences in first.items():
    if process_checks.one_layer(name):
      expected = reference["one_layer_greedy"]
    else:
      expected = reference["strategies"]["greedy" if name in helpers.LOSSLESS else name]
    assert sequences == expected and sum(map(len, sequences)) > 0, name
  assert reference["one_layer_greedy"] != reference["strategies"]["greedy"]


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


def test_the_decode_cli_on_two_processes_prints_and_writes_on_process_0_only(runs):
  out = runs["cli"]["dir"]
  (rc0, out0, err0), (rc1, out1, err1) = runs["cli"]["runs"]
  assert [rc0, rc1] == [0, 0], err0[-3000:] + err1[-3000:]
  assert out0.strip().splitlines()[-1] == f"--- summary (JSON): {out / '0.json'}"
  summary = json.loads((out / "0.json").read_text())
  one_process = mdjax.generate(mdjax.load("random-llama-tiny"), [[3, 4, 5]], max_new_tokens=6)
  assert summary["sequences"] == one_process.sequences
  assert out1 == "" and not (out / "1.json").exists()
