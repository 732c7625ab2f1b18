"""`speculative`: a small draft model proposes a chain, the target verifies it in one pass.

Each step the draft catches up on the tokens committed since its last pass
(`pending`: one, or two after a fully accepted chain), then proposes up to
`max_draft_tokens` tokens, one draft pass each. The target scores its last emitted
token and the whole chain in one `decode_step`, and keeps a prefix of the chain:

* greedy (temperature 0): the chain is the draft's argmax; the target keeps its own
  argmax up to and including the first disagreement, so the output is exactly the
  target's greedy decoding;
* sampling: the chain is sampled from the draft's processed distribution q; the
  speculative sampling rule (`mdjax.sampling.speculative_accept`) keeps each token
  with probability min(1, p/q) and resamples the first rejected one from
  norm(max(0, p - q)), so the output is distributed exactly as target sampling.
  The same processors (temperature, top-k, top-p, min-p) shape p and q.

Both caches roll back the rejected tail; rows accept different lengths::

    target feed   c  d0 d1 d2         target picks  d0 d1 x  .   -> emit d0 d1 x
    target cache  keeps c d0 d1       draft cache keeps pending + d0 d1 (d2 never fed)

How many tokens a row drafts (its `budget`, at most `max_draft_tokens`):
`draft_schedule="constant"` drafts `num_draft_tokens` every step; `"heuristic"` is
transformers' rule: start at `num_draft_tokens`, +2 after a step that accepted the
whole budget, -1 (at least 1) otherwise. A `confidence_threshold` > 0 also stops a
row's chain after a token the draft gave less than that probability. The draft
loop ends as soon as every row has stopped; the target's pass runs on the whole
`max_draft_tokens + 1` columns, half of them or one, whichever holds the longest
chain of the batch (`base.decode_chains`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError, check_count, check_real
from mdjax.models.config import ModelConfig
from mdjax.sampling import (SamplingParams, choose, greedy_accept, process_logits, row_keys,
                            speculative_accept)
from mdjax.step import decode_step
from mdjax.strategies import metadata
from mdjax.strategies.base import Limits, OutputBuffer, Prompt, decode_chains, emit, prefill

SCHEDULES = ("constant", "heuristic")
DRAFT_KEY, ACCEPT_KEY = 1, 2  # fold_in tags of a step's row key


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speculative:
  config: ModelConfig  # the target's
  draft_config: ModelConfig
  sampling: SamplingParams = SamplingParams(temperature=0.0)
  num_draft_tokens: int = 4
  draft_schedule: str = "constant"
  max_draft_tokens: int = 0  # 0: num_draft_tokens (constant) or twice it (heuristic)
  confidence_threshold: float = 0.0
  return_metadata: bool = False  # per-token metadata (`mdjax.strategies.metadata`)
  attention: str = "block_sparse"

  def __post_init__(self):
    if self.draft_config.vocab_size != self.config.vocab_size:
      raise MdjaxError(f"the draft's vocabulary ({self.draft_config.vocab_size} tokens) differs "
                       f"from the target's ({self.config.vocab_size} tokens)")
    check_count("num_draft_tokens", self.num_draft_tokens, 1)
    check_count("max_draft_tokens", self.max_draft_tokens, 0)
    if self.draft_schedule not in SCHEDULES:
      raise MdjaxError(f"draft_schedule must be one of {', '.join(SCHEDULES)}, "
                       f"got {self.draft_schedule!r}")
    if self.max_draft_tokens and self.max_draft_tokens < self.num_draft_tokens:
      raise MdjaxError(f"max_draft_tokens ({self.max_draft_tokens}) must be >= num_draft_tokens "
                       f"({self.num_draft_tokens})")
    check_real("confidence_threshold", self.confidence_threshold, minimum=0, maximum=1)

  @property
  def longest_chain(self) -> int:
    """Static chain length: what the cache and the target's verify pass are sized for."""
    if self.max_draft_tokens:
      return self.max_draft_tokens
    return self.num_draft_tokens * (2 if self.draft_schedule == "heuristic" else 1)

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, the generated tokens, and room for one rejected chain."""
    return prompt_len + capacity + self.longest_chain + 1

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits, capacity: int) -> dict:
    state = self._start_target(params["target"], prompt, cache, limits, capacity)
    draft_cache = KVCache.create(self.draft_config, prompt.tokens.shape[0], cache.num_slots,
                                 cache.k.dtype)
    _, draft_cache, _ = prefill(params["draft"], prompt, draft_cache, self.draft_config,
                                self.attention)
    return dict(state, draft_cache=draft_cache, pending=jnp.stack([state["last"]] * 2, axis=1),
                pending_count=jnp.ones_like(state["last"]))

  def _start_target(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
                    capacity: int) -> dict:
    """The target's prefill, its first token emitted, the counters at zero."""
    batch = prompt.tokens.shape[0]
    logits, cache, topology = prefill(params, prompt, cache, self.config, self.attention)
    rows = jnp.arange(batch)
    first = choose(row_keys(limits.key, rows, jnp.zeros_like(rows)), logits[:, 0], self.sampling)
    buffer, _ = emit(OutputBuffer.empty(batch, capacity), first[:, None], jnp.ones_like(first),
                     limits)
    zero, zeros = jnp.zeros((), jnp.int32), jnp.zeros((self.longest_chain,), jnp.int32)
    state = dict(cache=cache, topology=topology, limits=limits, buffer=buffer, last=first,
                 next_pos=prompt.lengths, budget=jnp.full((batch,), self.num_draft_tokens, jnp.int32),
                 passes=zero, draft_passes=zero, drafted_at=zeros, accepted_at=zeros,
                 columns_fed=zero)
    if self.return_metadata:
      state["metadata"] = metadata.first(capacity, self._target_probs(logits[:, 0]), first)
    return state

  def _target_probs(self, logits: Float[Array, "... V"]) -> Float[Array, "... V"]:
    return jax.nn.softmax(process_logits(logits, self.sampling), axis=-1)

  def _pick(self, keys: jax.Array, logits: Float[Array, "B V"]):
    """The draft's token [B], its probability [B] and (sampling) its distribution q [B, V]."""
    probs = jax.nn.softmax(process_logits(logits, self.sampling), axis=-1)
    token = choose(keys, logits, self.sampling)
    confidence = jnp.take_along_axis(probs, token[:, None], axis=1)[:, 0]
    return token, confidence, probs

  def _draft(self, params, state: dict, keys: jax.Array):
    """The draft catches up on `pending`, then drafts: see `_chain`. Returns (chain,
    length, q, draft cache holding pending + chain[:length - 1], draft passes)."""
    logits, draft_cache = self._catch_up(params, state)
    return self._chain(params, state, keys, logits, draft_cache)

  def _catch_up(self, params, state: dict) -> tuple[Float[Array, "B V"], KVCache]:
    """One draft pass over `pending`: the draft's logits after the last emitted token,
    and its cache holding everything emitted so far."""
    done = state["buffer"].done
    first_pos = state["next_pos"] + 1 - state["pending_count"]  # [B] of pending[0]
    offsets = jnp.arange(2)[None, :]
    feed = (offsets < state["pending_count"][:, None]) & ~done[:, None]
    logits, _, draft_cache = decode_step(
        params, state["draft_cache"], state["pending"], first_pos[:, None] + offsets,
        jnp.where(feed, 0, -1), state["topology"], config=self.draft_config,
        logits_at=(state["pending_count"] - 1)[:, None], attention=self.attention)  # [B, 1, V]
    return logits[:, 0], draft_cache

  def _chain(self, params, state: dict, keys: jax.Array, logits: Float[Array, "B V"],
             draft_cache: KVCache):
    """From the draft's `logits` after the last emitted token, the chain [B, D] (one
    draft pass per further token, each row until its budget or confidence stops it),
    its length per row [B], q [B, D, V], the draft cache and the passes made."""
    done, topology = state["buffer"].done, state["topology"]
    batch, longest = done.shape[0], self.longest_chain
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, DRAFT_KEY))(keys)
    carry = self._record(dict(chain=jnp.zeros((batch, longest), jnp.int32),
                              q=jnp.zeros((batch, longest, self.config.vocab_size), jnp.float32),
                              length=jnp.zeros((batch,), jnp.int32), active=~done,
                              cache=draft_cache, i=jnp.zeros((), jnp.int32)),
                         step_keys, logits, state["budget"])

    def extend(carry):
      i = carry["i"]
      logits, _, draft_cache = decode_step(
          params, carry["cache"], jax.lax.dynamic_slice_in_dim(carry["chain"], i - 1, 1, axis=1),
          (state["next_pos"] + i)[:, None], jnp.where(carry["active"], 0, -1)[:, None],
          topology, config=self.draft_config, attention=self.attention)  # [B, 1, V]
      return self._record(dict(carry, cache=draft_cache), step_keys, logits[:, 0],
                          state["budget"])

    carry = jax.lax.while_loop(lambda c: (c["i"] < longest) & c["active"].any(), extend, carry)
    return carry["chain"], carry["length"], carry["q"], carry["cache"], carry["i"]

  def _record(self, carry: dict, keys: jax.Array, logits: Float[Array, "B V"], budget) -> dict:
    """Chain position `i` from the draft's `logits`, for the rows still drafting."""
    i, active = carry["i"], carry["active"]
    token, confidence, probs = self._pick(
        jax.vmap(lambda k: jax.random.fold_in(k, i))(keys), logits)
    length = carry["length"] + active
    active = active & (length < budget) & (confidence >= self.confidence_threshold)
    return dict(carry, chain=carry["chain"].at[:, i].set(token), length=length, active=active,
                q=carry["q"].at[:, i].set(probs) if not self.sampling.greedy else carry["q"],
                i=i + 1)

  def _verify(self, keys: jax.Array, chain, length, q, logits: Float[Array, "B D+1 V"]):
    """(accepted [B], the target's next token [B]) by the greedy or the sampling rule."""
    if self.sampling.greedy:
      choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, 1 + D]
      accepted = greedy_accept(chain, length, choice)
      return accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]
    p = self._target_probs(logits)
    accept_keys = jax.vmap(lambda k: jax.random.fold_in(k, ACCEPT_KEY))(keys)
    return speculative_accept(accept_keys, chain, length, q, p)

  def step(self, params, state: dict) -> dict:
    buffer, done = state["buffer"], state["buffer"].done
    batch, longest = done.shape[0], self.longest_chain
    keys = row_keys(state["limits"].key, jnp.arange(batch), buffer.count)  # fresh every step
    chain, length, q, drafted_state, draft_passes = self._propose(params, state, keys)
    tokens = jnp.concatenate([state["last"][:, None], chain], axis=1)  # [B, 1 + D]
    offsets = jnp.arange(longest + 1)[None, :]
    scored = (offsets <= length[:, None]) & ~done[:, None]
    cached = state["cache"].length
    logits, cache, fed = decode_chains(params["target"], drafted_state["cache"], tokens[:, None],
                                  (state["next_pos"][:, None] + offsets)[:, None],
                                  jnp.where(scored, 0, -1)[:, None], state["topology"],
                                  config=self.config, attention=self.attention)
    logits = logits[:, 0]  # [B, 1 + D, V]
    accepted, next_token = self._verify(keys, chain, length, q, logits)
    emitted = jnp.where(offsets < accepted[:, None], jnp.pad(chain, ((0, 0), (0, 1))),
                        next_token[:, None])  # [B, 1 + D]: chain[:accepted], next_token
    buffer, taken = emit(buffer, emitted, accepted + 1, state["limits"])
    if self.return_metadata:
      drafted_state = dict(drafted_state, metadata=state["metadata"].record(
          state["buffer"].count, taken,
          *metadata.verified(self._target_probs(logits), emitted, chain, length, accepted)))
    live = ~done[:, None] & (jnp.arange(longest)[None, :] < length[:, None])  # [B, D]
    verified = dict(
        drafted_state, buffer=buffer, last=next_token, next_pos=state["next_pos"] + accepted + 1,
        cache=cache_ops.rollback(cache, jnp.where(done, cached, cached + 1 + accepted)),
        budget=self._next_budget(state["budget"], accepted),
        passes=state["passes"] + 1, columns_fed=state["columns_fed"] + batch * fed,
        draft_passes=state["draft_passes"] + draft_passes,
        drafted_at=state["drafted_at"] + live.sum(axis=0, dtype=jnp.int32),
        accepted_at=state["accepted_at"] + (live & (jnp.arange(longest)[None, :] <
                                                    accepted[:, None])).sum(axis=0, dtype=jnp.int32))
    return self._after_verify(state, verified, chain, length, accepted)

  def _propose(self, params, state: dict, keys: jax.Array):
    """The draft model's chain; the state carries its cache (`draft_cached`: the
    length before drafting, for the rollback after verification)."""
    chain, length, q, draft_cache, passes = self._draft(params["draft"], state, keys)
    return chain, length, q, dict(state, draft_cache=draft_cache,
                                  draft_cached=state["draft_cache"].length), passes

  def _after_verify(self, before: dict, state: dict, chain, length, accepted) -> dict:
    """Rolls the draft cache back to pending + the accepted chain; what the draft has
    not seen yet (the next token, and chain[-1] after a full accept) is pending."""
    done, next_token, draft_cached = before["buffer"].done, state["last"], state.pop("draft_cached")
    full = accepted == length  # the draft never saw chain[length - 1]: it becomes pending too
    last_drafted = jnp.take_along_axis(chain, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
    keep = draft_cached + before["pending_count"] + jnp.minimum(accepted, length - 1)
    return dict(state,
                draft_cache=cache_ops.rollback(state["draft_cache"],
                                               jnp.where(done, draft_cached, keep)),
                pending=jnp.stack([jnp.where(full, last_drafted, next_token), next_token], axis=1),
                pending_count=jnp.where(full, 2, 1))

  def _next_budget(self, budget: Int[Array, "B"], accepted: Int[Array, "B"]) -> Int[Array, "B"]:
    if self.draft_schedule == "constant":
      return budget
    return jnp.where(accepted == budget, jnp.minimum(budget + 2, self.longest_chain),
                     jnp.maximum(budget - 1, 1))

  def done(self, state: dict):
    return state["buffer"].done

  def result(self, state: dict):
    drafted, accepted = state["drafted_at"], state["accepted_at"]
    return state["buffer"], {
        "target_passes": state["passes"], "draft_passes": state["draft_passes"],
        "columns_fed": state["columns_fed"],  # tokens fed to the target's passes
        "drafted": drafted.sum(), "accepted": accepted.sum(),
        "drafted_at": drafted, "accepted_at": accepted,  # per chain position
        # every verify of a live row drafts position 0: drafted[0] = verified chains
        "mean_accepted_length": accepted.sum() / jnp.maximum(drafted[0], 1),
        "acceptance_rate_at": accepted / jnp.maximum(drafted, 1)} | (
            {"metadata": state["metadata"]} if self.return_metadata else {})
