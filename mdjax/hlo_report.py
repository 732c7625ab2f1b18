"""What a compiled program does on its device, read from its optimized HLO text
(`compiled.as_text()`): the kernels it launches, the loops that wait for the host, the
bytes it copies inside loops and the precision of its float32 products.

    counts = hlo_report.read(compiled.as_text())
    counts.kernels        # kernels launched by one run of the program
    counts.host_syncs     # while loops of unknown trip count (each iteration asks the host)
                          # and conditionals (the host reads which branch runs)
    counts.loop_copies    # bytes copied inside loops (weights sliced out of a layer stack,
                          # a layer's K/V copied out of the cache), per run
    counts.f32_products   # float32 products by precision ("default" on a GPU is TF32)

How a run is counted, computation by computation from ENTRY::

    instruction                          kernels
    fusion, custom-call (cuBLAS, cuDNN),  1 each
      copy, any other compute op
    while with known_trip_count n        n x body + (n + 1) x condition
    while of unknown trip count          body + condition once, and one host sync
    conditional                          its costliest branch, the predicate's read,
                                           and one host sync
    call                                 its callee
    parameter, constant, tuple, get-tuple-element, bitcast...   0 (no kernel)

A copy inside a loop is a `copy`, or a fusion whose result is a `dynamic-slice` of an
operand (a slice materialised before its consumer rather than read in place).
"""

from __future__ import annotations

import collections
import dataclasses
import re

NO_KERNEL = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                       "after-all", "opt-barrier", "add-dependency", "partition-id",
                       "replica-id", "domain", "while", "conditional", "call", "iota"})
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}

_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  type: str  # "bf16[2,2048]{1,0}" or a tuple of them
  opcode: str
  text: str  # the whole line: operands and attributes

  def attribute(self, key: str) -> str | None:
    """The computation named by `key=%name` (calls, body, condition, to_apply)."""
    found = re.search(rf"\b{key}=%([\w.\-]+)", self.text)
    return found and found.group(1)

  @property
  def bytes(self) -> int:
    """Bytes of the (array or tuple) result."""
    return sum(BYTES.get(dtype, 4) * _product(dims) for dtype, dims in _ARRAY.findall(self.type))


def _product(dims: str) -> int:
  total = 1
  for d in filter(None, dims.split(",")):
    total *= int(d)
  return total


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """The computations of an HLO module, by name, and the name of its ENTRY."""
  computations, current, entry = {}, None, None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header and not line.startswith(" "):
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and (found := _INSTRUCTION.match(line)):
      computations[current].append(Instruction(*found.groups()[:3], text=line))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


@dataclasses.dataclass
class Counts:
  """One run of a program (see the module docstring)."""

  kernels: int = 0
  kernels_by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  host_syncs: int = 0
  loop_copies: int = 0  # bytes
  loop_copy_shapes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  loops: list = dataclasses.field(default_factory=list)  # (trip count or None, kernels per trip)
  f32_products: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def add(self, other: "Counts", times: int = 1) -> None:
    self.kernels += times * other.kernels
    self.host_syncs += times * other.host_syncs
    self.loop_copies += times * other.loop_copies
    for key, n in other.kernels_by_kind.items():
      self.kernels_by_kind[key] += times * n
    for key, n in other.loop_copy_shapes.items():
      self.loop_copy_shapes[key] += times * n
    self.loops.extend(other.loops)

  def to_json(self) -> dict:
    return dict(kernels=self.kernels, kernels_by_kind=dict(self.kernels_by_kind),
                host_syncs=self.host_syncs, loop_copy_bytes=self.loop_copies,
                loop_copy_shapes=dict(self.loop_copy_shapes.most_common(8)),
                loops=[dict(trip_count=t, kernels_per_trip=k) for t, k in self.loops],
                f32_products=dict(self.f32_products))


