"""mdjax: predict many token positions in one forward pass over one shared KV cache.

    import mdjax
    model = mdjax.load("random-llama")            # or an HF directory / hub id
    out = mdjax.generate(model, [[1, 2, 3]], strategy="greedy", max_new_tokens=16)
    out.sequences, out.stats
    heads = mdjax.load_heads("smollm2-135m-instruct-medusa")   # multi-token-prediction heads
"""

from __future__ import annotations

import os

from mdjax import backends, xla_flags

# mdjax reads tokenizers, chat templates and GGUF metadata through transformers, never its
# PyTorch models: its advice that PyTorch is missing is noise to a user of mdjax
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

xla_flags.apply()  # before any JAX backend starts: `mdjax.xla_flags`
backends.choose()  # the CPU alone on a host without a GPU or TPU: `mdjax.backends`

from mdjax import chat, distributed, pipelines, sharding
from mdjax.cache import KVCache
from mdjax.checkpoints.load import load
from mdjax.errors import CheckpointError, MdjaxError, MissingPackageError
from mdjax.forward import forward_logits
from mdjax.generate import GenerationOutput, compiled_programs, generate, stream
from mdjax.heads import Heads, HeadsConfig, load_heads, save_heads
from mdjax.models.config import ModelConfig, RopeScaling, default_weight_dtype, weight_dtype
from mdjax.models.layer_loop import check_layer_loop, default_layer_loop, with_layer_loop
from mdjax.models.model import Model
from mdjax.models.random_init import init_params
from mdjax.programs import clear_compiled, compiled_cache_size, set_compiled_cache_size
from mdjax.prompts import encode_prompts
from mdjax.sharding import shard
from mdjax.step import decode_step
from mdjax.topology import Topology

__all__ = ["load", "shard", "sharding", "distributed", "load_heads", "save_heads", "Heads", "HeadsConfig", "forward_logits", "generate", "stream", "chat", "pipelines", "clear_compiled",
           "compiled_programs", "compiled_cache_size", "set_compiled_cache_size", "Model", "ModelConfig", "RopeScaling",
           "KVCache", "Topology", "decode_step", "encode_prompts", "GenerationOutput", "MdjaxError",
           "CheckpointError", "MissingPackageError"]
