"""experiments.bench.decode --quick (and the other benchmarks') runs end to end and writes
its JSON and plot.

No timing is asserted: benchmarks measure, tests check that they can.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
CELL_KEYS = {"mdjax", "transformers", "speedup", "decode_speedup", "bare_step_ms", "loop_ratio",
             "roofline_ms", "tokens"}
TIMING_KEYS = {"ms_per_token", "prefill_ms", "decode_ms_per_token", "tokens_per_s",
               "roofline_fraction"}


def run_quick(bench: str, stem: str, out_dir: pathlib.Path, env: dict | None = None) -> dict:
  """Runs `experiments.bench.<bench> --quick` (with `env` added to the environment);
  checks the PNG it drew, `<stem>.png`; returns its JSON, `<stem>.json`."""
  subprocess.run([sys.executable, "-m", f"experiments.bench.{bench}", "--quick",
                  f"--out_dir={out_dir}"], cwd=REPO, check=True, timeout=600, capture_output=True,
                 env=None if env is None else dict(os.environ, **env))
  assert (out_dir / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  return json.loads((out_dir / f"{stem}.json").read_text())


def test_bench_decode_quick(tmp_path):
  results = run_quick("decode", "bench_decode", tmp_path)

  assert {"cpu_count", "jax", "torch", "transformers", "torch_threads"} <= set(results["machine"])
  assert results["machine"]["bandwidth"]["read_gbps"] > 0
  (entry,) = results["models"].values()
  assert entry["transformers_class"] == "LlamaForCausalLM"
  assert entry["batches"]
  for batch, cell in entry["batches"].items():
    assert CELL_KEYS <= set(cell)
    assert TIMING_KEYS | {"compile_s"} <= set(cell["mdjax"])
    assert TIMING_KEYS <= set(cell["transformers"])
    tokens = cell["tokens"]
    assert 0 <= tokens["matching_tokens"] <= tokens["total_tokens"]
    assert tokens["total_tokens"] == int(batch) * results["settings"]["new_tokens"]


def test_bench_context_quick(tmp_path):
  results = run_quick("context", "bench_context", tmp_path)
  assert results["command"].startswith("python3 -m experiments.bench.context --quick")
  contenders = {"transformers"} | {f"mdjax block_sparse {loop} {kv}" for loop in
                                   ("unrolled", "scan") for kv in ("float32", "int8")}
  contenders |= {f"mdjax block_sparse unrolled {kv} stacked" for kv in ("float32", "int8")}
  points = results["points"]
  assert [p["context"] for p in points] == [32, 96]
  for p in points:
    assert set(p["step_ms"]) == contenders and all(ms > 0 for ms in p["step_ms"].values())
  assert 0 < points[0]["roofline_ms"] < points[1]["roofline_ms"]  # more K/V to read
  assert "prefill_ms" not in points[0] and set(points[1]["prefill_ms"]) == {"mdjax",
                                                                           "transformers"}
  assert set(results["growth"]) == contenders


def test_lookup_prior_quick(tmp_path):
  """Every rate is a share of what was offered; a later token is scored only after the
  ones before it were right."""
  results = run_quick("lookup_prior", "lookup_prior", tmp_path)
  for counts in results["counts"].values():
    for side in counts.values():
      offered, right = map(np.asarray, (side["offered"], side["right"]))
      assert (0 <= right).all() and (right <= offered).all()
      assert (offered[:, 1:] <= right[:, :-1]).all()
  overall = results["overall"]["answer"]
  assert 0 < overall["matched"] <= 1 and len(overall["first"]) == results["options"]["num_tokens"]


def test_bench_speculative_quick(tmp_path):
  """Every lossless contender reproduces greedy's tokens; the theory columns exist."""
  results = run_quick("speculative", "bench_speculative", tmp_path)
  cells = results["batches"]["1"]
  for name, cell in cells.items():
    if not name.startswith("hf_"):
      assert cell["tokens"]["matching_tokens"] == cell["tokens"]["total_tokens"], name
  for gamma in results["settings"]["gammas"]:
    cell = cells[f"gamma_{gamma}"]
    assert 0 <= cell["alpha"] <= 1 and 1 <= cell["predicted_tokens_per_verify"] <= gamma + 1
  assert results["settings"]["repeats"] == 1 and results["settings"]["prompts"] == 1
  for cell in cells.values():  # one run each: the whole = the first token + the decode after it
    whole = cell["ms_per_token"] * results["settings"]["new_tokens"]
    parts = (cell["first_token_ms"]
             + cell["decode_ms_per_token"] * (results["settings"]["new_tokens"] - 1))
    # (no sign check on decode_ms_per_token: it is a whole run minus a separately timed
    # one-token run, which a loaded machine can make negative at 4 tokens; no timed asserts)
    assert parts == pytest.approx(whole, rel=1e-9)
  assert cells["hf_assisted"]["gamma"] in results["settings"]["gammas"]
  copied = cells["copy_greedy"]["copies_the_chunk"]  # of the held-out chunk, per position
  assert copied["total_tokens"] == results["settings"]["new_tokens"]
  assert 0 <= copied["matching_tokens"] <= copied["total_tokens"]


