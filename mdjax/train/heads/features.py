"""What heads read, on disk: one split of a heads run's cache (`Features`), and its one
writer (`FeatureWriter`), fed either by the target's passes (`write_target_features`)
or by the rows of a data set that stored them already (`write_stored_features`).

    features/{train,heldout}/
      tokens.npy           int32 [N, T]   prompt + answer, zero-padded to a multiple of 16
      lengths.npy          int32 [N]      tokens per row
      prompt_lengths.npy   int32 [N]
      greedy.npy           int32 [N, T]   the target's greedy guess of token t + 1
      hidden.npy           [N, T, F]      what the heads read at t, memory-mapped, float32
                                          or float16 (`feature_dtype`): the final-norm
                                          hidden state (F = D), or the residual stream
                                          after the family's target layers (eagle3: 3 D)
      teacher.npy          [N, T, D]      (only where the heads read other layers and learn
                                          the target's law, eagle3 with loss "kl") the
                                          final-norm hidden state, whose lm_head is that law
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int
from tqdm import tqdm

from mdjax import distributed, programs, sharding
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.model import Model
from mdjax.models.transformer import Params, forward_causal, lm_head

FEATURE_DTYPES = ("float32", "float16")
ROW_ALIGN = 16  # rows are zero-padded to a multiple of this many tokens


@dataclasses.dataclass(frozen=True)
class Features:
  """One split of the cache (layout: the module docstring)."""

  tokens: np.ndarray  # int32 [N, T]
  lengths: np.ndarray  # int32 [N]
  prompt_lengths: np.ndarray  # int32 [N]
  greedy: np.ndarray  # int32 [N, T]: argmax lm_head(hidden[:, t]), the guess of token t + 1
  hidden: np.ndarray  # [N, T, F] float32 / float16, memory-mapped
  teacher: np.ndarray | None = None  # [N, T, D] final-norm states, memory-mapped; or none

  FIELDS = ("tokens", "lengths", "prompt_lengths", "greedy", "hidden")
  MAPPED = ("hidden", "teacher")  # memory-mapped: the large ones

  @classmethod
  def open(cls, directory: pathlib.Path) -> "Features":
    names = cls.FIELDS + (("teacher",) if (directory / "teacher.npy").exists() else ())
    return cls(**{name: np.load(directory / f"{name}.npy",
                                mmap_mode="r" if name in cls.MAPPED else None)
                  for name in names})

  @property
  def rows(self) -> int:
    return len(self.lengths)

  @property
  def token_count(self) -> int:
    return int(self.lengths.sum())

  @property
  def answer_tokens(self) -> int:
    return int((self.lengths - self.prompt_lengths).sum())


class FeatureWriter:
  """Writes one split: the token files at once, then `hidden`, `greedy` (and `teacher`),
  memory-mapped, a block of rows at a time as their source gives them (`put`).
  `directory` None: writes nothing (a process other than 0 under `jax.distributed`, whose
  passes are collective)."""

  def __init__(self, directory: pathlib.Path | None, rows: list[list[list[int]]], dtype: str,
               width: int, teacher_width: int = 0):
    """`rows`: [prompt ids, answer ids] each; `width`: F, the features per token;
    `teacher_width`: D, where the split keeps the final-norm states apart (0: it does not)."""
    sequences = [prompt + answer for prompt, answer in rows]
    self.tokens = np.zeros((len(rows), -(-max(map(len, sequences)) // ROW_ALIGN) * ROW_ALIGN),
                           np.int32)  # [N, T]
    for i, sequence in enumerate(sequences):
      self.tokens[i, :len(sequence)] = sequence
    self.hidden = self.greedy = self.teacher = None
    if directory is None:
      return
    directory.mkdir(parents=True)
    np.save(directory / "tokens.npy", self.tokens)
    np.save(directory / "lengths.npy", np.array([len(s) for s in sequences], np.int32))
    np.save(directory / "prompt_lengths.npy", np.array([len(p) for p, _ in rows], np.int32))
    self.hidden = np.lib.format.open_memmap(directory / "hidden.npy", "w+", np.dtype(dtype),
                                            (*self.tokens.shape, width))
    self.greedy = np.lib.format.open_memmap(directory / "greedy.npy", "w+", np.int32,
                                            self.tokens.shape)
    if teacher_width:
      self.teacher = np.lib.format.open_memmap(directory / "teacher.npy", "w+", np.dtype(dtype),
                                               (*self.tokens.shape, teacher_width))

  def put(self, start: int, hidden: np.ndarray, greedy: np.ndarray,
          teacher: np.ndarray | None = None) -> None:
    """Rows `start`, `start + 1`, ... of `hidden` [R, n, F], `greedy` [R, n] and, where the
    split keeps them, `teacher` [R, n, D] (their first n tokens)."""
    if self.hidden is None:
      return
    rows, n = greedy.shape
    self.hidden[start:start + rows, :n] = hidden
    self.greedy[start:start + rows, :n] = greedy
    if self.teacher is not None:
      self.teacher[start:start + rows, :n] = teacher

  def close(self) -> None:
    for array in (self.hidden, self.greedy, self.teacher):
      if array is not None:
        array.flush()


@functools.partial(programs.jit, static_argnames=("config", "layers", "teacher"))
def target_features(params: Params, tokens: Int[Array, "B T"], *, config: ModelConfig,
                    layers: tuple[int, ...] = (), teacher: bool = False
                    ) -> tuple[Float[Array, "B T F"], Int[Array, "B T"],
                               Float[Array, "B T D"] | None]:
  """What heads read, the target's final-norm hidden states (F = D) or the residual
  stream after `layers` concatenated (F = A D); its greedy guess of each next token; and
  where `teacher`, its final-norm hidden states apart (the law's, `FeatureWriter`'s
  teacher; else None, so that nothing unused comes to the host)."""
  if not layers:
    hidden = forward_causal(params, tokens, config=config)
    features = hidden
  else:
    hidden, aux = forward_causal(params, tokens, config=config, aux_layers=layers)  # [B, T, A, D]
    features = aux.reshape(*aux.shape[:2], -1)
  return features, greedy_guesses(params, hidden, config=config), hidden if teacher else None


def greedy_guesses(params: Params, hidden: Float[Array, "B T D"], *,
                   config: ModelConfig) -> Int[Array, "B T"]:
  """The target's greedy guess of each next token from its final-norm hidden states."""
  return jnp.argmax(lm_head(params, hidden, config=config), axis=-1).astype(jnp.int32)


