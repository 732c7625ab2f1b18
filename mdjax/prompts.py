"""Prompts as users give them (texts or token ids) turned into checked token ids,
and the padded sizes (buckets) that keep recompilation rare."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mdjax.errors import MdjaxError
from mdjax.models.model import Model

MIN_BUCKET = 16
FINE_BUCKETS_ABOVE = 512


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
  """The padded size of `n`: the smallest power of two >= max(n, minimum) up to
  `FINE_BUCKETS_ABOVE`; above it, the next multiple of 1/16 of that power of two, so
  padding (compute a prefill spends on nothing) stays under 12.5%, at 8 sizes per
  octave: 1040 -> 1152, not 2048."""
  size = max(minimum, 1 << max(0, n - 1).bit_length())
  if size <= FINE_BUCKETS_ABOVE:
    return size
  step = size // 16
  return -(-n // step) * step


def encode_prompts(model: Model, prompts) -> list[list[int]]:
  """One prompt or a list of prompts, each text (needs a tokenizer) or token ids."""
  if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                  all(isinstance(t, (int, np.integer)) for t in prompts)):
    prompts = [prompts]
  if isinstance(prompts, np.ndarray):
    prompts = list(prompts)
  if not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise MdjaxError(f"prompts must be a non-empty list of texts or token-id lists, got {prompts!r}")
  encoded = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      if model.tokenizer is None:
        raise MdjaxError(f"prompt {i} is text but the model {model.name or model.path!r} has no "
                         "tokenizer; pass token ids instead")
      prompt = model.tokenizer.encode(prompt)
    array = np.asarray(prompt).reshape(-1)
    if array.size == 0:
      raise MdjaxError(f"prompt {i} is empty")
    if array.dtype.kind not in "iu":
      raise MdjaxError(f"prompt {i} must be text or integer token ids, got {prompt!r}")
    ids = [int(t) for t in array]
    bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
    if bad:
      raise MdjaxError(f"prompt {i} has token id {bad[0]} outside the vocabulary "
                       f"[0, {model.config.vocab_size})")
    encoded.append(ids)
  return encoded


def encode_continuation(model: Model, piece) -> list[int]:
  """Text that continues a prompt (encoded without special tokens) or token ids."""
  if isinstance(piece, str) and model.tokenizer is not None:
    piece = model.tokenizer.encode(piece, add_special_tokens=False)
  (ids,) = encode_prompts(model, [piece])
  return ids


def eos_ids(model: Model, eos_token_id) -> tuple[int, ...]:
  """`None` means the model's own EOS ids (possibly none); an int or a list of ints."""
  if eos_token_id is None:
    return tuple(model.config.eos_token_id)
  ids = (eos_token_id,) if isinstance(eos_token_id, (int, np.integer)) else tuple(eos_token_id)
  for t in ids:
    if not isinstance(t, (int, np.integer)) or not 0 <= t < model.config.vocab_size:
      raise MdjaxError(f"eos_token_id {t!r} is not a token id in [0, {model.config.vocab_size})")
  return tuple(int(t) for t in ids)


def check_context(model: Model, prompts: list[list[int]], max_new_tokens) -> None:
  """Rejects a negative budget, or prompts + new tokens beyond the context length."""
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
    raise MdjaxError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
  longest = max(len(p) for p in prompts)
  limit = model.config.max_position_embeddings
  if longest + max_new_tokens > limit:
    raise MdjaxError(f"prompt length {longest} + max_new_tokens {max_new_tokens} = "
                     f"{longest + max_new_tokens} exceeds the model's context length "
                     f"max_position_embeddings={limit}")
