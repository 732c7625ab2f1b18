"""ggml's quantized blocks read as integers and scales (`mdjax.checkpoints.gguf_blocks`),
checked against `gguf.quants.dequantize` of the same bytes: blocks `gguf.quants.quantize`
writes, random blocks, and the real SmolLM2 and Gemma 3 files."""

from __future__ import annotations

import mmap
import pathlib
import struct

import gguf
import numpy as np
import pytest

from mdjax.checkpoints import gguf_blocks
from mdjax.checkpoints.gguf import find_gguf
from mdjax.checkpoints.gguf_blocks import READABLE, Blocks, read_blocks
from mdjax.errors import CheckpointError

Q = gguf.GGMLQuantizationType
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)  # what gguf.quants.quantize writes
# type -> (q's range, group, symmetric, the bytes of each block's float16 d / m / dmin),
# ggml's layouts stated independently of the module (gguf's dequantize confirms them)
EXPECTED = {
    Q.Q8_0: ((-128, 127), 32, True, (0,)),  # ggml's quantizer writes [-127, 127]
    Q.Q4_0: ((-8, 7), 32, True, (0,)),
    Q.Q4_1: ((-8, 7), 32, False, (0, 2)),
    Q.Q5_0: ((-16, 15), 32, True, (0,)),
    Q.Q5_1: ((-16, 15), 32, False, (0, 2)),
    Q.Q2_K: ((-2, 1), 16, False, (80, 82)),
    Q.Q3_K: ((-4, 3), 16, True, (108,)),
    Q.Q4_K: ((-8, 7), 32, False, (0, 2)),
    Q.Q5_K: ((-16, 15), 32, False, (0, 2)),
    Q.Q6_K: ((-32, 31), 16, True, (208,)),
}
# q * scale + offset rounds twice where gguf's `scale * n + m` rounds once: the offset
# (m + 8d, 8 * d * sc - dmin * mn, ...) is inexact when its terms' exponents lie far apart
# (often for the K-quants, whose d and dmin are independent; for Q4_1 and Q5_1 only when
# m and d do). The offset is at most its group's largest |value|, so the difference is at
# most about two float32 ulps of it: 2.4e-7 of the tensor's max |value|, well within this.
# The symmetric types round once (an exact product), so they match bit for bit.
TOLERANCE = 1e-6


def values(blocks: Blocks) -> np.ndarray:
  """q * scale + offset in float32, group by group: [rows, cols]."""
  rows, cols = blocks.q.shape
  grouped = blocks.q.reshape(rows, -1, blocks.group).astype(np.float32)
  out = grouped * blocks.scale[..., None]
  if blocks.offset is not None:
    out = out + blocks.offset[..., None]
  return out.reshape(rows, cols)