def test_bench_branches_quick(tmp_path):
  """The shared cache, sequential and duplicated-batch runs produce the same answers."""
  results = run_quick("branches", "bench_branches", tmp_path)
  assert [p["n"] for p in results["points"]] == list(results["settings"]["ns"])
  for point in results["points"]:
    assert point["same_tokens"]["batched"] and point["same_tokens"]["sequential"]
    assert {"batched", "hf", "sequential"} <= set(point["speedup"])
    assert point["kv_bytes"]["shared"] <= point["kv_bytes"]["batched"] * 2


def test_reproduce_multidecode_quick(tmp_path):
  """Every point of the grid is there; the mdjax modes give the same answers; the
  sequential baseline timed on fewer questions than N is marked as estimated."""
  results = run_quick("reproduce_multidecode", "reproduce_multidecode", tmp_path)
  settings = results["settings"]
  assert ([(p["new_tokens"], p["n"]) for p in results["points"]]
          == [(t, n) for t in settings["new_tokens"] for n in sorted(settings["ns"])])
  for point in results["points"]:
    assert point["same_tokens"] == {"sequential": True, "batching": True}
    assert set(point["speedup"]) == {"sequential", "batching", "hf"} and not point["skipped"]
    assert point["context_tokens"] == settings["context_tokens"]
    agreement = point["hf_agreement"]
    assert agreement["total_tokens"] == point["n"] * point["new_tokens"]
    assert 0 <= agreement["identical_answers"] <= point["n"]
    assert ("sequential" in point["estimated"]) == (point["n"] > settings["sequential_questions"])
  assert len(results["goals"]["versus_reference"]) == 3


def test_bench_compile_quick(tmp_path):
  """A compile time per strategy, layer loop and depth, their deep/shallow ratios, and
  greedy's ms per token in both loops."""
  results = run_quick("compile", "bench_compile", tmp_path)
  settings = results["settings"]
  depths = [str(d) for d in settings["depths"]]
  assert set(results["compile_s"]) == set(settings["strategies"]) == {"greedy", "speculative"}
  for strategy, by_loop in results["compile_s"].items():
    assert set(by_loop) == {"scan", "unrolled"}
    for loop, seconds in by_loop.items():
      assert list(seconds) == depths and all(s > 0 for s in seconds.values()), (strategy, loop)
      assert results["deep_to_shallow"][strategy][loop] == pytest.approx(
          seconds[depths[-1]] / seconds[depths[0]])
  assert set(results["decode"]) == {"scan", "unrolled"}
  assert all(cell["layers"] == settings["depths"][0] for cell in results["decode"].values())
  # a ratio of paired timing differences: its value (even its sign, in a quick run on a
  # loaded machine) is noise here; that it is computed from both loops is the check
  assert math.isfinite(results["decode_scan_over_unrolled"])


