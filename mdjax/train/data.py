"""Training data: a folder of text files, split by file, packed into rows of tokens.

Files: by default the running interpreter's standard library (every machine has one),
its `*.py` files, recursively, `site-packages` excluded. Files that are not UTF-8 are
skipped; the list is sorted. The held-out split is by file: the `ceil(fraction * n)`
files with the smallest sha256 of their relative path, so it is the same for everyone
holding the same files, and no held-out file gives a training token.

Rows: the files' tokens, EOS after each file, cut into rows of `seq_len + 1` tokens that
overlap by one (inputs `[:-1]`, targets `[1:]`). The batch of step i is a pure function
of (seed, i) (`Batches`): a resumed run needs no iterator state. A stable share of the
rows teach copying instead (`RowMix`)::

    plain                a0 a1 a2 a3 a4 a5 a6 ...            the text as it is
    copy                 a0 .. a(p-1) a0 .. a(p-1) a0 ...    its first p tokens over and over
    copy, shown twice    a0 .. a(p-1) a0 .. a(p-1) b0 .. b(q-1) b0 .. b(q-1) ...
                                                             (b0 = a(p): chunks of the text)
    random               B B B B ...                         B: a block of 8..64 random ids
    random, shown twice  B B C C D D ...                     a fresh block after each pair
    common ids           A , n B = n C , n | A , n ...       in random blocks: 2..8 ids that
                                                             recur among rare ones

p and q are h = ceil((seq_len + 1) / 2), or drawn from `copy_min_period`..h per row (per
chunk). Only an induction mechanism (find the earlier occurrence of the current id, copy
what followed it) predicts the repeat of random ids. What each kind of row did to the
shipped models: `docs/shipped_models.md`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import pathlib
import sysconfig

import jax
import numpy as np

from mdjax.errors import MdjaxError

EXCLUDED_DIRS = ("site-packages", "__pycache__")
FIRST_RANDOM_ID = 3  # random rows skip the special tokens (<bos>, <eos>, <pad>)


class Stream(enum.IntEnum):
  """The numpy random streams of one sample's row: `row_rng(seed, sample, stream)`.

  The values are part of every run's batches (changing one changes what a seed trains
  on), so they never change; 2, 3 and 5 were drawn by kinds of rows since retired.
  """

  COPY_PERIOD = 1  # the length of the prefix a copy row repeats
  COMMON_IDS = 4  # a random row's common ids and the positions they take
  CHUNK_LENGTHS = 6  # the lengths of the chunks a copy row shows twice each


def row_rng(seed: int, sample: int, stream: Stream | None = None) -> np.random.Generator:
  """The generator of `stream` for sample `sample` of a run seeded `seed`; `None`: the
  stream of a random row's ids."""
  return np.random.default_rng([seed, sample] if stream is None else [seed, sample, int(stream)])


def stdlib_dir() -> pathlib.Path:
  """The running interpreter's standard library folder."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The files of `root` (paths relative to it, posix style) split by file."""

  root: pathlib.Path
  train: tuple[str, ...]
  heldout: tuple[str, ...]

  def texts(self, split: str) -> list[str]:
    """The contents of every file of `split` ("train" or "heldout"), in list order."""
    if split not in ("train", "heldout"):
      raise MdjaxError(f"split must be 'train' or 'heldout', got {split!r}")
    return [(self.root / name).read_text(encoding="utf-8") for name in getattr(self, split)]


def list_files(root: pathlib.Path, pattern: str) -> list[str]:
  """Sorted relative paths of the UTF-8 files under `root` matching `pattern`."""
  names = []
  for path in root.rglob(pattern):
    relative = path.relative_to(root)
    if not path.is_file() or any(part in EXCLUDED_DIRS for part in relative.parts):
      continue
    try:
      path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
      continue
    names.append(relative.as_posix())
  return sorted(names)


def heldout_rank(name: str) -> int:
  """The stable hash that orders files for the held-out choice."""
  return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")


def split_files(names: list[str], heldout_fraction: float) -> tuple[list[str], list[str]]:
  """(train, heldout): the `ceil(fraction * n)` smallest-hash files are held out."""
  if not 0 < heldout_fraction < 1:
    raise MdjaxError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
  count = math.ceil(heldout_fraction * len(names))
  if len(names) < 2 or count >= len(names):
    raise MdjaxError(f"need at least one training and one held-out file, got {len(names)} files "
                     f"with heldout_fraction={heldout_fraction}")
  heldout = set(sorted(names, key=heldout_rank)[:count])
  return [n for n in names if n not in heldout], [n for n in names if n in heldout]


