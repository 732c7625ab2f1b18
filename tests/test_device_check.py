"""experiments.device_check --quick (the accelerator check, reduced to a tiny model and
one accelerator test) runs end to end on the CPU: every section recorded without error,
the plot drawn.

No timing is asserted: the check measures, this test checks that it can.
"""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = ["tests", "roofline", "pass_cost", "variants", "branches", "heads", "profile"]  # in the order they run


def test_device_check_quick(tmp_path):
  subprocess.run([sys.executable, "-m", "experiments.device_check", "--quick",
                  f"--out_dir={tmp_path}"], cwd=REPO, check=True, timeout=900,
                 capture_output=True)
  assert (tmp_path / "device_check_cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  results = json.loads((tmp_path / "device_check_cpu.json").read_text())
  assert "plot_error" not in results
  sections = results["sections"]
  assert list(sections) == SECTIONS
  for name, section in sections.items():
    assert "error" not in section, (name, section.get("traceback"))
  tests = sections["tests"]
  assert tests["passed"] == tests["tests"] >= 1 and not tests["failing"]
  assert list(sections["roofline"]["batches"]) == ["1", "4"]
  passes = sections["pass_cost"]["batches"]["1"]
  assert list(passes) == ["1", "2", "4", "8", "16", "32", "64"]
  assert passes["1"]["ratio_to_first"] == 1.0 and all(c["ms"] > 0 for c in passes.values())
  for cells in sections["variants"]["contexts"].values():
    assert set(cells) == {"scan/block_sparse", "unrolled/block_sparse", "unrolled/fused",
                          "unrolled/dense"}
    assert all(cell["same_tokens_as_first"] for cell in cells.values())  # float32 on CPU
  branches = sections["branches"]
  assert all(c["same_tokens_as_sequential"] for c in branches["branches"].values())
  tokens = branches["prompt_lookup"]["tokens"]
  assert tokens["matching_tokens"] == tokens["total_tokens"] > 0
  heads = sections["heads"]
  assert list(heads["batches"]) == ["2"]  # (batch 1 is the same code: the full run's 1 and 8)
  for cell in heads["batches"].values():
    contenders = cell["contenders"]
    assert set(contenders) == {f"{family}@{tree}" for family in ("medusa", "eagle", "eagle3")
                               for tree in ("auto", "2x2x4" if family != "medusa" else "4")}
    for name, contender in contenders.items():
      tokens = contender["tokens"]
      assert tokens["matching_tokens"] == tokens["total_tokens"] > 0, name  # float32 on CPU
      assert ("choice" in contender) == name.endswith("@auto"), name
    mix = cell["mix"]  # lookup + EAGLE-3-shaped heads on prompts that copy
    assert mix["heads"] == "eagle3" and mix["choice"]["tree_choice"] in ("mix", "plain")
    assert mix["tokens"]["matching_tokens"] == mix["tokens"]["total_tokens"] > 0
    assert mix["step_cost"]["predicted"] >= 1 and mix["step_cost"]["measured"] > 0
    if mix["choice"]["tree_choice"] == "mix":  # a random target copies little: counts only
      sources = mix["choice"]["sources"]
      assert all(0 <= mix["sources"][f"accepted_{s}"] <= mix["sources"][f"drafted_{s}"]
                 for s in sources), mix["sources"]
  profile = sections["profile"]  # on the CPU, the thunks named like the program's instructions
  assert profile["matched_share"] > 0.99 and profile["kernel_ms_per_step"] > 0
  assert profile["top"][0]["runs_per_generation"] >= 1 and profile["top"][0]["mbytes"] > 0