HEAD_LINES = ("medusa", "eagle", "eagle3")


def test_bench_heads_quick(tmp_path):
  """Every contender reproduces greedy's tokens; tokens per pass and speedup are reported
  per task kind at batch 1 and overall at every batch; every head strategy's auto choice
  is marked beside its fixed trees, with issue 40's goal checked."""
  results = run_quick("heads", "bench_heads", tmp_path)
  settings = results["settings"]
  assert list(results["batches"]) == [str(b) for b in settings["batches"]]
  assert set(results["heads"]) == set(HEAD_LINES) and results["mismatches"] == []
  kinds = results["batches"]["1"]["kinds"]
  assert list(kinds) == list(results["kinds"]) and len(kinds) == 2
  for batch, entry in results["batches"].items():
    overall = entry["overall"]
    for line in HEAD_LINES:
      assert set(entry["sweep"][line]) <= set(overall)
      assert len(entry["sweep"][line]) == len(settings["eagle_trees" if "eagle" in line
                                                        else "budgets"])
    for cells in [overall, *entry.get("kinds", {}).values()]:
      assert {"greedy", "prompt_lookup", *HEAD_LINES} <= set(cells)
      assert cells["greedy"]["tokens_per_pass"] == pytest.approx(1.0)
      for name, cell in cells.items():
        assert cell["identical_to_greedy"], (batch, name)
        assert cell["tokens"]["matching_tokens"] == cell["tokens"]["total_tokens"] > 0
        assert cell["tokens_per_pass"] >= 1.0 and cell["speedup_vs_greedy"] > 0
        assert all(0 <= rate <= 1 for rate in cell.get("acceptance_at", []))
    for line, auto in entry["auto"].items():
      assert {"tree_choice", "tree_budget", "tree_depth", "tree_top_k",
              "pass_cost_s"} <= set(auto["choice"])
      assert auto["speedup_vs_greedy"] == overall[line]["speedup_vs_greedy"]
      assert auto["best_fixed"] in entry["sweep"][line]
      assert auto["auto_over_best_fixed"] == pytest.approx(
          auto["speedup_vs_greedy"] / overall[auto["best_fixed"]]["speedup_vs_greedy"])
      assert auto["goal_met"] == (auto["within_5pct_of_best_fixed"]
                                  and auto["at_most_5pct_slower_than_greedy"])


def test_bench_heads_bad_question_line(tmp_path):
  """A question file's bad line is one error line naming it."""
  questions = tmp_path / "questions.jsonl"
  questions.write_text('{"category": "qa", "prompt": "Why?"}\n{"prompt": "no category"}\n')
  done = subprocess.run([sys.executable, "-m", "experiments.bench.heads", "--quick",
                         f"--questions={questions}", f"--out_dir={tmp_path}"],
                        cwd=REPO, timeout=600, capture_output=True, text=True)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1].startswith(f"error: {questions} line 2:")


def test_bench_controls_quick(tmp_path):
  """A sweep compiles once; the step is timed with and without controls; a control's
  kernels are counted in the program built for an H200."""
  results = run_quick("controls", "bench_controls", tmp_path)
  assert {name: cell["compiles"] for name, cell in results["sweeps"]["sample"].items()} == {
      "temperature": 1, "repetition_penalty": 1}
  (row,) = results["step"]
  # timed on a busy machine: a difference of walls, written, not held to a sign here
  assert math.isfinite(row["off_ms"]) and math.isfinite(row["on_ms"])
  assert results["kernels"]["none"] > 0 and 0 <= results["kernels"]["added"][
      "repetition_penalty"] <= 3


