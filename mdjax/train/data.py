"""Training data: a folder of text files, split by file, packed into fixed-length sequences.

By default the folder is the Python standard library of the running interpreter
(`*.py`, recursively, `site-packages` excluded): every machine has it. Files that are
not UTF-8 are skipped. The list is sorted, so it is the same on every run.

The held-out split is chosen *by file* from a stable hash of each relative path: the
`ceil(fraction * n)` files with the smallest sha256 are held out. A file's rank
depends only on its path, so the split is deterministic and the same for everyone
holding the same files; no held-out file ever contributes a training token.

Token streams are the files' tokens joined with EOS after every document, cut into
sequences of `seq_len + 1` tokens that overlap by one (inputs `[:-1]`, targets
`[1:]`). The batch of step `i` is a pure function of `(seed, i)`: every epoch visits
the sequences in a fresh permutation drawn from `fold_in(key(seed), epoch)`, so a
resumed run needs no iterator state.

Copy rows (`copy_fraction` > 0): a stable share of the samples are turned into
repetitions of their own first half::

    tokens: a0 a1 ... a(h-1) | a0 a1 ... a(h-1) | a0 ...      (h = (seq_len + 1) // 2)
    loss:   plain LM         | exact copies: teaches the model to attend back and copy

With `copy_min_period` = m > 0 the repeated prefix has a length p drawn per row from
m..h, and the row is that prefix over and over (a0 .. a(p-1) a0 .. a(p-1) a0 ..): the
model sees copies at many distances, as in real prompts, not only at h. From random
weights such rows did not start copying in 2,500 steps where first-half rows did within
500 (`configs/lm_target_long.py`): one distance seems to be the easier first lesson.

With `copy_shown_twice` the row is instead its own consecutive chunks (m..h tokens
each, drawn per chunk), each shown twice::

    tokens: a0 .. a(p-1) a0 .. a(p-1) | b0 .. b(q-1) b0 .. b(q-1) | ...   (b0 follows a(p-1))

so every predictable position is a *first* repeat, as in a prompt that repeats a
function (see `random_copy_shown_twice` below for why that matters), and half the row
is fresh text. Over and over, a prefix of p tokens gives a first repeat at only p of
the ~512 - p predictable positions; the later ones can look back to any earlier copy.
Target stage 20 (stage 18 continued with 50% such rows) became the best model of
held-out code (loss 3.38 against 3.48) but not a better copier (50 of 131 held-out
functions copied exactly, stage 18: 58), so it was not shipped; nor was stage 21
(stage 20 continued with stage 18's rows: 50 of 131 too).

Code repeats itself (call sites, `self.x = x`, edited versions of a function), and a
small model trained on a few million tokens does not learn to copy from plain text
alone; the rows cost no extra data and stay a pure function of (seed, step).

Random copy rows (`random_copy_fraction` > 0) are a stronger lesson: a block of
8..64 uniformly random tokens, repeated to fill the row::

    tokens: r0 r1 ... r(L-1) | r0 r1 ... r(L-1) | r0 ...
    loss:   unpredictable    | predictable only by looking back L tokens and copying

Nothing but an induction mechanism (find the earlier occurrence of the current
token, copy what followed it) lowers their loss, so they pull one into existence
faster than text copies, whose second half a language model half-predicts anyway.

With `random_copy_min_alphabet` = a > 0 each random block is drawn from only k ids
(k log-uniform in a..V per row), so ids recur inside the block with different
successors::

    tokens: x y x z y x | x y x z y x | ...      (k = 3)
    after "x" come y, z and x: only the ids before the current one say which

and copying needs the longer match a real repeat of code needs too (`IncrementalEncoder`
beside `IncrementalDecoder`: "Incremental" alone does not say what comes next). Stage
11 of the target copied whole-vocabulary blocks at 0.90 top-1 but blocks over 4 ids at
0.31 (`experiments.eval_lm`). A run with such rows (stage 15 in `docs/shipped_models.md`) learnt the
longer match (0.54 at 4 ids) but copied whole-vocabulary blocks and held-out functions
worse, so the shipped models do not use them.

With `random_copy_common_share` = p > 0 a share p of each block's positions hold one of
the block's 2..8 *common* ids instead, the rest whole-vocabulary ids, as in code, where a
few structural tokens (newline and indent, `,`, `=`) separate rare identifiers::

    tokens: A , n B = n C , n | A , n B = n C , n | ...   (common ids: ",", "=", "n")
    after "n" come B, C and A: only "A ,", "B =" or "C ," before it says which

The rare ids keep the whole-vocabulary lesson, and the token after each common one
needs the longer match (stage 11 of the target wrote `streamreader=` for
`incrementaldecoder=` after the line `incrementalencoder=IncrementalEncoder,`). Stage 16
tried them in blocks repeated over and over: the same trade as stage 15, no better copy.

With `random_copy_shown_twice` each block is shown twice and then a fresh one follows
(`B B C C D D ...`) instead of one block over and over (`B B B B ...`). A copy of code
(or of a function in a prompt) is a *first* repeat: nothing has shown the model the
pairing twice before. Over and over, a block of L ids gives a first repeat only L of the
~512 - L predictable positions (a few percent; the later repeats can look back to any
earlier copy); shown twice, every predictable position is one. With them target stage
17 copies whole-vocabulary blocks at 0.999 (stage 11: 0.90). The shipped target (stage
18) adds common ids to blocks shown twice, and learnt the longer match: 0.99 after an id
that recurs in its block (stage 17: 0.77), 0.62 over 4 ids (0.28).

With `random_copy_phrase_rate` = q > 0 a *phrase* of the block (each block has 1..3
phrases of 2..n ids, n = `random_copy_phrase_longest`, 4 by default) starts at each
position with chance q, written over the ids there and followed by at least one id of
the block::

    tokens: A s e l f B s e l f C | A s e l f B s e l f C | ...   (phrase: "s e l f")
    after "s e l f" come B and C: only the id before the phrase says which

A common id alone needs a match of two ids; a phrase needs one longer than itself, as
code does (`self._` before `self._reader` and `self._writer`; stage 18 wrote `msg.get_
payload` for `msg.get_param`). `match_needed` counts the ids a copy must match: every
first miss of stage 18 on `experiments.eval_lm`'s held-out functions needed 3..16 of
them, and it copied random blocks at 0.89 where 3 are needed, 0.50 where 4 or more.
Stage 19 (stage 18 continued with q = 0.2) learnt those (0.96, 0.86) but held-out code
much less (where 4 or more are needed: 0.845, stage 18: 0.835), so it was not shipped.

Framed copy rows (`framed_copy_fraction` > 0): a prefix of the row, then a short
comment that announces a repeat (one of `COPY_FRAMES`, tokenized), then the prefix
again, then the row's own text on from the end of the prefix::

    tokens: a0 ... a(p-1) | (blank line) # Again: | a0 ... a(p-1) | a(p) a(p+1) ...
    loss:   plain LM      | the frame             | exact copies  | plain LM again

as when a prompt quotes code and asks for it back: the repeat starts after other text,
not where the original ended, and plain text follows it. p is drawn like a copy row's
period. None of the frames is `experiments.eval_lm`'s copy prompt, so that task
still measures copying after a comment the model was never trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import sysconfig

import jax
import numpy as np

from mdjax.errors import MdjaxError

EXCLUDED_DIRS = ("site-packages", "__pycache__")

COPY_FRAMES = (  # the comments between a framed copy row's prefix and its repeat
    "\n\n# Again:\n", "\n\n# Once more:\n", "\n\n# Copy of the code above:\n",
    "\n\n# The code above, unchanged:\n", "\n\n# Repeated verbatim:\n", "\n\n\n")


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


@dataclasses.dataclass(frozen=True)
class RowMix:
  """Which lessons in copying replace a share of the plain rows, and how (the trainer's
  options of the same names; see the module docstring). The default is plain rows only."""

  copy_fraction: float = 0.0
  copy_min_period: int = 0
  copy_shown_twice: bool = False
  random_copy_fraction: float = 0.0
  random_copy_min_alphabet: int = 0
  random_copy_common_share: float = 0.0
  random_copy_shown_twice: bool = False
  random_copy_phrase_rate: float = 0.0
  random_copy_phrase_longest: int = 4
  framed_copy_fraction: float = 0.0

  def __post_init__(self):
    for name, value in self.fractions.items():
      if not 0 <= value <= 1:
        raise MdjaxError(f"{name} must be in [0, 1], got {value}")
    if sum(self.fractions.values()) > 1:
      raise MdjaxError(f"{' + '.join(self.fractions)} must sum to <= 1, got "
                       f"{' + '.join(str(v) for v in self.fractions.values())}")
    for name in ("random_copy_common_share", "random_copy_phrase_rate"):
      if not 0 <= getattr(self, name) < 1:
        raise MdjaxError(f"{name} must be in [0, 1), got {getattr(self, name)}")
    if not 2 <= self.random_copy_phrase_longest <= 8:
      raise MdjaxError(f"random_copy_phrase_longest must be in [2, 8] (a phrase shorter "
                       f"than a block of 8), got {self.random_copy_phrase_longest}")

  @property
  def fractions(self) -> dict[str, float]:
    """The shares of the row kinds, in the order `Batches` draws them."""
    return {"copy_fraction": self.copy_fraction,
            "random_copy_fraction": self.random_copy_fraction,
            "framed_copy_fraction": self.framed_copy_fraction}

  @classmethod
  def from_config(cls, config) -> RowMix:
    """The mix a trainer config (`configs/lm_common.py`) asks for."""
    return cls(**{field.name: config[field.name] for field in dataclasses.fields(cls)})


class Batches:
  """`batch(step)`: int32 `[batch_size, seq_len + 1]`, a pure function of (seed, step).

  Sample `i = step * batch_size + j` is sequence `perm_e[i mod n]` of epoch
  `e = i // n`, with `perm_e` a permutation drawn from `fold_in(key(seed), e)`. A stable
  share of the samples become the copy lessons of `mix`.
  """

  def __init__(self, sequences: np.ndarray, batch_size: int, seed: int,
               mix: RowMix = RowMix(), vocab_size: int = 0,
               frames: tuple[np.ndarray, ...] = ()):
    if batch_size < 1:
      raise MdjaxError(f"batch_size must be >= 1, got {batch_size}")
    if mix.framed_copy_fraction and not frames:
      raise MdjaxError("framed copy rows need the frames' token ids, got none")
    if mix.random_copy_fraction and vocab_size <= FIRST_RANDOM_ID:
      raise MdjaxError(f"random copy rows need the vocabulary size, got {vocab_size}")
    alphabet_max = vocab_size - FIRST_RANDOM_ID
    if mix.random_copy_min_alphabet and not 2 <= mix.random_copy_min_alphabet <= alphabet_max:
      raise MdjaxError(f"random_copy_min_alphabet must be 0 (the whole vocabulary) or in "
                       f"[2, {alphabet_max}], got {mix.random_copy_min_alphabet}")
    half = first_half(sequences.shape[1])
    if not 0 <= mix.copy_min_period <= half:
      raise MdjaxError(f"copy_min_period must be in [0, {half}] (0: always the first half of "
                       f"the {sequences.shape[1]}-token rows), got {mix.copy_min_period}")
    self.mix = mix
    self.sequences = sequences
    self.batch_size = batch_size
    # a sample's share in [0, e0) copies, [e0, e1) random ids, [e1, e2) framed, [e2, 1) plain
    self.kind_edges = np.cumsum(list(mix.fractions.values()))  # [3]
    self.frames = frames
    self.vocab_size = vocab_size
    self.seed = seed
    self.key = jax.random.key(seed)
    self._permutations: dict[int, np.ndarray] = {}

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._permutations:
      self._permutations = {epoch: np.asarray(jax.random.permutation(
          jax.random.fold_in(self.key, epoch), len(self.sequences)))}
    return self._permutations[epoch]

  def batch(self, step: int) -> np.ndarray:
    n = len(self.sequences)
    samples = step * self.batch_size + np.arange(self.batch_size)  # [B]
    rows = [self._permutation(int(i) // n)[int(i) % n] for i in samples]
    batch = self.sequences[rows]  # [B, T + 1]
    share = _unit_hash(samples)  # [B] in [0, 1): which kind of row each sample is
    kind = np.searchsorted(self.kind_edges, share, side="right")  # [B]: 0 copy .. 3 plain
    changed = np.flatnonzero(kind < len(self.kind_edges))
    if changed.size:
      batch = batch.copy()
    for row in changed:
      sample = int(samples[row])
      if kind[row] == 0 and self.mix.copy_shown_twice:
        batch[row] = chunks_shown_twice(batch[row], self._chunk_lengths(sample))
      elif kind[row] == 0:
        batch[row] = repeat_prefix(batch[row], self._copy_period(sample))
      elif kind[row] == 1:
        mix = self.mix
        batch[row] = random_repeats(self.seed, sample, batch.shape[1], self.vocab_size,
                                    mix.random_copy_min_alphabet, mix.random_copy_common_share,
                                    mix.random_copy_shown_twice, mix.random_copy_phrase_rate,
                                    mix.random_copy_phrase_longest)
      else:
        pick = np.random.default_rng([self.seed, sample, 2]).integers(len(self.frames))
        batch[row] = framed_repeat(batch[row], self._copy_period(sample), self.frames[pick])
    return batch

  def _copy_period(self, sample: int) -> int:
    """The length of the prefix a copy row repeats: h, or drawn from m..h per sample."""
    return self._draw_period(np.random.default_rng([self.seed, sample, 1]))

  def _chunk_lengths(self, sample: int) -> list[int]:
    """The lengths of the chunks a copy row shows twice each, enough to fill the row."""
    rng, lengths = np.random.default_rng([self.seed, sample, 6]), []
    while 2 * sum(lengths) < self.sequences.shape[1]:
      lengths.append(self._draw_period(rng))
    return lengths

  def _draw_period(self, rng: np.random.Generator) -> int:
    """h, or drawn from m..h by `rng`."""
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


def framed_repeat(row: np.ndarray, period: int, frame: np.ndarray) -> np.ndarray:
  """`[T]` -> `[T]`: the first `period` tokens, `frame`, them again, then the row on from there."""
  return np.concatenate([row[:period], frame, row])[:len(row)].astype(row.dtype)


def repeat_first_half(sequences: np.ndarray) -> np.ndarray:
  """`[N, T]` -> `[N, T]`: the first `ceil(T / 2)` tokens, then them again (cut to T)."""
  return repeat_prefix(sequences, first_half(sequences.shape[1]))


FIRST_RANDOM_ID = 3  # random rows skip the special tokens (<bos>, <eos>, <pad>)


def random_repeats(seed: int, sample: int, length: int, vocab_size: int,
                   min_alphabet: int = 0, common_share: float = 0.0,
                   shown_twice: bool = False, phrase_rate: float = 0.0,
                   phrase_longest: int = 4) -> np.ndarray:
  """`[length]`: a block of 8..64 random ids drawn from (seed, sample), repeated.

  `min_alphabet` = a > 0 draws the block from an alphabet of k ids instead of the whole
  vocabulary, k log-uniform in a..(vocab_size - 3) per sample: a small alphabet repeats
  ids inside the block, so only the tokens *before* the current one say which
  occurrence to copy from (see `random_copy_min_alphabet` in the module docstring).
  `common_share` = p > 0 puts one of 2..8 common ids at each position with probability
  p (see `random_copy_common_share`). `phrase_rate` = q > 0 then starts one of the block's
  1..3 phrases of 2..`phrase_longest` ids at each position with chance q (see
  `random_copy_phrase_rate`). `shown_twice`: each block is shown twice, then a fresh
  block follows (see `random_copy_shown_twice`)::

      shown_twice=False:  B B B B B B ...
      shown_twice=True:   B B C C D D ...   (B, C, D of 8..64 ids each)
  """
  rng = np.random.default_rng([seed, sample])
  common_rng = np.random.default_rng([seed, sample, 4])
  phrase_rng = np.random.default_rng([seed, sample, 5])
  ids = np.arange(FIRST_RANDOM_ID, vocab_size)
  if min_alphabet:
    alphabet_rng = np.random.default_rng([seed, sample, 3])
    k = int(np.exp(alphabet_rng.uniform(np.log(min_alphabet), np.log(len(ids)))))
    ids = random_alphabet(alphabet_rng, vocab_size, k)

  def block() -> np.ndarray:  # [8..64]
    drawn = ids[rng.integers(0, len(ids), rng.integers(8, 65))]
    if common_share:
      drawn = with_common_ids(common_rng, drawn, vocab_size, common_share)
    if not phrase_rate:
      return drawn
    return with_phrases(phrase_rng, drawn, vocab_size, phrase_rate, phrase_longest)

  if not shown_twice:
    return np.resize(block(), length).astype(np.int32)
  pieces = []
  while sum(map(len, pieces)) < length:
    pieces += [block()] * 2
  return np.concatenate(pieces)[:length].astype(np.int32)


def with_common_ids(rng: np.random.Generator, block: np.ndarray, vocab_size: int,
                    share: float) -> np.ndarray:
  """`[L]` -> `[L]`: each position, with probability `share`, replaced by one of 2..8
  common ids drawn from `rng` (a copy; see `random_copy_common_share`)."""
  common = random_alphabet(rng, vocab_size, rng.integers(2, 9))
  at = np.flatnonzero(rng.random(len(block)) < share)
  block = block.copy()
  block[at] = common[rng.integers(0, len(common), len(at))]
  return block


def with_phrases(rng: np.random.Generator, block: np.ndarray, vocab_size: int,
                 rate: float, longest: int = 4) -> np.ndarray:
  """`[L]` -> `[L]`: 1..3 phrases of 2..`longest` ids drawn from `rng`; at each position, with
  chance `rate`, one of them written over the ids from there (cut at the block's end),
  and the next phrase at the earliest one id after it (a copy; see
  `random_copy_phrase_rate`)::

      block:   a b c d e f g h        phrases: P Q, X Y Z
      result:  P Q c X Y Z g h        (phrases start at 0 and 3, none at 7; c and g stay)
  """
  phrases = [random_alphabet(rng, vocab_size, rng.integers(2, longest + 1))
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
