"""`prompt_lookup`: draft tokens copied from the text itself, verified in one pass.

Each step, every row looks for the latest earlier occurrence of its last `n` tokens
(n = max_ngram_size ... 1) in prompt + generated text and proposes the (up to)
`num_tokens` tokens that followed it. The target model scores the last emitted
token and the proposal in one `decode_step` (a chain in the row's own segment);
greedy acceptance keeps the target's argmax up to and including its first
disagreement with the proposal, so the output is exactly greedy decoding's. The
rejected tail is rolled back out of the cache. Rows accept different lengths.

One row, last emitted token `c` (not yet cached), proposal `d e f`::

    feed     c  d  e  f           positions p .. p+3, segment 0
    argmax   d  e  x  .           -> emit d e x; cache keeps c d e; `f` rolled back
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.sampling import greedy_accept
from mdjax.step import decode_step
from mdjax.strategies import metadata
from mdjax.strategies.base import Limits, OutputBuffer, Prompt, emit, prefill


def latest_ngram_continuation(history: Int[Array, "B H"], length: Int[Array, "B"], ngram: int,
                              num_tokens: int) -> tuple[Int[Array, "B D"], Int[Array, "B"]]:
  """The tokens after the latest earlier occurrence of each row's last `ngram` tokens.

  Returns the proposal `[B, num_tokens]` and how many of its tokens are real (0 when
  the n-gram does not occur earlier, or the row is shorter than `ngram + 1`).
  """
  width = history.shape[1]
  suffix = jnp.take_along_axis(
      history, jnp.clip(length[:, None] - ngram + jnp.arange(ngram), 0, width - 1), axis=1)
  padded = jnp.pad(history, ((0, 0), (0, ngram)), constant_values=-1)  # [B, H + n]
  match = jnp.ones(history.shape, jnp.bool_)
  for k in range(ngram):
    match &= padded[:, k:k + width] == suffix[:, k:k + 1]  # [B, H]: window j matches at k
  start = jnp.arange(width)[None, :]  # window start j
  match &= start < length[:, None] - ngram  # earlier than the suffix itself, with a follower
  latest = jnp.max(jnp.where(match, start, -1), axis=1)  # [B]
  follow = latest + ngram  # [B] first proposed index
  index = jnp.clip(follow[:, None] + jnp.arange(num_tokens), 0, width - 1)
  count = jnp.where(latest >= 0, jnp.minimum(num_tokens, length - follow), 0)
  return jnp.take_along_axis(history, index, axis=1), count.astype(jnp.int32)


def propose_by_lookup(history, length, max_ngram_size: int, num_tokens: int):
  """The longest n-gram (max_ngram_size ... 1) that occurs earlier decides the proposal."""
  proposal = jnp.zeros((history.shape[0], num_tokens), jnp.int32)
  count = jnp.zeros((history.shape[0],), jnp.int32)
  for ngram in range(1, max_ngram_size + 1):  # longer n-grams override shorter ones
    found, found_count = latest_ngram_continuation(history, length, ngram, num_tokens)
    proposal = jnp.where((found_count > 0)[:, None], found, proposal)
    count = jnp.where(found_count > 0, found_count, count)
  return proposal, count


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLookup:
  config: ModelConfig
  num_tokens: int = 10  # prompt_lookup_num_tokens
  max_ngram_size: int = 2
  return_metadata: bool = False  # per-token metadata (`mdjax.strategies.metadata`)
  attention: str = "block_sparse"

  def __post_init__(self):
    for name in ("num_tokens", "max_ngram_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        option = "prompt_lookup_num_tokens" if name == "num_tokens" else name
        raise MdjaxError(f"{option} must be an integer >= 1, got {value!r}")

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, the generated tokens, and room for one rejected proposal
    (one branch per row)."""
    return prompt_len + capacity + self.num_tokens + 1

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits, capacity: int) -> dict:
    batch, prompt_len = prompt.tokens.shape
    logits, cache, topology = prefill(params, prompt, cache, self.config, self.attention)
    first = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)  # [B] (one branch per row)
    buffer, _ = emit(OutputBuffer.empty(batch, capacity), first[:, None],
                     jnp.ones_like(first), limits)
    history = jnp.zeros((batch, prompt_len + capacity + self.num_tokens + 1), jnp.int32)
    history = history.at[:, :prompt_len].set(prompt.tokens)
    history = history.at[jnp.arange(batch), prompt.lengths].set(first)
    zero = jnp.zeros((), jnp.int32)
    state = dict(cache=cache, topology=topology, limits=limits, buffer=buffer, history=history,
                 length=prompt.lengths + 1, passes=zero, drafted=zero, accepted=zero)
    if self.return_metadata:
      state["metadata"] = metadata.first(capacity, jax.nn.softmax(logits[:, 0], axis=-1), first)
    return state

  def step(self, params, state: dict) -> dict:
    history, length, buffer = state["history"], state["length"], state["buffer"]
    batch = history.shape[0]
    proposal, count = propose_by_lookup(history, length, self.max_ngram_size, self.num_tokens)
    count = jnp.where(buffer.done, 0, count)
    last = jnp.take_along_axis(history, (length - 1)[:, None], axis=1)  # [B, 1] not yet cached
    tokens = jnp.concatenate([last, proposal], axis=1)  # [B, 1 + D]
    offsets = jnp.arange(self.num_tokens + 1)[None, :]
    positions = (length - 1)[:, None] + offsets
    active = (offsets <= count[:, None]) & ~buffer.done[:, None]
    cached = state["cache"].length
    logits, _, cache = decode_step(params, state["cache"], tokens, positions,
                                   jnp.where(active, 0, -1), state["topology"],
                                   config=self.config, attention=self.attention)  # [B, 1+D, V]
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, 1 + D]
    accepted = greedy_accept(proposal, count, choice)  # [B]
    buffer, taken = emit(buffer, choice, accepted + 1, state["limits"])
    if self.return_metadata:
      state = dict(state, metadata=state["metadata"].record(
          state["buffer"].count, taken,
          *metadata.verified(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), choice,
                             proposal, count, accepted)))
    emitted = taken.sum(axis=1, dtype=jnp.int32)
    rows = jnp.arange(batch)[:, None]
    history = history.at[rows, jnp.where(taken, length[:, None] + offsets, history.shape[1])].set(
        choice, mode="drop")
    # keep the fed last token and the accepted proposal; a done row keeps its cache
    cache = cache_ops.rollback(cache, jnp.where(state["buffer"].done, cached, cached + 1 + accepted))
    live = ~state["buffer"].done
    return dict(state, cache=cache, buffer=buffer, history=history, length=length + emitted,
                passes=state["passes"] + 1,
                drafted=state["drafted"] + jnp.where(live, count, 0).sum(),
                accepted=state["accepted"] + jnp.where(live, accepted, 0).sum())

  def done(self, state: dict):
    return state["buffer"].done

  def result(self, state: dict):
    return state["buffer"], {"target_passes": state["passes"], "drafted": state["drafted"],
                             "accepted": state["accepted"]} | (
                                 {"metadata": state["metadata"]} if self.return_metadata else {})