def check_matches_gguf(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> Blocks:
  """`read_blocks` of the bytes: its dtypes and shapes, and its values against gguf's."""
  blocks = read_blocks(data, qtype, shape)
  (low, high), group, symmetric, _ = EXPECTED[qtype]
  rows, cols = shape
  assert (blocks.group, blocks.offset is None) == (group, symmetric)
  assert blocks.q.dtype == np.int8 and blocks.q.shape == shape
  for array in (blocks.scale, blocks.offset)[:1 if symmetric else 2]:
    assert array.dtype == np.float32 and array.shape == (rows, cols // group)
  assert low <= blocks.q.min() and blocks.q.max() <= high
  assert -2 ** (blocks.bits - 1) <= low and high <= 2 ** (blocks.bits - 1) - 1  # q fits
  expected = gguf.quants.dequantize(data, qtype).reshape(shape)
  got = values(blocks)
  if symmetric:
    np.testing.assert_array_equal(got, expected)
  else:
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE * np.abs(expected).max())
  return blocks


def random_blocks(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
  """Random bytes [rows, row bytes] of `qtype`, its float16 fields random finite values
  from 1e-4 to 1 (either sign), so every bit pattern of the integers and scales occurs."""
  block, type_size = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
  for at in EXPECTED[qtype][3]:
    field = rng.uniform(-1, 1, (len(raw), 1)) * 10.0 ** rng.uniform(-4, 0, (len(raw), 1))
    raw[:, at:at + 2] = field.astype(np.float16).view(np.uint8)
  return raw.reshape(rows, -1)


def test_readable_types():
  assert READABLE == frozenset(EXPECTED)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_by_gguf(qtype):
  x = np.random.default_rng(int(qtype)).normal(size=(48, 512)).astype(np.float32)
  x[3] = 300 + 1e-3 * x[3]  # nearly constant: d is ~2 ** -25 of m, so m + 8d is rounded
  data = gguf.quants.quantize(x, qtype)
  blocks = check_matches_gguf(data, qtype, x.shape)
  if qtype in (Q.Q4_1, Q.Q5_1):  # the case TOLERANCE is for occurs
    assert (values(blocks)[3] != gguf.quants.dequantize(data, qtype)[3]).any()


@pytest.mark.parametrize("qtype", sorted(EXPECTED), ids=lambda t: t.name)
def test_random_blocks(qtype):
  rng = np.random.default_rng(int(qtype))
  data = random_blocks(qtype, 40, 768, rng)
  blocks = check_matches_gguf(data, qtype, (40, 768))
  assert (blocks.q.min(), blocks.q.max()) == EXPECTED[qtype][0]  # the whole range: bits is tight
  # the same bytes flat, and the rows read alone (a row is whole blocks)
  flat = read_blocks(data.reshape(-1), qtype, (40, 768))
  np.testing.assert_array_equal(flat.q, blocks.q)
  part = read_blocks(data[7:9], qtype, (2, 768))
  np.testing.assert_array_equal(part.q, blocks.q[7:9])
  np.testing.assert_array_equal(part.scale, blocks.scale[7:9])


def test_many_chunks(monkeypatch):
  """A tensor of more blocks than one decoding step reads as it does in one step."""
  rng = np.random.default_rng(1)
  data = random_blocks(Q.Q4_K, 9, 512, rng)
  whole = read_blocks(data, Q.Q4_K, (9, 512))
  monkeypatch.setattr(gguf_blocks, "CHUNK_VALUES", 4 * 256)  # 18 blocks: 5 steps, the last short
  chunked = read_blocks(data, Q.Q4_K, (9, 512))
  for a, b in [(whole.q, chunked.q), (whole.scale, chunked.scale), (whole.offset, chunked.offset)]:
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ4_NL, Q.F16, Q.F32, Q.BF16, 99],
                         ids=lambda t: getattr(t, "name", str(t)))
def test_unreadable_type_is_named(qtype):
  """The float types are not blocks (gguf's dequantize only views or casts them), and the
  IQ types' codebooks are not an integer times a scale: one line, naming the type and
  the ones read."""
  with pytest.raises(CheckpointError) as error:
    read_blocks(np.zeros(64, np.uint8), qtype, (1, 32))
  message = str(error.value)
  assert "\n" not in message
  assert getattr(qtype, "name", str(qtype)) in message
  assert all(t.name in message for t in READABLE)


def test_bytes_that_do_not_match_the_shape():
  data = gguf.quants.quantize(np.ones((32, 64), np.float32), Q.Q8_0)  # [32, 2 * 34]
  with pytest.raises(CheckpointError, match=r"Q8_0 data of shape \(32, 68\).*16 x 64"):
    read_blocks(data, Q.Q8_0, (16, 64))
  # ggml's order (cols, rows): as many bytes, in rows of another length
  with pytest.raises(CheckpointError, match=r"not a 64 x 32 tensor \(64 x 34 bytes\)"):
    read_blocks(data, Q.Q8_0, (64, 32))
  with pytest.raises(CheckpointError, match=r"Q8_0 row holds whole blocks of 32 values"):
    read_blocks(data, Q.Q8_0, (66, 33))
  with pytest.raises(CheckpointError, match=r"2-D"):
    read_blocks(data, Q.Q8_0, (32, 1, 64))
  assert read_blocks(data, int(Q.Q8_0), (32, 64)).q.shape == (32, 64)  # the type as its int


# --------------------------------------------------------------------------- real files

# GGUFReader parses every metadata value into numpy views: 10 to 17 s for Gemma 3's
# 262,144-token vocabulary. The tensors need only the header's tensor list, which a walk
# over the metadata finds in a fraction of a second (checked against GGUFReader below).
V = gguf.GGUFValueType
SIZES = {V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4,
         V.FLOAT32: 4, V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}


def _skip_value(buf, pos: int, kind: int) -> int:
  """The position after the metadata value of type `kind` at `pos`."""
  if kind == V.STRING:
    return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
  if kind == V.ARRAY:
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in SIZES:
      return pos + count * SIZES[item]
    for _ in range(count):
      pos = _skip_value(buf, pos, item)
    return pos
  return pos + SIZES[kind]


def _string(buf, pos: int) -> tuple[str, int]:
  (length,) = struct.unpack_from("<Q", buf, pos)
  return bytes(buf[pos + 8:pos + 8 + length]).decode(), pos + 8 + length


