"""ggml's quantized tensor blocks read as integers and per-group scales, never as floats.

A quantized GGUF tensor is a run of fixed-size blocks, each covering `block` consecutive
values of one row (ggml's rows: a weight's output features), so the blocks, and the
groups within them, run along the last (contracted, input) axis. `read_blocks` turns
the raw bytes into `Blocks`: small signed integers `q` [rows, cols] and, per group of
`group` columns, `scale` (and `offset`) [rows, cols // group] with

    value = q * scale + offset     (offset: None, i.e. 0, for the symmetric types)

which is what `gguf.quants.dequantize` computes, without the float32 copy of the
weight, so a kernel can keep the integers (int4 where `bits` is 4) and scale as it goes.

The layouts, in bytes (d, m, dmin: float16; everything little-endian; lo(b) = b & 15,
hi(b) = b >> 4; bit(x, i) = (x >> i) & 1), as `gguf/quants.py` reads them::

    Q8_0   34 B / 32 values      | d | qs: 32 x int8 |
           value[i] = d * qs[i]             q = qs[i]         scale = d        group 32, 8 bits
    Q4_0   18 B / 32             | d | qs: 16 B |
           n[j] = lo(qs[j]), n[j + 16] = hi(qs[j])   (j < 16)
           value = d * (n - 8)              q = n - 8         scale = d        group 32, 4 bits
    Q4_1   20 B / 32             | d | m | qs: 16 B |              n as Q4_0
           value = d * n + m                q = n - 8         scale = d
                                                              offset = m + 8d  group 32, 4 bits
    Q5_0   22 B / 32             | d | qh: uint32 | qs: 16 B |
           n[i] = (lo or hi nibble as Q4_0) | bit(qh, i) << 4   (i < 32)
           value = d * (n - 16)             q = n - 16        scale = d        group 32, 5 bits
    Q5_1   24 B / 32             | d | m | qh: uint32 | qs: 16 B |  n as Q5_0
           value = d * n + m                q = n - 16        scale = d
                                                              offset = m + 16d group 32, 5 bits

The K-quants: super-blocks of 256 values in sub-blocks (the groups) of 32 or 16::

    Q4_K  144 B / 256            | d | dmin | scales: 12 B | qs: 128 B |
           sub-blocks 2c, 2c + 1 (c < 4): the lo, hi nibbles n of qs[32c : 32c + 32]
           sc[s], mn[s] (s < 8): 6 bits each, in the 12 bytes as (bits 7-6 | bits 5-0)
              bytes 0-3    sc[4..7] bits 5-4 | sc[0..3]
              bytes 4-7    mn[4..7] bits 5-4 | mn[0..3]
              bytes 8-11   mn[4..7] bits 3-0 | sc[4..7] bits 3-0      (4 | 4 bits)
           value = (d * sc) * n - dmin * mn q = n - 8         scale = d * sc
                                                  offset = 8 * scale - dmin * mn   group 32, 4 bits
    Q5_K  176 B / 256            | d | dmin | scales: 12 B | qh: 32 B | qs: 128 B |
           n = (nibble as Q4_K) | bit(qh[j], s) << 4   (value j of sub-block s)
           value = (d * sc) * n - dmin * mn q = n - 16        scale = d * sc
                                                  offset = 16 * scale - dmin * mn  group 32, 5 bits
    Q6_K  210 B / 256            | ql: 128 B | qh: 64 B | scales: 16 x int8 | d |
           value 128h + 64k + j (j < 64): low 4 bits = nibble k of ql[64h + j]
           value 128h + 32k + j (j < 32): high 2 bits = bits 2k, 2k+1 of qh[32h + j]
           value = d * sc[g] * (n - 32)     q = n - 32        scale = d * sc   group 16, 6 bits
    Q3_K  110 B / 256            | hmask: 32 B | qs: 64 B | scales: 12 B | d |
           value 128h + 32k + j (j < 32): low = bits 2k, 2k+1 of qs[32h + j]
           value 32i + j (j < 32):        q = low - 4 where bit(hmask[j], i) is clear, else low
           sc[g] (g < 16), 6 bits: bits 3-0 = nibble g // 8 of scales[g % 8],
                                   bits 5-4 = bits 2(g // 4), +1 of scales[8 + g % 4]
           value = d * (sc - 32) * q        q in [-4, 3]      scale = d * (sc - 32)
                                                                               group 16, 3 bits
    Q2_K   84 B / 256            | scales: 16 B | qs: 64 B | d | dmin |
           value 128h + 32k + j (j < 32): n = bits 2k, 2k+1 of qs[32h + j]
           value = d * lo(scales[g]) * n - dmin * hi(scales[g])
                                            q = n - 2         scale = d * lo(scales[g])
                                                  offset = 2 * scale - dmin * hi(scales[g])
                                                                               group 16, 2 bits

The scales are computed in float32 as `gguf/quants.py` computes them (a float16 times a
small integer: exact). For the symmetric types q * scale is gguf's value bit for bit.
With an offset, gguf rounds once (`scale * n + m`), this form twice: the offset
(m + 8d and the like) is rounded when its two terms do not fit float32's 24 bits
together, so a value may differ by about an ulp of the group's largest value
(tests/test_gguf_blocks.py). The float types (F32, F16, BF16) are not blocks, and the
others are not read (the IQ types' codebooks and non-uniform grids, MXFP4's and NVFP4's
float codes, the ternary TQ types): `read_blocks` raises `CheckpointError` for them.

The tensor is decoded in steps of `CHUNK_VALUES` values, each step vectorized over its
blocks; `data` (a read-only view of the file, as `GGUFReader` gives it) is only read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gguf
import numpy as np

from mdjax.errors import CheckpointError

Q = gguf.GGMLQuantizationType
# Values decoded per step: the temporaries (a few bytes a value) stay small and in cache;
# Gemma 3's 262,144 x 640 Q8_0 embedding reads in 0.09 s (0.15 s in steps of 2 ** 14).
CHUNK_VALUES = 1 << 18


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A ggml tensor as integers and per-group scales: value = q * scale + offset, group by
  group along the last axis (columns [g * group, (g + 1) * group) share scale[:, g])."""

  q: np.ndarray  # int8 [rows, cols], within [-2 ** (bits - 1), 2 ** (bits - 1) - 1]
  scale: np.ndarray  # float32 [rows, cols // group]
  offset: np.ndarray | None  # float32 [rows, cols // group]; None for the symmetric types
  group: int  # columns per group
  bits: int  # 2, 3, 4, 5, 6 or 8: the signed bits q needs (4: it fits int4)


