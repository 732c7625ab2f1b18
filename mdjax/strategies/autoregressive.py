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
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from mdjax import controls, platform
from mdjax.cache import CacheRegions, KVCache
from mdjax.prompts import bucket
from mdjax.sampling import draw, process_logits, row_keys
from mdjax.strategies import prompt_layouts
from mdjax.strategies.base import (DecodeState, Limits, OutputBuffer, Prompt, Sampled, Scored,
                                   branch_token_counts, emit, internal, last_emitted, prefill,
                                   region_prompt_slots, region_slot_base, sampling_value)
from mdjax.strategies.registry import register
from mdjax.strategies.widths import run_narrowest
from mdjax.topology import Topology


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoregressiveState(DecodeState):
  """`DecodeState` (buffer rows R = B * N: row b * N + j is branch j of row b; `passes`
  None: every pass advances every branch by one position, `passes_run`), and

    topology        Topology [B, G]  the prompt's segment tree (`Prompt.topology`)
    branch_segment  int32[B, N]   the segment branch j decodes in (-1: no such branch)
    first_pos       int32[B, N]   the position of branch j's first generated token
    next_pos        int32[B, N]   the position of the token branch j feeds next (a done
                                  branch's stays)
    slot_base       int32[B, N]   with regions, its token at position p takes slot
                                  slot_base + p (`region_slot_base`); else None
    columns_fed     int32[]       columns fed over all passes (B x the pass's width); None
                                  where every pass is N wide (`run_narrowest` off the
                                  CPU): passes x B x N

  A live branch feeds its last emitted token (`last_emitted`). What a step updates beside
  the cache is the output buffer, `next_pos` and (on the CPU) `columns_fed`: on a GPU,
  each array a step updates is a kernel or more.
  """

  topology: Topology
  branch_segment: Int[Array, "B N"]
  first_pos: Int[Array, "B N"]
  next_pos: Int[Array, "B N"]
  slot_base: Int[Array, "B N"] | None
  columns_fed: Int[Array, ""] | None

  def passes_run(self) -> Int[Array, ""]:
    """Target passes after prefill: how far the branches' positions advanced."""
    return (self.next_pos - self.first_pos).max()

  def last_emitted(self) -> Int[Array, "B N"]:
    """Each branch's last emitted token (0 where none is: a missing branch, fed as
    padding)."""
    return last_emitted(self.buffer).reshape(self.branch_segment.shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Autoregressive(Sampled):
  """One token per live branch per pass; greedy unless a sampling option is set."""

  layout: ClassVar = prompt_layouts.Plain()
  done_rows_stay: ClassVar = True  # a done branch feeds padding, takes no token, stays put
  regions: CacheRegions | None = internal()  # one cache region per branch, or appending

  def for_request(self, params, prompt: Prompt, capacity: int) -> "Autoregressive":
    """With several branches, one cache region each: the shared tokens padded to a
    bucket, then per branch its own prompt tokens (rounded to 16) + `capacity`."""
    if prompt.branch_segment.shape[1] < 2:
      return self
    shared, own = branch_token_counts(prompt)
    return dataclasses.replace(self, regions=CacheRegions(bucket(shared),
                                                          -(-own // 16) * 16 + capacity))

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """Slots per row: the padded prompt, then one per generated token of every branch
    (or the shared slots and one region per branch)."""
    if self.regions is not None:
      return self.regions.shared + self.regions.size * branches
    return super().cache_slots(prompt_len, capacity, branches)

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> AutoregressiveState:
    slots = None if self.regions is None else region_prompt_slots(prompt, self.regions)
    logits, cache, topology = prefill(self.model, params, prompt, cache, slots)
    absent = (prompt.branch_segment < 0).reshape(-1)  # [B * N] rows of missing branches
    buffer = dataclasses.replace(OutputBuffer.empty(absent.shape[0], capacity, limits),
                                 done=absent)
    state = AutoregressiveState(
        cache=cache, topology=topology, limits=limits, buffer=buffer,
        passes=None, branch_segment=prompt.branch_segment,
        first_pos=prompt.branch_positions(), next_pos=prompt.branch_positions(),
        slot_base=None if self.regions is None else region_slot_base(prompt, self.regions),
        columns_fed=jnp.zeros((), jnp.int32) if platform.is_cpu() else None)
    return self._commit(state, logits)

  def step(self, params, state: AutoregressiveState) -> AutoregressiveState:
    done = state.buffer.done.reshape(state.branch_segment.shape)  # [B, N]
    unfed = jnp.zeros((*done.shape, self.model.vocab_size), jnp.float32)  # [B, N, V]
    without_cache = dataclasses.replace(state, cache=None)  # the cache only in the carry
    (logits, cache), width = run_narrowest(
        feed_widths(done.shape[1]), (~done).sum(axis=1).max(),  # holds every row's live
        lambda w: functools.partial(self._feed, width=w), (unfed, state.cache),
        params, without_cache, done)
    columns_fed = None if state.columns_fed is None else state.columns_fed + width * done.shape[0]
    state = dataclasses.replace(state, cache=cache, next_pos=state.next_pos + ~done,
                                columns_fed=columns_fed)  # B * W
    return self._commit(state, logits)

  def _feed(self, carry, params, state: AutoregressiveState, done, *, width: int):
    """One pass over `width` columns, the live branches first: `(logits [B, N, V],
    cache)` from the `(logits, cache)` carry."""
    batch, branches = done.shape
    if width == branches:
      columns = jnp.broadcast_to(jnp.arange(branches), done.shape)
    else:
      columns = jnp.argsort(done, axis=1, stable=True)[:, :width]  # [B, W] live first
    pick = functools.partial(jnp.take_along_axis, indices=columns, axis=1)
    segments = jnp.where(pick(done), -1, pick(state.branch_segment))  # [B, W]
    positions = pick(state.next_pos)  # [B, W]
    slots = None if self.regions is None else pick(state.slot_base) + positions
    tokens = pick(state.last_emitted())  # [B, W]
    logits, _, cache = self.model(params, carry[1], tokens, positions, segments,
                                  state.topology, slots=slots,
                                  regions=self._pass_regions(width == branches))  # [B, W, V]
    if width == branches:  # every branch its own column: no scatter into the carry's zeros
      return logits, cache
    rows = jnp.arange(batch)[:, None]
    return carry[0].at[rows, columns].set(logits), cache  # finished columns: zeros, never emitted

  def _pass_regions(self, full_width: bool) -> CacheRegions | None:
    """A full-width pass feeds branch t as column t, so its queries are in order."""
    return None if self.regions is None else self.regions._replace(in_order=full_width)

  def _commit(self, state: AutoregressiveState,
              logits: Float[Array, "B N V"]) -> AutoregressiveState:
    """Chooses every branch's next token from `logits` and emits it."""
    limits, buffer = state.limits, state.buffer
    rows = buffer.count.shape[0]  # B * N
    logits = logits.reshape(rows, 1, -1)  # [R, 1, V]
    logits = controls.process(logits, limits.controls,
                              controls.Context.plain(buffer.tokens, buffer.count), limits.eos_ids)
    keys = row_keys(limits.key, jnp.arange(rows), buffer.count)
    processed = process_logits(logits, limits.sampling)  # [R, 1, V]
    token = draw(keys, processed[:, 0], limits.sampling.greedy)  # [R]
    buffer, _ = emit(buffer, token[:, None], jnp.ones_like(token), limits,
                     Scored.requested(processed, token[:, None], limits))
    return dataclasses.replace(state, buffer=buffer)

  def result(self, state: AutoregressiveState):
    passes, columns_fed = state.passes_run(), state.columns_fed
    if columns_fed is None:
      columns_fed = passes * state.branch_segment.size  # B * N every pass
    return state.buffer, {"target_passes": passes, "columns_fed": columns_fed}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnTarget(Autoregressive):
  """Plain decoding for a strategy whose params are `{"target": ..., ...}` (a draft's or
  heads' beside the target's): what `tree_budget="auto"` runs when no tree pays
  (`mdjax.strategies.tree_choice`). Not registered: no one asks for it by name."""

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> AutoregressiveState:
    return super().init(params["target"], prompt, cache, limits, capacity)

  def step(self, params, state: AutoregressiveState) -> AutoregressiveState:
    return super().step(params["target"], state)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Greedy(Autoregressive):
  """The argmax token every pass."""

  name: ClassVar[str] = "greedy"
  temperature: float | None = internal()
  top_k: int | None = internal()
  top_p: float | None = internal()
  min_p: float | None = internal()


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample(Autoregressive):
  """Sampling, at temperature 1 unless set."""

  name: ClassVar[str] = "sample"
  temperature: float | list | None = sampling_value(1.0)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiQuestion(Autoregressive):
  """Every question a branch over the shared context; answer j is what greedy (or
  sampling) gives for context + question j alone."""

  name: ClassVar[str] = "multi_question"
  layout: ClassVar = prompt_layouts.Questions()


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelSample(Sample):
  """`num_samples` samples per prompt, all over the prompt's one cached copy."""

  name: ClassVar[str] = "parallel_sample"
  layout: ClassVar = prompt_layouts.Samples()


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SkeletonFill(Autoregressive):
  """A branch fills each stub of a Python skeleton, seeing the source up to its stub."""

  name: ClassVar[str] = "skeleton_fill"
  layout: ClassVar = prompt_layouts.Chains()


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class MarginNotes(Autoregressive):
  """A note after every chunk of a context (`instruction`, then the note), each
  seeing the chunks up to its own (writing in the margins' first phase)."""

  name: ClassVar[str] = "margin_notes"
  layout: ClassVar = prompt_layouts.Chains(option="instruction")


def feed_widths(branches: int) -> tuple[int, ...]:
  """The column counts a pass may run on, widest first: N, ceil(N/2) for N >= 4, and
  ceil(N/4) too for N >= 8 (each width is one more compiled pass; fewer branches gain
  too little to pay for it)."""
  halvings = 0 if branches < 4 else 1 if branches < 8 else 2
  return tuple(sorted({-(-branches // 2**k) for k in range(halvings + 1)}, reverse=True))
