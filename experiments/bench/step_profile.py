"""Where a greedy step's time goes on the device, kernel by kernel: a `jax.profiler`
trace of a few whole generations, read back from the Perfetto JSON it writes, each
kernel matched to its instruction in the compiled program (`mdjax.hlo_text`) for the
bytes it moves, hence the bandwidth it reached::

    kernel                     runs  us per run  MB moved  GB/s   share of kernel time
    gemm_fusion_dot_general_54  16x     9.1        67.1    7,370   31%
    ...

With the sum of kernel time per step (a token of every row) beside the wall time per step, the
gap between them is time the device waited (launches, the host); a GEMV whose GB/s
is far below the HBM's is a kernel to tune. The kernels are the events of the
trace's device processes ("/device:GPU:0": its streams); on a CPU, the events of the
XLA client's threads named like an instruction of the program (a smoke test: the
CPU's thunks, not kernels).
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import tempfile

import jax
import numpy as np

import mdjax
from mdjax.hlo_text import Instruction, nbytes, parse

TOP = 30  # kernels listed by total time
NOT_KERNELS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                         "while", "conditional", "call"})  # (control flow: what it runs is)


def trace_events(trace_dir: pathlib.Path) -> list[dict]:
  """The complete ("X") events of the Perfetto trace under `trace_dir`, each with its
  process's and thread's names added (`process`, `thread`)."""
  paths = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(paths[-1]) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  named = lambda kind: [e for e in events if e.get("ph") == "M" and e.get("name") == kind]
  processes = {e["pid"]: e["args"]["name"] for e in named("process_name")}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in named("thread_name")}
  return [dict(e, process=processes.get(e["pid"], ""),
               thread=threads.get((e["pid"], e.get("tid")), ""))
          for e in events if e.get("ph") == "X"]


def _key(name: str) -> str:
  """A kernel's or instruction's name as both are written ("loop_add_fusion.2" and its
  kernel "loop_add_fusion_2")."""
  return re.sub(r"[^0-9A-Za-z]", "_", name)


def instruction_bytes(hlo_text: str) -> dict[str, int]:
  """Per instruction of the compiled program that runs as a kernel (by `_key`): the
  bytes it writes and reads.
  A fused computation's parameter that is only sliced (`dynamic-slice`: one layer of a
  stacked weight) counts the slices it reads, not the whole array."""
  computations, _ = parse(hlo_text)
  sizes = {}
  for instructions in computations.values():
    types = {i.name: i for i in instructions}
    for i in instructions:
      if i.opcode in NOT_KERNELS:
        continue
      read = _fused_reads(computations, i) if i.attribute("calls") else None
      if read is None:
        read = sum(_size(types[o]) for o in i.operands if o in types)
      sizes[_key(i.name)] = _size(i) + read
  return sizes


def _size(instruction: Instruction) -> int:
  return sum(nbytes(dtype, dims) for dtype, dims in instruction.arrays)


def _fused_reads(computations: dict[str, list[Instruction]], fusion: Instruction) -> int | None:
  """The bytes a fusion reads: per parameter of its computation, the whole array, or
  the slices taken of it where it is only sliced. None: no such computation."""
  body = computations.get(fusion.attribute("calls"))
  if body is None:
    return None
  users = collections.defaultdict(list)
  for i in body:
    for operand in i.operands:
      users[operand].append(i)
  total = 0
  for parameter in (i for i in body if i.opcode == "parameter"):
    readers = users[parameter.name]
    sliced = readers and all(r.opcode == "dynamic-slice" and r.operands[0] == parameter.name
                             for r in readers)
    total += sum(_size(r) for r in readers) if sliced else _size(parameter)
  return total


def kernel_events(events: list[dict], instructions: dict[str, int]) -> list[dict]:
  """The events that are the program's kernels: those of the device processes, or
  where there are none (a CPU), the events named like one of its `instructions`."""
  on_device = [e for e in events if e["process"].startswith("/device:")]
  if on_device:
    return on_device
  return [e for e in events if _key(e["name"]) in instructions]


def summarize(kernels: list[dict], instructions: dict[str, int], *, runs: int,
              steps_per_run: int, wall_s_per_run: float, bandwidth_gbps: float) -> dict:
  """Per kernel name: runs per generation, microseconds per run, bytes it moves (where
  its instruction is found: `hlo_op` of the event, else its name) and GB/s; the kernel
  time per token against the wall time per token."""
  by_name = collections.defaultdict(list)
  for e in kernels:
    by_name[e.get("args", {}).get("hlo_op") or e["name"]].append(float(e["dur"]))
  total_us = sum(sum(d) for d in by_name.values())
  rows = []
  for name, durations in sorted(by_name.items(), key=lambda item: -sum(item[1])):
    moved = instructions.get(_key(name))
    mean_us = float(np.mean(durations))
    rows.append(dict(kernel=name, runs_per_generation=len(durations) / runs, mean_us=mean_us,
                     share=sum(durations) / total_us, mbytes=moved and moved / 1e6,
                     gbps=moved and moved / (mean_us * 1e3)))
  matched = [r for r in rows if r["mbytes"]]
  moved_per_run = sum(r["mbytes"] * 1e6 * r["runs_per_generation"] for r in matched)
  kernel_s = total_us / 1e6 / runs
  return dict(
      kernels=len(by_name), kernel_launches_per_generation=len(kernels) / runs,
      kernel_ms_per_step=kernel_s * 1e3 / steps_per_run,
      wall_ms_per_step=wall_s_per_run * 1e3 / steps_per_run,
      device_busy_fraction=kernel_s / wall_s_per_run,
      matched_share=sum(r["share"] for r in matched),
      mbytes_per_step=moved_per_run / 1e6 / steps_per_run,
      kernel_gbps=moved_per_run / 1e9 / kernel_s if kernel_s else None,
      bandwidth_gbps=bandwidth_gbps, top=rows[:TOP])


def profile_greedy(model: mdjax.Model, prompts: np.ndarray, new_tokens: int, runs: int,
                   bandwidth_gbps: float) -> dict:
  """Greedy `generate` of `prompts` [B, L] for `new_tokens`: once to compile, then
  `runs` times under the profiler; the trace's kernels summarized (`summarize`)."""
  run = lambda: mdjax.generate(model, prompts.tolist(), "greedy", max_new_tokens=new_tokens,
                               eos_token_id=[])
  run()
  hlo = mdjax.compiled_programs()[-1].as_text()
  walls = []
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(runs):
        walls.append(run().stats["wall_s"])
    events = trace_events(pathlib.Path(trace_dir))
  instructions = instruction_bytes(hlo)
  return dict(batch=len(prompts), prompt_len=prompts.shape[1], new_tokens=new_tokens, runs=runs,
              **summarize(kernel_events(events, instructions), instructions, runs=runs,
                          steps_per_run=new_tokens,
                          wall_s_per_run=float(np.median(walls)), bandwidth_gbps=bandwidth_gbps))
