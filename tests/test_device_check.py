"""experiments.device_check --quick (the accelerator check, reduced to a tiny model and
one accelerator test) runs end to end on the CPU: every section recorded without error,
the plot drawn; and its profile reads a GPU's trace (a made one: the CPU's has no device
streams).

No timing is asserted: the check measures, this test checks that it can.
"""

import gzip
import json
import pathlib
import subprocess
import sys

import pytest

from experiments.bench import step_profile

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
  assert list(sections["roofline"]["batches"]) == ["1", "2"]
  passes = sections["pass_cost"]["batches"]["1"]
  assert list(passes) == ["1", "2"]  # --quick's widths (the full run's: mdjax's WIDTHS)
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


HLO = """HloModule step

%fused_gather (p0: bf16[1000,64], p1: s32[]) -> bf16[1,64] {
  %p0 = bf16[1000,64]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %row = bf16[1,64]{1,0} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={1,64}
}

ENTRY %main (table: bf16[1000,64], index: s32[], w: bf16[64,4096]) -> f32[1,4096] {
  %table = bf16[1000,64]{1,0} parameter(0)
  %index = s32[] parameter(1)
  %w = bf16[64,4096]{1,0} parameter(2)
  %embed.1 = bf16[1,64]{1,0} fusion(%table, %index), kind=kLoop, calls=%fused_gather
  ROOT %dot.2 = f32[1,4096]{1,0} custom-call(%embed.1, %w), custom_call_target="__cublas$gemm"
}
"""


def test_the_profile_reads_a_gpu_trace_kernel_by_kernel(tmp_path):
  """A GPU trace's device-stream events are its kernels (host events beside them are
  not), matched to their instructions by name (`embed.1` runs as `embed_1`) or by the
  event's `hlo_op`; a fusion that only slices a parameter (an embedding row) moves the
  row, not the table."""
  meta = lambda pid, name, tid=None: dict(ph="M", pid=pid, name="thread_name" if tid else
                                          "process_name", args=dict(name=name),
                                          **({"tid": tid} if tid else {}))
  kernel = lambda name, dur, **args: dict(ph="X", pid=2, tid=7, name=name, dur=dur, ts=0,
                                          args=args)
  events = [meta(1, "/host:CPU"), meta(2, "/device:GPU:0"), meta(2, "Stream #7", 7),
            dict(ph="X", pid=1, tid=1, name="embed.1", dur=500.0, ts=0)]  # host: not a kernel
  for _ in range(2):  # two generations of one step each
    events += [kernel("embed_1", 2.0), kernel("sm90_xmma_gemm_bf16", 4.0, hlo_op="dot.2")]
  trace = tmp_path / "plugins" / "profile" / "run"
  trace.mkdir(parents=True)
  with gzip.open(trace / "perfetto_trace.json.gz", "wt") as f:
    json.dump(dict(traceEvents=events), f)
  instructions = step_profile.instruction_bytes(HLO)
  assert instructions["embed_1"] == 2 * 64 * 2 + 4  # the row written and read, the index
  assert instructions["dot_2"] == 4096 * 4 + 64 * 2 + 64 * 4096 * 2
  found = step_profile.kernel_events(step_profile.trace_events(tmp_path), instructions)
  summary = step_profile.summarize(found, instructions, runs=2, steps_per_run=1,
                                   wall_s_per_run=10e-6, bandwidth_gbps=3350.0)
  assert summary["kernel_launches_per_generation"] == 2 and summary["kernels"] == 2
  gemm, embed = summary["top"]
  assert (gemm["kernel"], gemm["runs_per_generation"], gemm["share"]) == ("dot.2", 1, 4 / 6)
  assert gemm["gbps"] == pytest.approx(instructions["dot_2"] / 4e3)
  assert embed["kernel"] == "embed_1" and summary["matched_share"] == 1
  assert summary["kernel_ms_per_step"] == pytest.approx(6e-3)
  assert summary["device_busy_fraction"] == pytest.approx(0.6)
