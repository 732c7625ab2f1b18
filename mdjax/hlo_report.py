"""What a compiled program does on its device, read from its optimized HLO text
(`compiled.as_text()`, parsed by `mdjax.hlo_text`): the kernels it launches, the loops
that wait for the host and the bytes it copies inside loops (float32 products:
`mdjax.hlo_products`).

    counts = hlo_report.read(compiled.as_text(), platform="gpu")
    counts.kernels        # kernels launched by one run of the program (on a TPU: its ops)
    counts.scalar_kernels # of which have a scalar result (a TPU runs them on its scalar
                          # core, beside its vector work)
    counts.host_syncs     # waits for the host: see below
    counts.copies         # bytes copied into device memory per run (a donated KV cache
                          # copied before its update instead of updated in place...)
    counts.loop_copies    # of which inside loops (weights sliced out of a layer stack, a
                          # layer's K/V copied out of the cache)
    counts.loop_copies_on_chip  # and into on-chip memory (a TPU's VMEM: `S(1)` layouts),
                          # which costs no device-memory bandwidth beyond the read itself
    counts.attention_kernels  # of the kernels, mdjax's few-token attention on a GPU or
                          # a TPU (`mdjax.models.decode_attention`, `tpu_attention`): one
                          # per layer of every pass of up to 32 tokens, so the layers a
                          # run passes through
  counts.kernels_by_layer   # {index: kernels} under unrolled layer `index`'s named scope
  counts.attention_by_layer # (`mdjax.models.layer_loop.layer_scope`), of any model's pass

How a run is counted, computation by computation from ENTRY::

    instruction                          kernels
    fusion, custom-call (cuBLAS, cuDNN),  1 each
      copy, any other compute op
    while of n trips                     n x body + (n + 1) x condition
    while of unknown trip count          body + condition once
    conditional                          its costliest branch and the predicate's read
    call                                 its callee
    parameter, constant, tuple, get-tuple-element, bitcast,   0 (no kernel)
      the `-done` of an asynchronous op...

A while's trips are XLA:GPU's `known_trip_count`; XLA:TPU writes none, so a loop
`i = c; while i < n: ...; i = i + 1` is read from its condition, its initial tuple and
its body. The host waits: on a GPU (and as this CPU's programs are read by default)
each trip of a while of unknown trip count and each conditional (XLA:GPU copies the
predicate to the host and waits for it); on a TPU, whose own scalar core runs its
control flow, neither. On every platform a transfer to or from the host (infeed,
outfeed, a host send or receive, a Python callback) is one.

A copy inside a loop is a `copy` (or `copy-start`), or a fusion whose result is a
`dynamic-slice` of an operand (a slice materialised before its consumer rather than
read in place).
"""

from __future__ import annotations

import collections
import dataclasses
import re

from mdjax.hlo_text import Instruction, nbytes, parse
from mdjax.models import decode_attention, tpu_attention
from mdjax.models.layer_loop import LAYER_SCOPE

ATTENTION_KERNELS = (decode_attention.KERNEL_NAME, tpu_attention.KERNEL_NAME)  # by op name

NO_KERNEL = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                       "after-all", "opt-barrier", "add-dependency", "partition-id",
                       "replica-id", "domain", "while", "conditional", "call", "iota"})
HOST_TRANSFERS = frozenset({"infeed", "outfeed", "send", "recv"})
_LAYER = re.compile(rf"/{LAYER_SCOPE}(\d+)/")
_FOLLOWED = frozenset({"copy", "bitcast", "copy-start", "copy-done", "reshape"})  # same value


