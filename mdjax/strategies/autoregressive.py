"""`greedy`, `sample`, `multi_question`, `parallel_sample`: one token per branch per pass.

Every row holds N branches (N = 1 for plain prompts). Branch j of a row decodes in
its own segment (see `mdjax.strategies.base.Prompt`); each pass feeds one token per
live branch, at that branch's next position, so all branches of all rows advance in
one `decode_step` over one shared cache. A branch that finished feeds padding
(segment -1), which takes no slot. Two questions over one context, after prefill
and one pass::

    slot   0 1 2 | 3 4 | 5 6 | 7 8
    seg    0 0 0 | 1 1 | 2 2 | 1 2       context at 0..2; questions at 3..4
    pos    0 1 2 | 3 4 | 3 4 | 5 5       answers continue at 5, 6, ... in their segment

With `regions` (`mdjax.cache.CacheRegions`; `mdjax.generate` sets them for N >= 2 branches)
each branch instead owns `size` slots after `shared` ones, question then answer, so
a pass's query reads only the context and its own region
(`mdjax.models.attention.cascade_attention`). The same two questions, shared = 4,
size = 4::

    slot   0 1 2 . | 4 5 6 . | 8 9 10 .
    seg    0 0 0   | 1 1 1   | 2 2 2
    pos    0 1 2   | 3 4 5   | 3 4 5
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mdjax.cache import CacheRegions, KVCache
from mdjax.models.config import ModelConfig
from mdjax.sampling import SamplingParams, choose, row_keys
from mdjax.step import decode_step
from mdjax.strategies.base import (Limits, OutputBuffer, Prompt, emit, prefill,
                                   region_prompt_slots, region_slot_base, run_narrowest)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Autoregressive:
  config: ModelConfig
  sampling: SamplingParams = SamplingParams(temperature=0.0)
  attention: str = "block_sparse"
  regions: CacheRegions | None = None  # one cache region per branch, or appending

  def cache_slots(self, prompt_len: int, max_new_tokens: int, branches: int = 1) -> int:
    """Slots per row: the padded prompt, then one per generated token of every branch
    (or the shared slots and one region per branch)."""
    if self.regions is not None:
      return self.regions.shared + self.regions.size * branches
    return prompt_len + max_new_tokens * branches

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits, capacity: int) -> dict:
    slots = None if self.regions is None else region_prompt_slots(prompt, self.regions)
    logits, cache, topology = prefill(params, prompt, cache, self.config, self.attention, slots)
    absent = (prompt.branch_segment < 0).reshape(-1)  # [B * N] rows of missing branches
    buffer = dataclasses.replace(OutputBuffer.empty(absent.shape[0], capacity), done=absent)
    state = dict(cache=cache, topology=topology, limits=limits, buffer=buffer,
                 branch_segment=prompt.branch_segment, next_pos=prompt.branch_positions(),
                 last=jnp.zeros(prompt.branch_segment.shape, jnp.int32),
                 slot_base=None if self.regions is None else region_slot_base(prompt, self.regions),
                 passes=jnp.zeros((), jnp.int32), columns_fed=jnp.zeros((), jnp.int32))
    return self._commit(state, logits)

  def step(self, params, state: dict) -> dict:
    done = state["buffer"].done.reshape(state["last"].shape)  # [B, N]
    unfed = jnp.zeros((*done.shape, self.config.vocab_size), jnp.float32)  # [B, N, V]
    others = {k: v for k, v in state.items() if k != "cache"}  # the cache only in the carry
    (logits, cache), width = run_narrowest(
        feed_widths(done.shape[1]), (~done).sum(axis=1).max(),  # holds every row's live
        lambda w: functools.partial(self._feed, width=w), (unfed, state["cache"]),
        params, others, done)
    state = dict(state, cache=cache, next_pos=state["next_pos"] + 1, passes=state["passes"] + 1,
                 columns_fed=state["columns_fed"] + width * done.shape[0])  # B * W columns
    return self._commit(state, logits)

  def _feed(self, carry, params, state: dict, done, *, width: int):
    """One pass over `width` columns, the live branches first: `(logits [B, N, V],
    cache)` from the `(logits, cache)` carry."""
    batch, branches = done.shape
    if width == branches:
      columns = jnp.broadcast_to(jnp.arange(branches), done.shape)
    else:
      columns = jnp.argsort(done, axis=1, stable=True)[:, :width]  # [B, W] live first
    pick = functools.partial(jnp.take_along_axis, indices=columns, axis=1)
    segments = jnp.where(pick(done), -1, pick(state["branch_segment"]))  # [B, W]
    positions = pick(state["next_pos"])  # [B, W]
    slots = None if self.regions is None else pick(state["slot_base"]) + positions
    logits, _, cache = decode_step(params, carry[1], pick(state["last"]), positions,
                                   segments, state["topology"], config=self.config,
                                   attention=self.attention, slots=slots,
                                   regions=self._pass_regions(width == branches))  # [B, W, V]
    rows = jnp.arange(batch)[:, None]
    return carry[0].at[rows, columns].set(logits), cache  # finished columns: zeros, never emitted

  def _pass_regions(self, full_width: bool) -> CacheRegions | None:
    """A full-width pass feeds branch t as column t, so its queries are in order."""
    return None if self.regions is None else self.regions._replace(in_order=full_width)

  def _commit(self, state: dict, logits) -> dict:
    """Chooses every branch's next token from `logits` [B, N, V] and emits it."""
    buffer = state["buffer"]
    rows = buffer.count.shape[0]  # B * N
    keys = row_keys(state["limits"].key, jnp.arange(rows), buffer.count)
    token = choose(keys, logits.reshape(rows, -1), self.sampling)  # [B * N]
    buffer, _ = emit(buffer, token[:, None], jnp.ones_like(token), state["limits"])
    return dict(state, buffer=buffer, last=token.reshape(state["last"].shape))

  def done(self, state: dict):
    return state["buffer"].done

  def result(self, state: dict):
    return state["buffer"], {"target_passes": state["passes"],
                             "columns_fed": state["columns_fed"]}


def feed_widths(branches: int) -> tuple[int, ...]:
  """The column counts a pass may run on, widest first: N, ceil(N/2) for N >= 4, and
  ceil(N/4) too for N >= 8 (each width is one more compiled pass; fewer branches gain
  too little to pay for it)."""
  halvings = 0 if branches < 4 else 1 if branches < 8 else 2
  return tuple(sorted({-(-branches // 2**k) for k in range(halvings + 1)}, reverse=True))
