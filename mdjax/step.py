"""`decode_step`: the only function that runs the model.

Feed T tokens, each with its RoPE position and its segment; they attend to the
cached tokens the topology lets them see and to each other under the same rule;
their K/V are appended to the cache; logits come back. Prefill is the same call
with a large T. Strategies differ only in *which tokens, at which positions,
seeing what* they feed here.
"""

from __future__ import annotations

import functools

from jaxtyping import Array, Float, Int

from mdjax import programs
from mdjax.cache import CacheRegions, KVCache
from mdjax.models.attention import ATTENTION_BLOCK
from mdjax.models.config import ModelConfig
from mdjax.models.transformer import Params, forward, head_of_residual
from mdjax.topology import Topology


@functools.partial(programs.jit, static_argnames=("config", "attention", "block_size", "regions",
                                                  "aux_layers"),
                   donate_argnames=("cache",))
def decode_step(params: Params, cache: KVCache, tokens: Int[Array, "B T"],
                positions: Int[Array, "B T"], segments: Int[Array, "B T"], topology: Topology,
                *, config: ModelConfig, logits_at: Int[Array, "B R"] | None = None,
                attention: str = "block_sparse", block_size: int = ATTENTION_BLOCK,
                slots: Int[Array, "B T"] | None = None, regions: CacheRegions | None = None,
                aux_layers: tuple[int, ...] = ()) -> tuple[Float[Array, "B R V"],
                                                           Float[Array, "B T D"], KVCache]:
  """One model pass: returns `(logits, hidden, cache)`, or `(logits, hidden, cache, aux)`
  when `aux_layers` names A layers.

  logits: float32 `[B, T, V]`, or `[B, R, V]` for the token indices `logits_at`
    when given (prefill asks only for each row's last prompt token).
  hidden: final-norm hidden states `[B, T, D]` (what multi-token heads read).
  cache:  the input cache (donated) with the tokens of segment >= 0 appended.
  attention: "block_sparse" (visits only visible key blocks of at most `block_size`
    slots), "dense" (the reference) or "fused" (`jax.nn.dot_product_attention`, for
    accelerators); all give the same logits.
  slots: the cache slot of each token (default: the next free ones of its row).
  regions: when the cache holds one region per branch after the shared slots
    (`mdjax.cache.CacheRegions`) and no token sees another branch's region: each
    query then reads only its own region (`mdjax.models.attention.cascade_attention`).
  aux_layers: (static) layer indices (from 0) whose outputs, the residual stream
    `[B, T, A, D]`, come back as `aux` (EAGLE-3 reads three; see `forward`).
  """
  x, cache, *aux = forward(params, cache, tokens, positions, segments, topology,
                           config=config, attention=attention, block_size=block_size,
                           slots=slots, regions=regions, aux_layers=aux_layers, final_norm=False)
  logits, hidden = head_of_residual(params, x, config=config, logits_at=logits_at)
  return (logits, hidden, cache, *aux)