def test_bench_device_quick(tmp_path):
  """On 2 simulated CPU devices (JAX reads JAX_NUM_CPU_DEVICES when it starts): the
  baseline and both 2-device mesh shapes, every batch size, the roofline's bytes per
  device, and every lossless strategy's tokens equal to greedy's on every mesh."""
  results = run_quick("device", "bench_device", tmp_path, env={"JAX_NUM_CPU_DEVICES": "2"})
  settings, device = results["settings"], results["device"]
  assert device["platform"] == "cpu" and device["device_count"] == 2
  assert device["bandwidth_scope"] == "shared" and device["bandwidth_gbps"] > 0
  assert settings["dtype"] == "float32"
  assert list(results["meshes"]) == ["1x1", "1x2", "2x1"]
  for mesh, cells in results["meshes"].items():
    assert cells["devices"] == (1 if mesh == "1x1" else 2)
    assert list(cells["greedy"]) == [str(b) for b in settings["batches"]]
    for cell in cells["greedy"].values():
      assert {"ms_per_token", "decode_ms_per_token", "tokens_per_s", "roofline_ms",
              "roofline_fraction"} <= set(cell)
      assert cell["roofline_ms"] > 0
      per_device, total = cell["step_bytes_per_device"], cell["step_bytes_total"]
      if mesh == "1x2":  # tensor-parallel: each device reads part of the weights
        assert per_device < total
      else:  # one device, or weights replicated over the data axis
        assert per_device == pytest.approx(total, rel=0.2)
    assert cells["greedy_same_tokens_as_first_mesh"], mesh
    for name in ("prompt_lookup", "speculative", "multi_question"):
      tokens = cells[name]["tokens"]
      assert tokens["matching_tokens"] == tokens["total_tokens"] > 0, (mesh, name)
      assert cells[name]["speedup_vs_greedy"] > 0


def test_divergence_gaps_read_greedys_top2_where_rows_part():
  """Where a row leaves greedy's tokens, the gap between greedy's top-2 logits there
  (mdjax's forward of the prompt and greedy's tokens so far); rows that never part
  give none."""
  import mdjax
  from experiments.bench.common import divergence_gaps
  model = mdjax.load("random-llama-tiny")
  prompt = [5, 6, 7]
  (greedy,) = mdjax.generate(model, [prompt], max_new_tokens=4, eos_token_id=[]).sequences
  parted = greedy[:2] + [greedy[2] + 1] + greedy[3:]
  gaps = divergence_gaps(model, [prompt, prompt], [greedy, greedy], [greedy, parted])
  top2 = sorted(mdjax.forward_logits(model, prompt + greedy[:2])[-1])[-2:]
  assert gaps == [pytest.approx(top2[1] - top2[0])]


def test_common_trees_heads_and_their_strategies():
  """The benches' shared helpers: a tree as each strategy takes it, the strategy the
  registry names for each family, and random heads shaped like the shipped ones."""
  import mdjax
  from experiments.bench import common
  from mdjax.heads import get_family
  tree = common.Tree.parse("2x3x8")
  assert (tree.label, tree.options()) == ("2x3x8", dict(tree_budget=8, tree_depth=2, tree_top_k=3))
  assert common.Tree.parse("2x3x8").for_strategy("medusa") == common.Tree(8)
  assert common.Tree(8).options() == dict(tree_budget=8) and common.Tree(8).label == "8"
  for bad in ("2x3", "2x0x8", "axbxc"):
    with pytest.raises(mdjax.MdjaxError, match="DEPTHxTOP_KxBUDGET"):
      common.Tree.parse(bad)
  model = mdjax.load("random-llama-tiny")
  shipped = common.shipped_configs()
  assert list(shipped) == ["medusa", "eagle", "eagle3"]
  for family, (name, config) in shipped.items():
    assert common.head_strategy(family) in get_family(family).strategies
    heads = common.random_heads(model, family)
    assert heads.config.family == config.family == family and name.endswith(family)
    assert (heads.config.num_heads, heads.config.num_layers) == (config.num_heads,
                                                                 config.num_layers)
    assert heads.config.top_accuracy == config.top_accuracy
    assert heads.config.draft_vocab_size == min(config.draft_vocab_size,
                                                model.config.vocab_size // 2)
