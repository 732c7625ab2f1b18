"""An optimized HLO module's text (`compiled.as_text()`) as computations of instructions:
what `mdjax.hlo_report` (kernels, loops, copies) and `mdjax.hlo_products` (float32
products) read. A line of it, from an XLA:TPU program::

    %convolution.15 = bf16[2,3072]{1,0:T(2,128)(2,1)S(1)} convolution(%fusion.103, %fusion.102),
        dim_labels=bf_io->bf, operand_precision={highest,highest}, metadata={op_name="..."}
    name             type (layout, tiling, memory space)  opcode  operands   attributes
"""

from __future__ import annotations

import dataclasses
import math
import re

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}

_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
  """Bytes of an array of `dtype` ("bf16") and shape `dims`."""
  return BYTES.get(dtype, 4) * math.prod(dims)


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
  def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
    """The result's arrays as (dtype, dims): one, or a tuple's."""
    return [(dtype, tuple(int(d) for d in filter(None, dims.split(","))))
            for dtype, dims in _ARRAY.findall(self.type)]

  @property
  def operands(self) -> list[str]:
    """The names of the instructions it reads, in order."""
    inside = self.text.split(f" {self.opcode}(", 1)[1]
    depth, end = 1, 0
    for end, char in enumerate(inside):
      depth += {"(": 1, ")": -1}.get(char, 0)
      if depth == 0:
        break
    return re.findall(r"%([\w.\-]+)", inside[:end])

  @property
  def is_root(self) -> bool:
    return self.text.lstrip().startswith("ROOT ")

  @property
  def op_name(self) -> str:
    """The jax operation it came from (metadata), "" when the compiler made it."""
    found = re.search(r'op_name="([^"]*)"', self.text)
    return found.group(1) if found else ""


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
