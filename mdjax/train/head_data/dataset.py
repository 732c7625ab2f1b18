"""The heads' data set on disk: the model's own answers with the hidden states heads
read, written in chunks as `mdjax.train.head_data.capture` yields rows, and read back.

    data/
      meta.json          what made it: model, aux_layers, hidden_size, sampling, seed...
      prompts.jsonl      one prompt a line: {"id", "kind", "split": "train"|"heldout", "text"}
      grown.json         how many requests the model wrote, how many were dropped, and why
      chunks/
        00000/           one chunk, written atomically (`mdjax.files.atomic_directory`)
          rows.npy       int32 [R, 5]   per row: item, prompt, start, length, prompt_length
          tokens.npy     int32 [N]      every row's tokens, prompt then answer, end to end
          hidden.npy     float16 [N, D]     final-norm hidden state of each token
          aux.npy        float16 [N, A, D]  residual stream after each of meta's aux_layers
          greedy.npy     int32 [N]      the model's greedy guess of the token after each
                                        one (-1 before a prompt's last token)
        00001/ ...

Row r of a chunk is tokens `[start, start + length)` of its files: the first
`prompt_length` are its prompt (chat template included), the rest the answer. A row's
`item` is which work item it answers (`item % prompts` is its prompt's index in the
work order, `item // prompts` which sample), `prompt` the prompt's `id`; the split is
the prompt's, so no held-out prompt is ever trained on. Only whole chunks exist: a
killed run loses the rows it had not written, and resumes with the items no chunk
holds.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from typing import Iterator

import numpy as np

from mdjax.errors import MdjaxError
from mdjax.files import atomic_directory
from mdjax.train.head_data.capture import CapturedRow

ROW_FIELDS = ("item", "prompt", "start", "length", "prompt_length")
ARRAYS = ("tokens", "hidden", "aux", "greedy")  # a chunk's per-token files
SPLITS = ("train", "heldout")


@dataclasses.dataclass(frozen=True)
class Row:
  """One answered prompt (arrays are memory-mapped views of its chunk)."""

  item: int
  prompt: int
  split: str
  tokens: np.ndarray  # int32 [n]
  prompt_length: int
  hidden: np.ndarray  # float16 [n, D]
  aux: np.ndarray  # float16 [n, A, D]
  greedy: np.ndarray  # int32 [n]: guess of the next token; -1 before the prompt's last


class HeadData:
  """A data directory (module docstring), opened for reading.

  `meta` and `prompts` as written; `rows(split)` yields each row of a split (None:
  every row), chunk by chunk; `token_count(split)` counts its tokens."""

  def __init__(self, directory: str | pathlib.Path):
    self.directory = pathlib.Path(directory)
    if not (self.directory / "meta.json").is_file():
      raise MdjaxError(f"{str(self.directory)!r} is not a heads data directory (no meta.json)")
    self.meta = json.loads((self.directory / "meta.json").read_text())
    lines = (self.directory / "prompts.jsonl").read_text().splitlines()
    self.prompts = [json.loads(line) for line in lines]
    self.split_of = {p["id"]: p["split"] for p in self.prompts}
    self.chunks = chunk_dirs(self.directory)

  def rows(self, split: str | None = None) -> Iterator[Row]:
    if split is not None and split not in SPLITS:
      raise MdjaxError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    for chunk in self.chunks:
      lacking = [name for name in ARRAYS if not (chunk / f"{name}.npy").is_file()]
      if lacking:
        raise MdjaxError(f"the chunk {str(chunk)!r} has no {', '.join(lacking)} (an older "
                         "make_head_data wrote it): delete it and run make_head_data again")
      arrays = {name: np.load(chunk / f"{name}.npy", mmap_mode="r")
                for name in ARRAYS}
      for item, prompt, start, length, prompt_length in np.load(chunk / "rows.npy").tolist():
        if split is None or self.split_of[prompt] == split:
          window = slice(start, start + length)
          yield Row(item=item, prompt=prompt, split=self.split_of[prompt],
                    tokens=arrays["tokens"][window], prompt_length=prompt_length,
                    hidden=arrays["hidden"][window], aux=arrays["aux"][window],
                    greedy=arrays["greedy"][window])

  def token_count(self, split: str | None = None, answers_only: bool = False) -> int:
    return sum(len(r.tokens) - (r.prompt_length if answers_only else 0) for r in self.rows(split))


def chunk_dirs(directory: pathlib.Path) -> list[pathlib.Path]:
  """The written chunks, in order (staging directories of a killed write excluded)."""
  chunks = directory / "chunks"
  if not chunks.is_dir():
    return []
  return sorted(p for p in chunks.iterdir() if not p.name.startswith("."))


def written_items(directory: pathlib.Path) -> tuple[set[int], int]:
  """The items the chunks hold, and their answer tokens."""
  rows = [np.load(chunk / "rows.npy") for chunk in chunk_dirs(directory)]
  rows = np.concatenate(rows) if rows else np.zeros((0, len(ROW_FIELDS)), np.int32)
  return set(rows[:, 0].tolist()), int((rows[:, 3] - rows[:, 4]).sum())


class ChunkWriter:
  """Buffers rows and writes a chunk each time `chunk_tokens` tokens are buffered
  (`close` writes the rest). Numbering goes on after the chunks already written, and
  leftover staging directories of a killed write are removed."""

  def __init__(self, directory: pathlib.Path, prompt_of_item, chunk_tokens: int):
    self.root = directory / "chunks"
    for stale in self.root.glob(".*"):
      shutil.rmtree(stale)
    self.prompt_of_item = prompt_of_item
    self.chunk_tokens = chunk_tokens
    self.next_index = len(chunk_dirs(directory))
    self.buffer: list[CapturedRow] = []

  def add(self, row: CapturedRow) -> None:
    self.buffer.append(row)
    if sum(len(r.tokens) for r in self.buffer) >= self.chunk_tokens:
      self.flush()

  def flush(self) -> None:
    if not self.buffer:
      return
    lengths = np.array([len(r.tokens) for r in self.buffer])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = np.array([[r.item, self.prompt_of_item(r.item), s, n, r.prompt_length]
                     for r, s, n in zip(self.buffer, starts, lengths)], np.int32)  # [R, 5]
    with atomic_directory(self.root / f"{self.next_index:05d}") as staging:
      np.save(staging / "rows.npy", rows)
      for name in ARRAYS:
        np.save(staging / f"{name}.npy", np.concatenate([getattr(r, name) for r in self.buffer]))
    self.next_index += 1
    self.buffer = []