@dataclasses.dataclass
class Counts:
  """One run of a program (see the module docstring)."""

  kernels: int = 0
  scalar_kernels: int = 0  # of which have a scalar result (on a TPU: its scalar core's)
  kernels_by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  host_syncs: int = 0
  copies: int = 0  # bytes copied into device memory, inside loops or not
  copy_shapes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  loop_copies: int = 0  # bytes into device memory
  loop_copies_on_chip: int = 0  # bytes into on-chip memory
  loop_copy_shapes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  loops: list = dataclasses.field(default_factory=list)  # (trip count or None, kernels per trip)
  attention_kernels: int = 0  # of the kernels, mdjax's decode attention: one per layer pass
  kernels_by_layer: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  attention_by_layer: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def add(self, other: "Counts", times: int = 1) -> None:
    self.kernels += times * other.kernels
    self.attention_kernels += times * other.attention_kernels
    self.scalar_kernels += times * other.scalar_kernels
    self.host_syncs += times * other.host_syncs
    self.copies += times * other.copies
    self.loop_copies += times * other.loop_copies
    self.loop_copies_on_chip += times * other.loop_copies_on_chip
    for mine, theirs in ((self.kernels_by_kind, other.kernels_by_kind),
                         (self.copy_shapes, other.copy_shapes),
                         (self.loop_copy_shapes, other.loop_copy_shapes),
                         (self.kernels_by_layer, other.kernels_by_layer),
                         (self.attention_by_layer, other.attention_by_layer)):
      for key, n in theirs.items():
        mine[key] += times * n
    self.loops.extend(other.loops)

  def to_json(self) -> dict:
    return dict(kernels=self.kernels, scalar_kernels=self.scalar_kernels,
                attention_kernels=self.attention_kernels,
                kernels_by_kind=dict(self.kernels_by_kind),
                host_syncs=self.host_syncs, copy_bytes=self.copies,
                copy_shapes=dict(self.copy_shapes.most_common(8)),
                loop_copy_bytes=self.loop_copies,
                loop_copy_bytes_on_chip=self.loop_copies_on_chip,
                loop_copy_shapes=dict(self.loop_copy_shapes.most_common(8)),
                loops=[dict(trip_count=t, kernels_per_trip=k) for t, k in self.loops])


class _Reader:
  def __init__(self, text: str, platform: str):
    self.computations, self.entry = parse(text)
    self.control_flow_waits = control_flow_waits(platform)
    self.memo: dict[tuple[str, bool], Counts] = {}

  def root(self, name: str) -> Instruction:
    return next(i for i in self.computations[name] if i.is_root)

  def is_slice_fusion(self, instruction: Instruction) -> bool:
    callee = instruction.attribute("calls")
    return bool(callee) and self.root(callee).opcode == "dynamic-slice"

  def run(self, name: str, in_loop: bool) -> Counts:
    key = (name, in_loop)
    if key not in self.memo:
      self.memo[key] = self._run(name, in_loop)
    return self.memo[key]

  def _run(self, name: str, in_loop: bool) -> Counts:
    counts = Counts()
    scope = {i.name: i for i in self.computations[name]}
    for instruction in self.computations[name]:
      op = instruction.opcode
      if op == "while":
        body = self.run(instruction.attribute("body"), True)
        condition = self.run(instruction.attribute("condition"), True)
        n = self.trip_count(instruction, scope)
        counts.add(body, 1 if n is None else n)
        counts.add(condition, 1 if n is None else n + 1)
        counts.host_syncs += n is None and self.control_flow_waits
        counts.loops.append((n, body.kernels))
      elif op == "conditional":
        listed = re.search(r"branch_computations=\{([^}]*)\}", instruction.text)
        branches = (re.findall(r"%([\w.\-]+)", listed.group(1)) if listed else
                    [instruction.attribute("true_computation"),
                     instruction.attribute("false_computation")])
        costliest = max((self.run(b, in_loop) for b in branches if b), key=lambda c: c.kernels)
        counts.add(costliest)
        counts.kernels += 1  # the predicate's read
        counts.kernels_by_kind["conditional"] += 1
        counts.host_syncs += self.control_flow_waits
      elif op == "call":
        counts.add(self.run(instruction.attribute("to_apply"), in_loop))
      elif not (op in NO_KERNEL or op.endswith("-done") or "AllocateBuffer" in instruction.text):
        kind = re.search(r"kind=(k\w+)", instruction.text)
        counts.kernels += 1
        counts.scalar_kernels += all(not dims for _, dims in instruction.arrays)
        counts.kernels_by_kind[op + (f":{kind.group(1)}" if kind else "")] += 1
        counts.host_syncs += _is_host_transfer(instruction)
        attention = any(f"/{name}/" in instruction.op_name for name in ATTENTION_KERNELS)
        counts.attention_kernels += attention
        if layer := _LAYER.search(instruction.op_name):
          counts.kernels_by_layer[int(layer.group(1))] += 1
          counts.attention_by_layer[int(layer.group(1))] += attention
        if op in ("copy", "copy-start") or (op == "fusion" and self.is_slice_fusion(instruction)):
          self.add_copy(counts, instruction, in_loop)
    return counts

  @staticmethod
  def add_copy(counts: Counts, instruction: Instruction, in_loop: bool) -> None:
    """A copy's bytes, by the memory it writes (`copy-start`: its destination, the
    tuple's first array) and where it runs."""
    destination = instruction.type.lstrip("(").split(", ")[0]
    size = nbytes(*instruction.arrays[0])
    on_chip = bool(re.search(r"S\([1-9]\)\}", destination))
    if not on_chip:
      counts.copies += size
      counts.copy_shapes[destination.split("{")[0]] += 1
    if in_loop and on_chip:
      counts.loop_copies_on_chip += size
    elif in_loop:
      counts.loop_copies += size
    if in_loop:
      counts.loop_copy_shapes[destination.split("{")[0]] += 1

  def trip_count(self, loop: Instruction, scope: dict[str, Instruction]) -> int | None:
    """The trips of while `loop` (an instruction of `scope`): XLA's `known_trip_count`,
    else read from a loop `i = c; while i < n: ...; i = i + 1` (XLA:TPU's)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.text)
    if known:
      return int(known.group(1))
    condition = {i.name: i for i in self.computations[loop.attribute("condition")]}
    test = self.root(loop.attribute("condition"))
    if test.opcode != "compare" or "direction=LT" not in test.text:
      return None
    index, stop = (_through(condition, o) for o in test.operands)
    start = _through(scope, loop.operands[0])
    body = {i.name: i for i in self.computations[loop.attribute("body")]}
    step = _through(body, self.root(loop.attribute("body")).operands[k]) if (
        k := _element(index)) is not None else None
    if (stop is None or stop.opcode != "constant" or start is None or start.opcode != "tuple" or
        step is None or step.opcode != "add"):
      return None
    first = _through(scope, start.operands[k])
    increments = [_through(body, o) for o in step.operands]
    if first.opcode != "constant" or sorted(i.opcode for i in increments) != [
        "constant", "get-tuple-element"]:
      return None
    one = next(i for i in increments if i.opcode == "constant")
    counter = next(i for i in increments if i.opcode == "get-tuple-element")
    if _element(counter) != k or _constant(one) != 1:
      return None
    return max(0, _constant(stop) - _constant(first))


def control_flow_waits(platform: str) -> bool:
  """Whether a while of unknown trip count waits for the host at each trip, and a
  conditional once, on `platform` (see the module docstring)."""
  return platform != "tpu"


def _through(scope: dict[str, Instruction], name: str) -> Instruction | None:
  """The instruction whose value `name` carries, past copies, bitcasts and reshapes."""
  instruction = scope.get(name)
  while instruction is not None and instruction.opcode in _FOLLOWED:
    instruction = scope.get(instruction.operands[0])
  return instruction


def _element(instruction: Instruction | None) -> int | None:
  """k, where `instruction` is element k of its computation's parameter tuple."""
  if instruction is None or instruction.opcode != "get-tuple-element":
    return None
  return int(re.search(r"index=(\d+)", instruction.text).group(1))