# A decoder: blocks [n, type_size] uint8 -> (q [n, block] int8, scale [n, groups] float32,
# offset [n, groups] float32 or None).
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


@dataclasses.dataclass(frozen=True)
class _Format:
  decode: Callable[[np.ndarray], Decoded]
  group: int
  bits: int
  symmetric: bool


# --------------------------------------------------------------------------- bit fields


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
  """The float16 at byte `at` of each block, as float32 [n, 1]."""
  return blocks[:, at:at + 2].view(np.float16).astype(np.float32)


def _nibbles(b: np.ndarray, width: int) -> np.ndarray:
  """[n, c * width] bytes -> [n, c * 2 * width]: per run of `width` bytes, its low
  nibbles, then its high ones."""
  runs = b.reshape(b.shape[0], -1, 1, width)
  return np.concatenate([runs & 15, runs >> 4], axis=2).reshape(b.shape[0], -1)


def _crumbs(b: np.ndarray, width: int) -> np.ndarray:
  """[n, c * width] bytes -> [n, c * 4 * width]: per run of `width` bytes, its bits 0-1,
  then 2-3, 4-5, 6-7."""
  runs = b.reshape(b.shape[0], -1, 1, width)
  shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
  return ((runs >> shifts) & 3).reshape(b.shape[0], -1)