def load_corpus(data_dir: str = "", pattern: str = "*.py",
                heldout_fraction: float = 0.05) -> Corpus:
  """The corpus of `data_dir` (empty: the standard library)."""
  root = pathlib.Path(data_dir) if data_dir else stdlib_dir()
  if not root.is_dir():
    raise MdjaxError(f"data_dir {str(root)!r} is not a directory")
  names = list_files(root, pattern)
  if not names:
    raise MdjaxError(f"no UTF-8 files matching {pattern!r} under {str(root)!r}")
  train, heldout = split_files(names, heldout_fraction)
  return Corpus(root=root, train=tuple(train), heldout=tuple(heldout))


def recorded_heldout_texts(model_dir) -> list[str]:
  """The held-out files recorded beside an exported model (`heldout_files.json`), read
  from the recorded root, or this interpreter's standard library when that is gone."""
  record = json.loads((pathlib.Path(model_dir) / "heldout_files.json").read_text())
  root = pathlib.Path(record["root"])
  root = root if root.is_dir() else stdlib_dir()
  return [(root / name).read_text(encoding="utf-8") for name in record["heldout"]
          if (root / name).is_file()]


def token_stream(texts: list[str], tokenizer, eos_id: int) -> np.ndarray:
  """int32 `[N]`: every text's tokens followed by `eos_id`, concatenated.

  `tokenizer` is a `tokenizers.Tokenizer` (the fast backend, batch-encoded in Rust).
  """
  encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
  pieces = []
  for encoding in encodings:
    pieces += [np.asarray(encoding.ids, np.int32), np.asarray([eos_id], np.int32)]
  return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
  """`[num_sequences, seq_len + 1]` windows of `stream` with stride `seq_len`.

  Sequence j covers stream[j * seq_len : (j + 1) * seq_len + 1]; the tail that does
  not fill a window is dropped.
  """
  if seq_len < 1:
    raise MdjaxError(f"seq_len must be >= 1, got {seq_len}")
  count = (len(stream) - 1) // seq_len
  if count < 1:
    raise MdjaxError(f"{len(stream)} tokens do not fill one sequence of seq_len={seq_len}")
  starts = np.arange(count)[:, None] * seq_len  # [count, 1]
  return stream[starts + np.arange(seq_len + 1)[None, :]]  # [count, seq_len + 1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowMix:
  """Which share of the rows teach copying, and how (the trainer's config options of the
  same names; see the module docstring). The default is plain rows only."""

  copy_fraction: float = 0.0  # share of copy rows
  copy_min_period: int = 0  # > 0: copy rows repeat prefixes of this many..h tokens; 0: of h
  copy_shown_twice: bool = False  # copy rows show chunks of such lengths twice each
  random_copy_fraction: float = 0.0  # share of random rows
  random_copy_common_share: float = 0.0  # share of a random block's positions on common ids
  random_copy_shown_twice: bool = False  # random rows show fresh blocks twice each

  def check(self, width: int) -> None:
    """Raises `MdjaxError` naming an option that rows of `width` tokens cannot take."""
    fractions = {"copy_fraction": self.copy_fraction,
                 "random_copy_fraction": self.random_copy_fraction}
    for name, value in fractions.items():
      if not 0 <= value <= 1:
        raise MdjaxError(f"{name} must be in [0, 1], got {value}")
    if sum(fractions.values()) > 1:
      raise MdjaxError(f"{' + '.join(fractions)} must sum to <= 1, got "
                       f"{' + '.join(str(v) for v in fractions.values())}")
    if not 0 <= self.random_copy_common_share < 1:
      raise MdjaxError(f"random_copy_common_share must be in [0, 1), got "
                       f"{self.random_copy_common_share}")
    half = first_half(width)
    if not 0 <= self.copy_min_period <= half:
      raise MdjaxError(f"copy_min_period must be in [0, {half}] (0: always the first half of "
                       f"the {width}-token rows), got {self.copy_min_period}")

  @classmethod
  def from_config(cls, config) -> RowMix:
    """The mix a trainer config (`configs/lm_common.py`, typed or not) asks for."""
    return cls(**{field.name: getattr(config, field.name) for field in dataclasses.fields(cls)})


