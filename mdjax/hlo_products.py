"""The precision of every float32 product in a compiled program: each matrix product
(`dot`, `convolution`, a cuBLAS gemm) of its optimized HLO text whose operands or
result are float32, with what its platform computes it in. `mdjax.models.numerics`
asks for full float32 wherever an operand is float32; this is where a user sees
whether the compiler kept it.

    for product in hlo_products.float32_products(compiled.as_text(), platform="tpu"):
      product.arithmetic   # "float32", "tf32", "bf16_3x", "bf16" (one bfloat16 pass),
                           # or "exact" (bfloat16 operands, float32 result)
      product.loses_precision

What each platform computes a product with a float32 operand in, by its precision
(`operand_precision={...}`, or an explicit `algorithm=`, which wins)::

    precision   GPU (Ampere on)   TPU              CPU
    default     tf32              bf16 (1 pass)    float32
    high        tf32              bf16_3x          float32
    highest     float32           float32          float32

A product of bfloat16 (or narrower) operands is exact in any of them: each term is
exact in float32, the sum accumulated there (`mdjax.models.numerics.linear`).
"""

from __future__ import annotations

import collections
import dataclasses
import re

from mdjax.hlo_text import Instruction, parse

LOSSLESS = frozenset({"float32", "exact"})
_BY_PRECISION = {
    "gpu": {"default": "tf32", "high": "tf32", "highest": "float32"},
    "tpu": {"default": "bf16", "high": "bf16_3x", "highest": "float32"},
    "cpu": {"default": "float32", "high": "float32", "highest": "float32"},
}
_ALGORITHMS = {"dot_tf32_tf32_f32": "tf32", "dot_tf32_tf32_f32_x3": "tf32_3x",
               "dot_bf16_bf16_f32": "bf16", "dot_bf16_bf16_f32_x3": "bf16_3x",
               "dot_bf16_bf16_f32_x6": "bf16_6x", "dot_bf16_bf16_f32_x9": "bf16_9x",
               "dot_f32_f32_f32": "float32"}


@dataclasses.dataclass(frozen=True)
class Product:
  """One float32 matrix product of a program (a product in a loop body counts once)."""

  name: str  # the HLO instruction
  op_name: str  # the jax operation it came from ("jit(decode_step)/.../dot_general")
  operands: tuple[str, ...]  # their dtypes: ("f32", "bf16")
  result: str  # "f32[1,32000]"
  precision: str  # "default", "high", "highest" or the algorithm named
  arithmetic: str  # what the platform computes it in (see the module docstring)

  @property
  def loses_precision(self) -> bool:
    return self.arithmetic not in LOSSLESS

  def to_json(self) -> dict:
    return dict(dataclasses.asdict(self), loses_precision=self.loses_precision)


def float32_products(text: str, *, platform: str = "gpu") -> list[Product]:
  """Every matrix product of the optimized HLO `text` (fused ones included) whose
  operands or result are float32, as `platform` ("gpu", "tpu", "cpu") computes it."""
  computations, _ = parse(text)
  found = []
  for instructions in computations.values():
    dtypes = {i.name: i.type.split("[")[0].lstrip("(") for i in instructions}
    for instruction in instructions:
      if not _is_product(instruction):
        continue
      operands = tuple(dtypes.get(o, "?") for o in instruction.operands[:2])
      result = instruction.type.lstrip("(").split("{")[0]
      if "f32" in operands or result.startswith("f32"):
        precision = _precision(instruction)
        found.append(Product(name=instruction.name, op_name=instruction.op_name,
                             operands=operands, result=result, precision=precision,
                             arithmetic=_arithmetic(platform, precision, operands)))
  return found


def summary(products: list[Product]) -> dict[str, int]:
  """How many products compute in each arithmetic: {"float32": 3, "exact": 97}."""
  return dict(collections.Counter(p.arithmetic for p in products))


def grouped(products: list[Product]) -> list[dict]:
  """The products, one entry per (jax operation, operand dtypes, precision, arithmetic)
  with how many instructions share it (an unrolled layer loop repeats each product)."""
  keys = collections.Counter((p.op_name, p.operands, p.precision, p.arithmetic,
                              p.loses_precision) for p in products)
  return [dict(op_name=o, operands=list(d), precision=p, arithmetic=a, loses_precision=l,
               count=n) for (o, d, p, a, l), n in keys.items()]


def _is_product(instruction: Instruction) -> bool:
  """A dot, a convolution (XLA:TPU's products), or a library's matrix product (cuBLAS'
  `__cublas$gemm`, `__cublas$lt$matmul`), not another call reading one's result."""
  if instruction.opcode in ("dot", "convolution"):
    return True
  target = re.search(r'custom_call_target="([^"]*)"', instruction.text)
  return bool(target) and any(k in target.group(1).lower() for k in ("gemm", "matmul"))


def _precision(instruction: Instruction) -> str:
  """The instruction's algorithm when it names one, else its operands' precision."""
  algorithm = (re.search(r"algorithm=(\w+)", instruction.text) or
               re.search(r'"algorithm":"ALG_(\w+)"', instruction.text))
  if algorithm and algorithm.group(1).lower() != "unset":
    return algorithm.group(1).lower()
  precision = (re.search(r"operand_precision=\{(\w+)", instruction.text) or
               re.search(r'"operand_precision":\["(\w+)"', instruction.text))
  return precision.group(1).lower() if precision else "default"


def _arithmetic(platform: str, precision: str, operands: tuple[str, ...]) -> str:
  if "f32" not in operands:
    return "exact"
  if precision in _ALGORITHMS:
    return _ALGORITHMS[precision]
  return _BY_PRECISION[platform].get(precision, precision)
