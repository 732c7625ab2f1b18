"""A GGUF file's header (config, tokenizer, tensor table), parsed once per file's bytes.

gguf-py's `GGUFReader` walks every entry of an array field one by one: Gemma 3's header
(three arrays of 262,144 tokens) takes ~7.6 s on the 2-core machine, on every load that
reads the file's blocks as they are (`quantize="gguf"`; a float load reads the cached
float copy instead, `mdjax.checkpoints.gguf.load_gguf`). The first such load writes what
the header gave to `files.cache_dir()/gguf/<the file's cache key>-header/`::

    config.json      the model's config (`hf.config_to_hf`; `hf.config_from_hf` reads it)
    tokenizer files  the tokenizer the metadata builds, saved (none if the file has none)
    tensors.json     {"arch": "llama", "tensors": [[name, ggml type, ggml shape,
                       numpy dtype, numpy shape, byte offset], ...]}

and later loads view each tensor's bytes in the file from the table, parsing nothing.
The entry is named by the file's size and sha256 and written atomically: changed bytes
get a new entry, an entry that cannot be read is parsed and written again.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, NamedTuple

import gguf
import numpy as np

from mdjax import files
from mdjax.checkpoints import gguf as gguf_reader
from mdjax.checkpoints import hf
from mdjax.errors import CheckpointError
from mdjax.models.config import ModelConfig

TABLE = "tensors.json"


class TensorInfo(NamedTuple):
  """What `gguf_reader.Tensors` reads of a tensor (the fields of gguf's `ReaderTensor`)."""

  name: str
  tensor_type: gguf.GGMLQuantizationType
  shape: np.ndarray  # ggml's order: fastest dimension first
  data: np.ndarray  # a read-only view of the file's bytes, as `GGUFReader` gives it


def open_header(file: pathlib.Path) -> tuple[str, gguf_reader.Tensors, ModelConfig, Any]:
  """(architecture, tensors, config, tokenizer or None) of GGUF `file`: from its cache
  entry when there is one, else parsed (`gguf_reader.open_file`) and cached."""
  entry = files.cache_dir() / "gguf" / f"{gguf_reader.cache_key(file)}-header"
  if (entry / TABLE).is_file():
    try:
      return _read(entry, file)
    except (CheckpointError, KeyError, TypeError, ValueError, OSError):
      pass  # unreadable: parsed again below, and the entry replaced
  reader, arch, tensors, config = gguf_reader.open_file(file)
  tokenizer = gguf_reader.tokenizer_of(reader, file, arch)
  table = [[t.name, int(t.tensor_type), [int(n) for n in t.shape], t.data.dtype.str,
            list(t.data.shape), int(t.data_offset)] for t in reader.tensors]
  with files.atomic_directory(entry) as staging:
    (staging / "config.json").write_text(json.dumps(hf.config_to_hf(config), indent=2))
    if tokenizer is not None:
      tokenizer.save_pretrained(str(staging))
    (staging / TABLE).write_text(json.dumps({"arch": arch, "tensors": table}))
  return arch, tensors, config, tokenizer


def _read(entry: pathlib.Path, file: pathlib.Path) -> tuple[str, gguf_reader.Tensors,
                                                            ModelConfig, Any]:
  table = hf.read_json(entry / TABLE)
  config = hf.config_from_hf(hf.read_json(entry / "config.json"))
  data = np.memmap(file, mode="r")
  infos = [TensorInfo(name, gguf.GGMLQuantizationType(kind), np.asarray(shape),
                      data[offset:offset + int(np.prod(stored, dtype=np.int64))
                           * np.dtype(dtype).itemsize].view(dtype).reshape(stored))
           for name, kind, shape, dtype, stored, offset in table["tensors"]]
  tensors = gguf_reader.Tensors(infos, file, table["arch"])
  tensors.heads = (config.num_heads, config.num_kv_heads)
  tokenizer = None
  if any((entry / f).is_file() for f in hf.TOKENIZER_FILES):
    import transformers  # only files with a tokenizer need it
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(entry))
  return table["arch"], tensors, config, tokenizer