def _constant(instruction: Instruction) -> int:
  return int(re.search(r" constant\((-?\d+)\)", instruction.text).group(1))


def _is_host_transfer(instruction: Instruction) -> bool:
  if instruction.opcode in ("send", "recv"):
    return "is_host_transfer=true" in instruction.text
  return (instruction.opcode in HOST_TRANSFERS or
          (instruction.opcode == "custom-call" and "callback" in instruction.text))


@dataclasses.dataclass(frozen=True)
class Loop:
  """One while loop of a program: its trip count (None: unknown) and what one iteration
  runs (body and condition)."""

  trip_count: int | None
  iteration: Counts


def find_loop(text: str, scope: str, *, platform: str = "gpu") -> Loop:
  """The while loop traced directly under the named scope `scope` (`jax.named_scope`:
  its op_name ends with `scope/while`) in the program whose optimized HLO is `text`,
  compiled for `platform`."""
  reader = _Reader(text, platform)
  for name, instructions in reader.computations.items():
    for instruction in instructions:
      if instruction.opcode == "while" and f'{scope}/while"' in instruction.text:
        iteration = Counts()
        iteration.add(reader.run(instruction.attribute("body"), True))
        iteration.add(reader.run(instruction.attribute("condition"), True))
        n = reader.trip_count(instruction, {i.name: i for i in instructions})
        return Loop(trip_count=n, iteration=iteration)
  raise ValueError(f"no while loop under the named scope {scope!r} in the HLO text")


def read(text: str, *, platform: str = "gpu") -> Counts:
  """The counts of one run of the program whose optimized HLO is `text`, compiled for
  `platform` ("gpu", "tpu"; a CPU's program is read as a GPU would run it)."""
  reader = _Reader(text, platform)
  return reader.run(reader.entry, False)
