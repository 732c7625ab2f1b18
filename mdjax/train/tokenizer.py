"""Byte-level BPE trained with the `tokenizers` library, saved for transformers.

Byte-level: every byte has a token, so any text encodes and decodes back exactly
(no unknown token, no normalization). Special tokens take the first ids::

    <bos> = 0    <eos> = 1 (ends every document)    <pad> = 2

Nothing is added on encode (no BOS/EOS post-processor): a prompt's ids are exactly
its text's, and training inserts EOS between documents itself.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from mdjax.errors import MdjaxError

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2


def train_bpe(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
  """A byte-level BPE of `vocab_size` tokens (specials included) trained on `texts`."""
  minimum = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
  if vocab_size < minimum:
    raise MdjaxError(f"vocab_size must be >= {minimum} (bytes + special tokens), got {vocab_size}")
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(texts, trainer=trainer)
  return tokenizer


def to_transformers(tokenizer: tokenizers.Tokenizer) -> transformers.PreTrainedTokenizerFast:
  """The transformers wrapper that `save_pretrained` writes and `AutoTokenizer` reads."""
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS,
                                              eos_token=EOS, pad_token=PAD)


def save(tokenizer: tokenizers.Tokenizer, directory: str | os.PathLike) -> None:
  """Writes tokenizer.json + tokenizer_config.json into `directory`."""
  to_transformers(tokenizer).save_pretrained(str(directory))


def load(directory: str | os.PathLike) -> transformers.PreTrainedTokenizerFast:
  """The tokenizer saved in `directory` by `save`, through `AutoTokenizer`."""
  path = pathlib.Path(directory)
  if not (path / "tokenizer.json").is_file():
    raise MdjaxError(f"no tokenizer.json in tokenizer directory {str(directory)!r}")
  return transformers.AutoTokenizer.from_pretrained(str(path))


def bytes_per_token(tokenizer: tokenizers.Tokenizer, texts: list[str]) -> float:
  """UTF-8 bytes of `texts` per token: converts loss per token into loss per byte."""
  encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
  tokens = sum(len(e.ids) for e in encodings)
  return sum(len(t.encode("utf-8")) for t in texts) / max(tokens, 1)


def token_byte_lengths(tokenizer: tokenizers.Tokenizer) -> np.ndarray:
  """int64 `[V]`: the UTF-8 bytes each token stands for (0 for special tokens).

  In the byte-level alphabet every character of a token's string is one byte.
  """
  lengths = np.zeros(tokenizer.get_vocab_size(), np.int64)
  for token, index in tokenizer.get_vocab().items():
    lengths[index] = 0 if token in SPECIAL_TOKENS else len(token)
  return lengths