def write_target_features(target: Model, rows: list[list[list[int]]],
                          directory: pathlib.Path | None, dtype: str, batch_size: int,
                          progress: bool = True, layers: tuple[int, ...] = (),
                          teacher: bool = False) -> None:
  """The split of `rows` ([prompt ids, answer ids] each) into `directory`: one pass of
  the target per `batch_size` rows (`target_features`), with the final-norm states
  apart where `teacher`; `directory` None: the passes alone (`FeatureWriter`)."""
  d = target.config.hidden_size
  writer = FeatureWriter(directory, rows, dtype, d * max(1, len(layers)), d if teacher else 0)
  tokens = writer.tokens
  for start in tqdm(range(0, len(rows), batch_size), disable=not progress,
                    desc=f"hidden states ({getattr(directory, 'name', '')})", dynamic_ncols=True):
    chunk = tokens[start:start + batch_size]
    padded = np.zeros((batch_size, tokens.shape[1]), np.int32)  # every call the same shape
    padded[:len(chunk)] = chunk
    with sharding.active(target.layout):
      h, g, t = distributed.to_host(target_features(target.params, jnp.asarray(padded),
                                                    config=target.config, layers=layers,
                                                    teacher=teacher))
    writer.put(start, h[:len(chunk)], g[:len(chunk)], None if t is None else t[:len(chunk)])
  writer.close()


def write_stored_features(rows: list, directory: pathlib.Path, dtype: str, hidden_size: int,
                          aux_index: list[int], teacher: bool = False) -> None:
  """The split of data-set rows (`head_data.Row`) into `directory`, from their stored
  states (`aux_index`: which of the stored layers, concatenated; []: the final-norm
  states), greedy guesses, and with `teacher` the final-norm states apart
  (`FeatureWriter`)."""
  if not rows:
    raise MdjaxError(f"the data set has no {directory.name} rows")
  pairs = [[list(r.tokens[:r.prompt_length]), list(r.tokens[r.prompt_length:])] for r in rows]
  writer = FeatureWriter(directory, pairs, dtype, hidden_size * max(1, len(aux_index)),
                         hidden_size if teacher else 0)
  for i, row in enumerate(rows):
    n = len(row.tokens)
    hidden = row.aux[:, aux_index].reshape(n, -1) if aux_index else row.hidden
    writer.put(i, hidden[None], np.maximum(row.greedy, 0)[None],  # -1 (in the prompt): masked
               row.hidden[None])
  writer.close()