class Batches:
  """`batch(step)`: int32 `[batch_size, seq_len + 1]`, a pure function of (seed, step).

  Sample `i = step * batch_size + j` is sequence `perm_e[i mod n]` of epoch
  `e = i // n`, with `perm_e` a permutation drawn from `fold_in(key(seed), e)`. A fixed
  hash of i says whether it becomes a copy row, a random row (shares of `mix`) or stays
  plain; the row's own draws come from `row_rng(seed, i, ...)`.
  """

  def __init__(self, sequences: np.ndarray, batch_size: int, seed: int,
               mix: RowMix = RowMix(), vocab_size: int = 0):
    if batch_size < 1:
      raise MdjaxError(f"batch_size must be >= 1, got {batch_size}")
    mix.check(sequences.shape[1])
    if mix.random_copy_fraction and vocab_size <= FIRST_RANDOM_ID:
      raise MdjaxError(f"random copy rows need the vocabulary size, got {vocab_size}")
    self.mix = mix
    self.sequences = sequences
    self.batch_size = batch_size
    # a sample's share in [0, e0): a copy row, [e0, e1): a random row, [e1, 1): plain
    self.kind_edges = np.cumsum([mix.copy_fraction, mix.random_copy_fraction])  # [2]
    self.vocab_size = vocab_size
    self.seed = seed
    self.key = jax.random.key(seed)
    self._permutations: dict[int, np.ndarray] = {}

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._permutations:
      self._permutations = {epoch: np.asarray(jax.random.permutation(
          jax.random.fold_in(self.key, epoch), len(self.sequences)))}
    return self._permutations[epoch]

  def batch(self, step: int, rows: slice = slice(None)) -> np.ndarray:
    """Batch `step`, or only its `rows` (a process's part of it: `devices.shard_batch`)."""
    n = len(self.sequences)
    samples = step * self.batch_size + np.arange(self.batch_size)[rows]  # [B] (or the rows')
    rows = [self._permutation(int(i) // n)[int(i) % n] for i in samples]
    batch = self.sequences[rows]  # [B, T + 1], a copy
    share = _unit_hash(samples)  # [B] in [0, 1): which kind of row each sample is
    kind = np.searchsorted(self.kind_edges, share, side="right")  # [B]: 0 copy, 1 random, 2 plain
    for row in np.flatnonzero(kind == 0):
      batch[row] = self._copy_row(batch[row], int(samples[row]))
    for row in np.flatnonzero(kind == 1):
      batch[row] = random_repeats(self.seed, int(samples[row]), batch.shape[1], self.vocab_size,
                                  self.mix.random_copy_common_share,
                                  self.mix.random_copy_shown_twice)
    return batch

  def _copy_row(self, row: np.ndarray, sample: int) -> np.ndarray:
    """`[T]` -> `[T]`: a prefix over and over, or chunks shown twice each."""
    if not self.mix.copy_shown_twice:
      return repeat_prefix(row, self._draw_period(row_rng(self.seed, sample, Stream.COPY_PERIOD)))
    rng, lengths = row_rng(self.seed, sample, Stream.CHUNK_LENGTHS), []
    while 2 * sum(lengths) < len(row):
      lengths.append(self._draw_period(rng))
    return chunks_shown_twice(row, lengths)

  def _draw_period(self, rng: np.random.Generator) -> int:
    """h, or drawn from m..h by `rng` (m = `copy_min_period`)."""
    half = first_half(self.sequences.shape[1])
    m = self.mix.copy_min_period
    return int(rng.integers(m, half + 1)) if m else half


def first_half(width: int) -> int:
  """How many tokens a copy row of `width` tokens shows before repeating them: ceil(width / 2)."""
  return (width + 1) // 2


def repeat_prefix(rows: np.ndarray, period: int) -> np.ndarray:
  """`[..., T]` -> `[..., T]`: each row's first `period` tokens, repeated to fill T."""
  return rows[..., np.arange(rows.shape[-1]) % period]


def chunks_shown_twice(row: np.ndarray, lengths: list[int]) -> np.ndarray:
  """`[T]` -> `[T]`: the row's consecutive chunks of `lengths` tokens, each shown twice, cut
  to T (`copy_shown_twice`)::

      row:    a b c d e f g ...      lengths: 2, 3
      result: a b a b c d e c d e    (then f g ... if the lengths fall short of T)
  """
  ends = np.cumsum(lengths)
  pieces = [row[end - length:end] for end, length in zip(ends, lengths) for _ in range(2)]
  return np.concatenate([*pieces, row[ends[-1]:]])[:len(row)].astype(row.dtype)


def repeat_first_half(sequences: np.ndarray) -> np.ndarray:
  """`[N, T]` -> `[N, T]`: the first `ceil(T / 2)` tokens, then them again (cut to T)."""
  return repeat_prefix(sequences, first_half(sequences.shape[1]))


def random_repeats(seed: int, sample: int, length: int, vocab_size: int,
                   common_share: float = 0.0, shown_twice: bool = False) -> np.ndarray:
  """`[length]`: a block of 8..64 random ids drawn from (seed, sample), repeated.

  `common_share` = p > 0 puts one of 2..8 common ids at each position with probability
  p (`with_common_ids`). `shown_twice`: each block is shown twice, then a fresh block
  follows::

      shown_twice=False:  B B B B B B ...
      shown_twice=True:   B B C C D D ...   (B, C, D of 8..64 ids each)
  """
  rng = row_rng(seed, sample)
  common_rng = row_rng(seed, sample, Stream.COMMON_IDS)
  ids = np.arange(FIRST_RANDOM_ID, vocab_size)

  def block() -> np.ndarray:  # [8..64]
    drawn = ids[rng.integers(0, len(ids), rng.integers(8, 65))]
    return with_common_ids(common_rng, drawn, vocab_size, common_share) if common_share else drawn

  if not shown_twice:
    return np.resize(block(), length).astype(np.int32)
  pieces = []
  while sum(map(len, pieces)) < length:
    pieces += [block()] * 2
  return np.concatenate(pieces)[:length].astype(np.int32)


def with_common_ids(rng: np.random.Generator, block: np.ndarray, vocab_size: int,
                    share: float) -> np.ndarray:
  """`[L]` -> `[L]`: each position, with probability `share`, replaced by one of 2..8
  common ids drawn from `rng` (a copy)::

      tokens: A , n B = n C , n     (common ids ",", "=", "n")
      after "n" come B, C and A: only "A ,", "B =" or "C ," before it says which
  """
  common = random_alphabet(rng, vocab_size, rng.integers(2, 9))
  at = np.flatnonzero(rng.random(len(block)) < share)
  block = block.copy()
  block[at] = common[rng.integers(0, len(common), len(at))]
  return block


def with_phrases(rng: np.random.Generator, block: np.ndarray, vocab_size: int,
                 rate: float) -> np.ndarray:
  """`[L]` -> `[L]`: 1..3 phrases of 2..4 ids drawn from `rng`; at each position, with
  chance `rate`, one of them written over the ids from there (cut at the block's end),
  and the next phrase at the earliest one id after it (a copy)::

      block:   a b c d e f g h        phrases: P Q, X Y Z
      result:  P Q c X Y Z g h        (phrases start at 0 and 3, none at 7; c and g stay)

  After a phrase only a match longer than it says where a copy goes on.
  """
  phrases = [random_alphabet(rng, vocab_size, rng.integers(2, 5))
             for _ in range(rng.integers(1, 4))]
  block, at = block.copy(), 0
  while at < len(block):
    if rng.random() < rate:
      phrase = phrases[rng.integers(len(phrases))][:len(block) - at]
      block[at:at + len(phrase)] = phrase
      at += len(phrase)
    at += 1
  return block


def match_needed(seen: np.ndarray, longest: int = 32) -> int:
  """How many of the last ids of `seen` `[T]` a copy must match to know where to copy the
  next one from: the least n whose last n ids occur at most once before (ending earlier);
  `longest` + 1 if no n up to `longest` does::

      seen:  a b c a b d | a b c a b        (a block, then its repeat so far)
      "b" and "a b" occur 3 times before, "c a b" once: 3 (the next id, d, follows it)
  """
  earlier = seen[:-1]
  for n in range(1, min(longest, len(earlier)) + 1):
    windows = np.lib.stride_tricks.sliding_window_view(earlier, n)  # [T - n, n]
    if np.count_nonzero((windows == seen[-n:]).all(axis=1)) <= 1:
      return n
  return longest + 1


def random_alphabet(rng: np.random.Generator, vocab_size: int, size: int) -> np.ndarray:
  """`[size]`: distinct ids drawn from `rng`, none of them a special token."""
  return rng.choice(np.arange(FIRST_RANDOM_ID, vocab_size), size, replace=False)


def _unit_hash(samples: np.ndarray) -> np.ndarray:
  """A fixed pseudo-random number in [0, 1) per sample index (splitmix64 finaliser)."""
  x = samples.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  x = x ^ (x >> np.uint64(31))
  return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
