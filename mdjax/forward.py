"""`forward_logits`: the plain causal forward of one sequence, the reference every
strategy's tokens are checked against."""

from __future__ import annotations

import numpy as np

from mdjax import distributed, sharding
from mdjax.cache import KVCache
from mdjax.models.model import Model
from mdjax.prompts import bucket, check_context, encode_prompts
from mdjax.step import decode_step
from mdjax.topology import Topology


def forward_logits(model: Model, ids) -> np.ndarray:
  """Plain causal forward of one sequence: float32 numpy `[len(ids), vocab]`."""
  (ids,) = encode_prompts(model, [ids])
  check_context(model, [ids], 0)
  slots = bucket(len(ids))
  tokens = np.zeros((1, slots), np.int32)
  tokens[0, :len(ids)] = ids
  segments = np.where(np.arange(slots) < len(ids), 0, -1)[None].astype(np.int32)
  positions = np.arange(slots, dtype=np.int32)[None]
  with sharding.active(model.layout):
    cache = KVCache.for_params(model.config, model.params, 1, slots,
                               model.params["embed"].dtype)
    logits, _, _ = decode_step(model.params, cache, tokens, positions, segments,
                               Topology.causal(1), config=model.config)
  return distributed.to_host(logits)[0, :len(ids)]