class _Reader:
  def __init__(self, text: str):
    self.computations, self.entry = parse(text)
    self.memo: dict[tuple[str, bool], Counts] = {}

  def is_slice_fusion(self, instruction: Instruction) -> bool:
    callee = self.computations.get(instruction.attribute("calls") or "", [])
    roots = [i for i in callee if i.text.lstrip().startswith("ROOT")]
    return bool(roots) and roots[0].opcode == "dynamic-slice"

  def run(self, name: str, in_loop: bool) -> Counts:
    key = (name, in_loop)
    if key not in self.memo:
      self.memo[key] = self._run(name, in_loop)
    return self.memo[key]

  def _run(self, name: str, in_loop: bool) -> Counts:
    counts = Counts()
    for instruction in self.computations[name]:
      op = instruction.opcode
      if op == "while":
        body = self.run(instruction.attribute("body"), True)
        condition = self.run(instruction.attribute("condition"), True)
        n = _trip_count(instruction)
        if n is not None:
          counts.add(body, n)
          counts.add(condition, n + 1)
        else:
          counts.add(body)
          counts.add(condition)
          counts.host_syncs += 1
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
        counts.host_syncs += 1  # XLA:GPU copies the predicate to the host and waits for it
      elif op == "call":
        counts.add(self.run(instruction.attribute("to_apply"), in_loop))
      elif op not in NO_KERNEL:
        kind = re.search(r"kind=(k\w+)", instruction.text)
        counts.kernels += 1
        counts.kernels_by_kind[op + (f":{kind.group(1)}" if kind else "")] += 1
        if in_loop and (op == "copy" or (op == "fusion" and self.is_slice_fusion(instruction))):
          counts.loop_copies += instruction.bytes
          counts.loop_copy_shapes[instruction.type.split("{")[0]] += 1
    return counts

  def f32_products(self) -> collections.Counter:
    """Every float32 dot in the module (fused ones included) by its precision."""
    found = collections.Counter()
    for instructions in self.computations.values():
      types = {i.name: i.type for i in instructions}
      for instruction in instructions:
        is_gemm = instruction.opcode == "custom-call" and "gemm" in instruction.text.lower()
        if instruction.opcode != "dot" and not is_gemm:
          continue
        operands = re.findall(r"%([\w.\-]+)", instruction.text.split("(", 1)[1])[:2]
        if not all(types.get(o, "").startswith("f32") for o in operands):
          continue
        algorithm = re.search(r"algorithm=(\w+)", instruction.text)
        precision = re.search(r"operand_precision=\{([^}]*)\}", instruction.text)
        found[algorithm.group(1) if algorithm else
              precision.group(1) if precision else "default"] += 1
    return found


@dataclasses.dataclass(frozen=True)
class Loop:
  """One while loop of a program: its trip count (None: unknown, a host sync per
  iteration) and what one iteration runs (body and condition)."""

  trip_count: int | None
  iteration: Counts


def find_loop(text: str, scope: str) -> Loop:
  """The while loop traced directly under the named scope `scope` (`jax.named_scope`:
  its op_name ends with `scope/while`) in the program whose optimized HLO is `text`."""
  reader = _Reader(text)
  for instructions in reader.computations.values():
    for instruction in instructions:
      if instruction.opcode == "while" and f'{scope}/while"' in instruction.text:
        iteration = Counts()
        iteration.add(reader.run(instruction.attribute("body"), True))
        iteration.add(reader.run(instruction.attribute("condition"), True))
        return Loop(trip_count=_trip_count(instruction), iteration=iteration)
  raise ValueError(f"no while loop under the named scope {scope!r} in the HLO text")


def _trip_count(instruction: Instruction) -> int | None:
  trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.text)
  return int(trip.group(1)) if trip else None


def read(text: str) -> Counts:
  """The counts of one run of the program whose optimized HLO is `text`."""
  reader = _Reader(text)
  counts = reader.run(reader.entry, False)
  counts.f32_products = reader.f32_products()
  return counts
