"""`speculative` (greedy): a small draft model proposes a chain, the target verifies it.

Each step the draft catches up on the tokens committed since its last pass
(`pending`: one, or two after a fully accepted chain), then proposes
`num_draft_tokens` tokens greedily, one draft pass each. The target scores its last
emitted token and the whole chain in one `decode_step`; greedy acceptance keeps its
argmax up to and including the first disagreement, so the output is exactly the
target's greedy decoding. Both caches roll back the rejected tail; rows accept
different lengths.

    target feed   c  d0 d1 d2         argmax  d0 d1 x  .   -> emit d0 d1 x
    target cache  keeps c d0 d1       draft cache keeps pending + d0 d1 (d2 never fed)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.sampling import greedy_accept
from mdjax.step import decode_step
from mdjax.strategies.base import Limits, OutputBuffer, Prompt, emit, prefill


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speculative:
  config: ModelConfig  # the target's
  draft_config: ModelConfig
  num_draft_tokens: int = 4
  attention: str = "block_sparse"

  def __post_init__(self):
    if self.draft_config.vocab_size != self.config.vocab_size:
      raise MdjaxError(f"the draft's vocabulary ({self.draft_config.vocab_size} tokens) differs "
                       f"from the target's ({self.config.vocab_size} tokens)")
    n = self.num_draft_tokens
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
      raise MdjaxError(f"num_draft_tokens must be an integer >= 1, got {n!r}")

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, the generated tokens, and room for one rejected chain."""
    return prompt_len + capacity + self.num_draft_tokens + 1

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits, capacity: int) -> dict:
    batch = prompt.tokens.shape[0]
    logits, cache, topology = prefill(params["target"], prompt, cache, self.config, self.attention)
    first = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)  # [B]
    draft_cache = KVCache.create(self.draft_config, batch, cache.num_slots,
                                 cache.k.dtype)
    _, draft_cache, _ = prefill(params["draft"], prompt, draft_cache, self.draft_config,
                                self.attention)
    buffer, _ = emit(OutputBuffer.empty(batch, capacity), first[:, None], jnp.ones_like(first),
                     limits)
    zero = jnp.zeros((), jnp.int32)
    return dict(cache=cache, draft_cache=draft_cache, topology=topology, limits=limits,
                buffer=buffer, last=first, next_pos=prompt.lengths,
                pending=jnp.stack([first, first], axis=1), pending_count=jnp.ones_like(first),
                passes=zero, draft_passes=zero, drafted=zero, accepted=zero)

  def _draft(self, params, state: dict):
    """The chain `[B, D]` and the draft cache holding pending + chain[:-1]."""
    done = state["buffer"].done
    topology = state["topology"]
    first_pos = state["next_pos"] + 1 - state["pending_count"]  # [B] of pending[0]
    offsets = jnp.arange(2)[None, :]
    feed = (offsets < state["pending_count"][:, None]) & ~done[:, None]
    logits, _, draft_cache = decode_step(
        params, state["draft_cache"], state["pending"], first_pos[:, None] + offsets,
        jnp.where(feed, 0, -1), topology, config=self.draft_config,
        logits_at=(state["pending_count"] - 1)[:, None], attention=self.attention)  # [B, 1, V]
    token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    chain = jnp.zeros((token.shape[0], self.num_draft_tokens), jnp.int32).at[:, 0].set(token)
    segments = jnp.where(done, -1, 0)[:, None]

    def extend(i, carry):
      chain, draft_cache = carry
      logits, _, draft_cache = decode_step(
          params, draft_cache, jax.lax.dynamic_slice_in_dim(chain, i - 1, 1, axis=1), (state["next_pos"] + i)[:, None], segments,
          topology, config=self.draft_config, attention=self.attention)  # [B, 1, V]
      return chain.at[:, i].set(jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)), draft_cache

    return jax.lax.fori_loop(1, self.num_draft_tokens, extend, (chain, draft_cache))

  def step(self, params, state: dict) -> dict:
    buffer, done = state["buffer"], state["buffer"].done
    batch, gamma = done.shape[0], self.num_draft_tokens
    draft_cached = state["draft_cache"].length
    chain, draft_cache = self._draft(params["draft"], state)
    tokens = jnp.concatenate([state["last"][:, None], chain], axis=1)  # [B, 1 + D]
    offsets = jnp.arange(gamma + 1)[None, :]
    cached = state["cache"].length
    logits, _, cache = decode_step(params["target"], state["cache"], tokens,
                                   state["next_pos"][:, None] + offsets,
                                   jnp.where(done[:, None], -1, jnp.zeros_like(tokens)),
                                   state["topology"], config=self.config,
                                   attention=self.attention)  # [B, 1 + D, V]
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, 1 + D]
    accepted = greedy_accept(chain, jnp.full((batch,), gamma), choice)  # [B]
    buffer, _ = emit(buffer, choice, accepted + 1, state["limits"])
    bonus = jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]  # [B]
    full = accepted == gamma  # the draft never saw chain[-1]: it becomes pending too
    draft_keep = draft_cached + state["pending_count"] + jnp.minimum(accepted, gamma - 1)
    return dict(
        state, buffer=buffer, last=bonus, next_pos=state["next_pos"] + accepted + 1,
        cache=cache_ops.rollback(cache, jnp.where(done, cached, cached + 1 + accepted)),
        draft_cache=cache_ops.rollback(draft_cache, jnp.where(done, draft_cached, draft_keep)),
        pending=jnp.stack([jnp.where(full, chain[:, -1], bonus), bonus], axis=1),
        pending_count=jnp.where(full, 2, 1),
        passes=state["passes"] + 1, draft_passes=state["draft_passes"] + gamma,
        drafted=state["drafted"] + jnp.where(done, 0, gamma).sum(),
        accepted=state["accepted"] + jnp.where(done, 0, accepted).sum())

  def done(self, state: dict):
    return state["buffer"].done

  def result(self, state: dict):
    return state["buffer"], {k: state[k] for k in ("draft_passes", "drafted", "accepted")} | {
        "target_passes": state["passes"]}