def _bit_planes(b: np.ndarray) -> np.ndarray:
  """[n, width] bytes -> [n, 8 * width]: bit 0 of every byte, then bit 1, ... bit 7."""
  bits = np.unpackbits(b[:, :, None], axis=2, bitorder="little")  # [n, width, 8]
  return bits.transpose(0, 2, 1).reshape(b.shape[0], -1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K's and Q5_K's 12 bytes -> the 6-bit (sc, mn) of the 8 sub-blocks, [n, 8] each
  (gguf's `Q4_K.get_scale_min`)."""
  d, m, m_d = np.split(packed.reshape(-1, 3, 4), 3, axis=1)  # [n, 1, 4] each
  sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
  mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return sc.reshape(-1, 8), mn.reshape(-1, 8)


def _signed(n: np.ndarray, zero: int) -> np.ndarray:
  return n.view(np.int8) - np.int8(zero)  # n < 128


# --------------------------------------------------------------------------- decoders


def _q8_0(b: np.ndarray) -> Decoded:
  return b[:, 2:].view(np.int8), _f16(b, 0), None


def _q4_0(b: np.ndarray) -> Decoded:
  return _signed(_nibbles(b[:, 2:], 16), 8), _f16(b, 0), None


def _q4_1(b: np.ndarray) -> Decoded:
  d, m = _f16(b, 0), _f16(b, 2)
  return _signed(_nibbles(b[:, 4:], 16), 8), d, m + d * np.float32(8)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
  """Q5_0's and Q5_1's values: bit i of the little-endian uint32 qh is value i's 5th."""
  high = np.unpackbits(qh, axis=1, bitorder="little")  # [n, 32]
  return _nibbles(qs, 16) | (high << np.uint8(4))


def _q5_0(b: np.ndarray) -> Decoded:
  return _signed(_five_bits(b[:, 2:6], b[:, 6:]), 16), _f16(b, 0), None


def _q5_1(b: np.ndarray) -> Decoded:
  d, m = _f16(b, 0), _f16(b, 2)
  return _signed(_five_bits(b[:, 4:8], b[:, 8:]), 16), d, m + d * np.float32(16)


def _k_affine(b: np.ndarray, zero: int) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K's and Q5_K's (scale, offset) [n, 8]: value = scale * n - dmin * mn, with
  n - `zero` as q."""
  sc, mn = _k_scales(b[:, 4:16])
  scale = _f16(b, 0) * sc.astype(np.float32)
  return scale, scale * np.float32(zero) - _f16(b, 2) * mn.astype(np.float32)


def _q4_k(b: np.ndarray) -> Decoded:
  return (_signed(_nibbles(b[:, 16:], 32), 8),) + _k_affine(b, 8)


def _q5_k(b: np.ndarray) -> Decoded:
  n = _nibbles(b[:, 48:], 32) | (_bit_planes(b[:, 16:48]) << np.uint8(4))
  return (_signed(n, 16),) + _k_affine(b, 16)


def _q6_k(b: np.ndarray) -> Decoded:
  n = _nibbles(b[:, :128], 64) | (_crumbs(b[:, 128:192], 32) << np.uint8(4))
  return _signed(n, 32), _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32), None


def _q3_k(b: np.ndarray) -> Decoded:
  low = _crumbs(b[:, 32:96], 32).view(np.int8)
  q = low - ((_bit_planes(b[:, :32]) ^ np.uint8(1)) << np.uint8(2)).view(np.int8)
  lo = _nibbles(b[:, 96:104], 8)  # [n, 16]: the low 4 bits of sc[0..15]
  hi = _crumbs(b[:, 104:108], 4)  # [n, 16]: the high 2 bits
  sc = ((lo | (hi << np.uint8(4))).view(np.int8) - np.int8(32)).astype(np.float32)
  return q, _f16(b, 108) * sc, None


def _q2_k(b: np.ndarray) -> Decoded:
  scales = b[:, :16]
  scale = _f16(b, 80) * (scales & np.uint8(0x0F)).astype(np.float32)
  mins = _f16(b, 82) * (scales >> np.uint8(4)).astype(np.float32)
  return _signed(_crumbs(b[:, 16:80], 32), 2), scale, scale * np.float32(2) - mins


FORMATS = {
    Q.Q8_0: _Format(_q8_0, group=32, bits=8, symmetric=True),
    Q.Q4_0: _Format(_q4_0, group=32, bits=4, symmetric=True),
    Q.Q4_1: _Format(_q4_1, group=32, bits=4, symmetric=False),
    Q.Q5_0: _Format(_q5_0, group=32, bits=5, symmetric=True),
    Q.Q5_1: _Format(_q5_1, group=32, bits=5, symmetric=False),
    Q.Q2_K: _Format(_q2_k, group=16, bits=2, symmetric=False),
    Q.Q3_K: _Format(_q3_k, group=16, bits=3, symmetric=True),
    Q.Q4_K: _Format(_q4_k, group=32, bits=4, symmetric=False),
    Q.Q5_K: _Format(_q5_k, group=32, bits=5, symmetric=False),
    Q.Q6_K: _Format(_q6_k, group=16, bits=6, symmetric=True),
}
READABLE = frozenset(FORMATS)
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.F64})


# --------------------------------------------------------------------------- reading


def read_blocks(data: np.ndarray, qtype: gguf.GGMLQuantizationType,
                shape: tuple[int, int]) -> Blocks:
  """The tensor of ggml type `qtype` and numpy shape `shape` (rows, cols) whose raw bytes
  are `data` (`GGUFReader`'s `tensor.data`: uint8 [rows, cols // block * type_size], or
  the same bytes flat) as `Blocks`. `GGUFReader`'s `tensor.shape` is ggml's order, so
  `shape` is `tuple(reversed(tensor.shape.tolist()))`. Raises `CheckpointError` for a
  type not in `READABLE` or bytes that do not match `shape`."""
  fmt = check(data, qtype, shape)
  qtype = Q(qtype)  # the enum, also when given as its int
  block, type_size = gguf.GGML_QUANT_SIZES[qtype]
  rows, cols = (int(n) for n in shape)
  blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)  # [n, type_size]
  groups = block // fmt.group  # per block
  q = np.empty((blocks.shape[0], block), np.int8)
  scale = np.empty((blocks.shape[0], groups), np.float32)
  offset = None if fmt.symmetric else np.empty_like(scale)
  step = max(1, CHUNK_VALUES // block)
  for start in range(0, blocks.shape[0], step):  # chunks of many blocks, each vectorized
    part = slice(start, start + step)
    q[part], scale[part], chunk_offset = fmt.decode(blocks[part])
    if offset is not None:
      offset[part] = chunk_offset
  per_row = cols // fmt.group
  return Blocks(q=q.reshape(rows, cols), scale=scale.reshape(rows, per_row),
                offset=None if offset is None else offset.reshape(rows, per_row),
                group=fmt.group, bits=fmt.bits)


def check(data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> _Format:
  """The format `read_blocks` would read `data` with (its `group`, `bits` and whether it is
  `symmetric`), checked as `read_blocks` checks it, nothing decoded."""
  fmt = FORMATS.get(qtype)
  if fmt is None:
    raise CheckpointError(_unreadable(qtype))
  _check_shape(data, Q(qtype), shape, *gguf.GGML_QUANT_SIZES[Q(qtype)])
  return fmt


def _unreadable(qtype) -> str:
  try:
    name = Q(qtype).name
  except ValueError:
    name = f"unknown ggml type {qtype!r}"
  kind = " (a float type, not blocks)" if qtype in FLOAT_TYPES else ""
  readable = ", ".join(t.name for t in FORMATS)
  return f"cannot read {name} tensors as integer blocks{kind}; readable types: {readable}"


def _check_shape(data: np.ndarray, qtype: Q, shape, block: int, type_size: int) -> None:
  """`shape` checked against `qtype`'s block size and `data`'s bytes."""
  if len(shape) != 2:
    raise CheckpointError(f"read_blocks reads 2-D tensors (rows, cols), got shape {shape}")
  rows, cols = (int(n) for n in shape)
  if cols % block:
    raise CheckpointError(f"a {qtype.name} row holds whole blocks of {block} values, "
                          f"got shape {shape}")
  row_bytes = cols // block * type_size
  if data.nbytes != rows * row_bytes or (data.ndim == 2 and data.shape != (rows, row_bytes)):
    raise CheckpointError(f"{qtype.name} data of shape {data.shape} ({data.nbytes} bytes) is "
                          f"not a {rows} x {cols} tensor ({rows} x {row_bytes} bytes)")