def tensor_table(path: pathlib.Path) -> dict[str, tuple[Q, tuple[int, ...], np.ndarray]]:
  """name -> (type, numpy shape, raw bytes: a read-only view of the file) of a GGUF v3."""
  with open(path, "rb") as f:
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  magic, _, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
  assert magic == b"GGUF"
  pos, alignment = 24, gguf.GGUF_DEFAULT_ALIGNMENT
  for _ in range(n_kv):
    key, pos = _string(buf, pos)
    (kind,) = struct.unpack_from("<I", buf, pos)
    if key == "general.alignment":
      (alignment,) = struct.unpack_from("<I", buf, pos + 4)
    pos = _skip_value(buf, pos + 4, kind)
  infos = []
  for _ in range(n_tensors):
    name, pos = _string(buf, pos)
    (n_dims,) = struct.unpack_from("<I", buf, pos)
    dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
    kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
    pos += 4 + 8 * n_dims + 12
    infos.append((name, Q(kind), tuple(reversed(dims)), offset))
  start = -(-pos // alignment) * alignment
  table = {}
  for name, kind, shape, offset in infos:
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    size = int(np.prod(shape)) // block * type_size
    table[name] = kind, shape, np.frombuffer(buf, np.uint8, size, start + offset)
  return table


def check_real_file(name: str, per_type: int = 3) -> dict[Q, list[str]]:
  """Checks the first `per_type` tensors (in file order) of each readable type in the
  real model `name`, a large one in its first rows (whole blocks: gguf's float32 copy of
  Gemma 3's 262,144 x 640 embedding costs seconds), and returns their names by type."""
  try:
    path = find_gguf(name)  # the file `mdjax.load(name)` reads
  except CheckpointError as e:
    pytest.skip(str(e))
  checked = {}
  for tensor, (qtype, shape, data) in tensor_table(path).items():
    if qtype in READABLE and len(checked.setdefault(qtype, [])) < per_type:
      all_rows, cols = int(np.prod(shape[:-1])), shape[-1]
      rows = min(all_rows, (1 << 22) // cols)
      check_matches_gguf(data.reshape(all_rows, -1)[:rows], qtype, (rows, cols))
      checked[qtype].append(tensor)
  return checked


def test_tensor_table_finds_what_gguf_reader_finds(tmp_path):
  """The header walk on a file `gguf.GGUFWriter` writes: metadata of every kind (string
  arrays, nested arrays, a custom alignment) skipped, every tensor's bytes found."""
  rng = np.random.default_rng(2)
  writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
  writer.add_custom_alignment(64)
  writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "déf"] * 50)
  writer.add_array("test.floats", [0.5, 1.5])
  writer.add_array("test.nested", [[1, 2], [3]])
  writer.add_string("test.name", "x" * 33)
  writer.add_bool("test.flag", True)
  writer.add_tensor("norm", rng.normal(size=48).astype(np.float32))
  for qtype in (Q.Q8_0, Q.Q4_1, Q.Q6_K):
    writer.add_tensor(qtype.name, random_blocks(qtype, 3, 512, rng), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  reader, table = gguf.GGUFReader(tmp_path / "t.gguf"), tensor_table(tmp_path / "t.gguf")
  assert list(table) == [t.name for t in reader.tensors] == ["norm", "Q8_0", "Q4_1", "Q6_K"]
  for t in reader.tensors:
    qtype, shape, data = table[t.name]
    assert (qtype, shape) == (t.tensor_type, tuple(reversed(t.shape.tolist())))
    np.testing.assert_array_equal(data, t.data.reshape(-1).view(np.uint8))


@pytest.mark.real_models
def test_real_smollm2():
  checked = check_real_file("smollm2-135m-instruct")
  assert {t: len(names) for t, names in checked.items()} == {Q.Q8_0: 1, Q.Q4_1: 3}


@pytest.mark.real_models
def test_real_gemma3():
  checked = check_real_file("gemma3-270m")
  assert {t: len(names) for t, names in checked.items()} == {
      Q.Q8_0: 3, Q.Q5_0: 3, Q.Q4_K: 3, Q.Q6_K: 3}
  # the whole 262,144 x 640 embedding (0.1 s; gguf's float32 copy: 3.6 s) as its rows read
  qtype, shape, data = tensor_table(find_gguf("gemma3-270m"))["token_embd.weight"]
  whole, last = read_blocks(data, qtype, shape), read_blocks(data[-680:], qtype, (1, 640))
  assert (qtype, shape, whole.q.shape, whole.scale.shape) == (
      Q.Q8_0, (262144, 640), (262144, 640), (262144, 20))
  np.testing.assert_array_equal(whole.q[-1:], last.q)
  np.testing.assert_array_equal(whole.scale[-1:], last.scale)
