"""The strategy protocol, and what every strategy shares: the model callback, the
prompt batch, run limits, the output buffer and the loop state's common fields.

A strategy is a frozen dataclass whose init fields are its options (hashable: it
is a static jit argument and the key of the compiled-program cache). It declares
itself once, in its own module::

    @register                                   # mdjax.strategies.registry
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MyStrategy(Strategy):
      name: ClassVar[str] = "my_strategy"       # what `generate(strategy=...)` calls it
      layout: ClassVar = prompt_layouts.Plain()        # how prompts become rows and branches
      width: int = 4                            # an option: validated in __post_init__

and `mdjax.strategies` imports the module. `generate` validates a call's options
against the init fields (`Strategy.options`), builds the strategy with the model
callback `model` (`ModelFn`: the step bound to the model's config and the attention
choice; strategies never call `decode_step` themselves), then runs

    cache_slots(prompt_len, capacity, branches) -> int     (static: the cache it needs)
    init(params, prompt, cache, limits, capacity) -> state (prefill + first tokens)
    step(params, state) -> state                           (propose -> model -> commit)
    done(state) -> bool[rows]
    result(state) -> (OutputBuffer, stats: dict of int32 scalars)

with `step` inside one compiled program's token loop (`mdjax.generate`): on a CPU a
`lax.while_loop` that stops when every row is done; on a GPU or TPU, where a while
loop's condition makes the device wait for the host, a loop of `STEPS_PER_CHECK` steps
of known trip count between two such checks, so no step waits for the host. `state` is a registered frozen dataclass
(`DecodeState` or a subclass) whose fields are documented with their shapes;
`step` returns a new one through `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from mdjax.cache import CacheRegions, KVCache, set_columns
from mdjax.errors import MdjaxError
from mdjax.models.attention import check_attention, default_attention
from mdjax.models.config import ModelConfig
from mdjax.controls import CONTROL_OPTIONS, Controls
from mdjax.sampling import (SAMPLING_OPTIONS, Sampling, SamplingParams, log_normalizer,
                            program_shape)
from mdjax.stop_strings import completed
from mdjax.step import decode_step
from mdjax.topology import Topology


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFn:
  """The model as a strategy sees it (t5x's `tokens_to_logits`): `decode_step` bound
  to one architecture and attention choice. Static and hashable; the weights come
  as the `params` argument of every call."""

  config: ModelConfig
  attention: str = "block_sparse"
  # what `hidden` is: (), the final-norm states [B, T, D]; else the residual stream after
  # these layers, concatenated [B, T, A D] (EAGLE-3 heads read three layers)
  hidden_layers: tuple[int, ...] = ()

  def __post_init__(self):
    check_attention(self.attention)

  def __call__(self, params, cache: KVCache, tokens: Int[Array, "B T"],
               positions: Int[Array, "B T"], segments: Int[Array, "B T"], topology: Topology,
               **kwargs) -> tuple[Float[Array, "B R V"], Float[Array, "B T F"], KVCache]:
    """`(logits, hidden, cache)` of one pass; `kwargs`: `logits_at`, `slots`, `regions`
    (see `mdjax.step.decode_step`)."""
    run = lambda **aux: decode_step(params, cache, tokens, positions, segments, topology,
                                    config=self.config, attention=self.attention, **kwargs, **aux)
    if not self.hidden_layers:
      return run()
    logits, _, cache, aux = run(aux_layers=self.hidden_layers)  # aux [B, T, A, D]
    return logits, aux.reshape(*aux.shape[:2], -1), cache

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size


def internal(default=None):
  """A strategy field that is not a user option (set by `Strategy.for_request` or
  fixed by a subclass)."""
  return dataclasses.field(default=default, metadata={"option": False})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
  """The base of every strategy: see the module docstring for the protocol."""

  name: ClassVar[str]
  layout: ClassVar[Any]  # a `mdjax.strategies.prompt_layouts` layout
  streams: ClassVar[bool] = True  # `mdjax.stream` can show its tokens as they come
  # a step changes nothing `result` reads of a row that is done: once every row is done,
  # steps change no result without the token loop's select (`mdjax.generate`)
  done_rows_stay: ClassVar[bool] = False
  # the controls (`mdjax.controls.CONTROL_OPTIONS`) this strategy honors; `generate`
  # refuses the others by name
  controls: ClassVar[tuple[str, ...]] = ()

  model: ModelFn = internal()
  # host-side facts about choices `for_request` made (e.g. the tree `auto` chose), merged
  # into `out.stats`; not part of the compiled program's key
  request_stats: dict | None = dataclasses.field(default=None, compare=False,
                                                 metadata={"option": False})

  @classmethod
  def options(cls) -> tuple[str, ...]:
    """The keyword arguments `generate` accepts for this strategy."""
    fields = [f.name for f in dataclasses.fields(cls) if f.init and f.metadata.get("option", True)]
    own = tuple(name for name in fields if name not in SAMPLING_OPTIONS)
    sampling = tuple(name for name in fields if name in SAMPLING_OPTIONS)
    return (own + sampling + ((cls.layout.option,) if cls.layout.option else ()) + cls.controls
            + ("attention",))

  @classmethod
  def build(cls, model, options: dict) -> tuple["Strategy", Any]:
    """The strategy for `model` (an `mdjax.Model`) with `options` (validated by its
    fields), and the params pytree it runs on: the model's, by default."""
    options = dict(options)
    target = ModelFn(config=model.config,
                     attention=options.pop("attention", None) or default_attention())
    return cls.construct(target, model, options)

  @classmethod
  def construct(cls, target: "ModelFn", model, options: dict) -> tuple["Strategy", Any]:
    """`build`'s last step, for strategies whose options need `model` (a draft
    model's params, layers cut from the target): the strategy and its params."""
    return cls(model=target, **options), model.params

  def for_request(self, params, prompt: "Prompt", capacity: int) -> "Strategy":
    """This strategy specialised to one laid-out request (e.g. its cache regions, or
    the tree `tree_budget="auto"` chose for its batch, timing passes on `params`)."""
    return self

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """Slots per row by default: the padded prompt, then `capacity` generated tokens
    per branch."""
    return prompt_len + capacity * branches

  def init(self, params, prompt: "Prompt", cache: KVCache, limits: "Limits", capacity: int):
    raise NotImplementedError

  def step(self, params, state):
    raise NotImplementedError

  def done(self, state) -> Bool[Array, "R"]:
    return state.buffer.done

  def result(self, state) -> tuple["OutputBuffer", dict]:
    return state.buffer, {"target_passes": state.passes}


def sampling_value(default=None):
  """A sampling option: a value, or a list of one value per prompt. Values are data
  (`mdjax.sampling.Sampling`, in `Limits`): not part of the strategy's equality, so
  a new value reuses the compiled program; `Sampled.greedy` and `Sampled.filters`,
  which shape the program, are."""
  return dataclasses.field(default=default, compare=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampled(Strategy):
  """A strategy with the sampling options (Hugging Face's names and order). It decodes
  greedily unless one of them is set; then it samples, at temperature 1 unless set
  (temperature 0 is greedy). Each option is one value or a list of one per prompt.
  Every sampled strategy honors every control (`mdjax.controls`): its choices, drafts
  and verifications read the processed logits."""

  controls: ClassVar = CONTROL_OPTIONS

  temperature: float | list | None = sampling_value()
  top_k: int | list | None = sampling_value()
  top_p: float | list | None = sampling_value()
  min_p: float | list | None = sampling_value()
  # what the values decide about the program (compared: part of the compiled key)
  greedy: bool = dataclasses.field(init=False, default=True)
  filters: tuple[str, ...] = dataclasses.field(init=False, default=())

  def __post_init__(self):
    greedy, filters = program_shape(self.per_prompt(None))  # validates the options
    object.__setattr__(self, "greedy", greedy)
    object.__setattr__(self, "filters", filters)

  def per_prompt(self, num_prompts: int | None) -> list[SamplingParams]:
    """Each prompt's validated values (every given list's values when `num_prompts` is
    None); a list must hold one value per prompt."""
    given = {name: getattr(self, name) for name in SAMPLING_OPTIONS
             if getattr(self, name) is not None}
    lengths = {name: len(v) for name, v in given.items() if isinstance(v, (list, tuple))}
    for name, length in lengths.items():
      if length == 0 or (num_prompts is not None and length != num_prompts):
        raise MdjaxError(f"{name} has {length} values for {num_prompts} prompts: give one "
                         "value, or one per prompt")
    count = num_prompts if num_prompts is not None else max(lengths.values(), default=1)
    at = lambda v, i: v[i % len(v)] if isinstance(v, (list, tuple)) else v
    if not given:
      return [SamplingParams(temperature=0.0)] * count
    return [SamplingParams(**{name: at(v, i) for name, v in given.items()}) for i in range(count)]

  def sampling_data(self, num_prompts: int, branches: int, vocab_size: int) -> Sampling:
    """The values as data, one per output row (row b * branches + j: prompt b)."""
    rows = self.per_prompt(num_prompts)
    return Sampling.of([row for row in rows for _ in range(branches)], vocab_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompt:
  """What every row prefills, and where its branches start decoding.

    tokens, positions, segments  int32[B, P]   right-padded (segment -1 = padding)
    lengths                      int32[B]      real tokens per row
    parent, fork                 int32[B, G]   the segment tree (`mdjax.topology`)
    branch_segment               int32[B, N]   segment each branch decodes in (-1: none)
    branch_last                  int32[B, N]   token whose logits give the branch's first token

  A plain prompt is one branch in segment 0. Questions over one context (see
  `mdjax.strategies.prompt_layouts`): the context is segment 0 at positions 0..c-1, question j is
  segment j+1 forked at c, at positions c, c+1, ...; branch j continues after it.
  """

  tokens: Int[Array, "B P"]
  positions: Int[Array, "B P"]
  segments: Int[Array, "B P"]
  lengths: Int[Array, "B"]
  parent: Int[Array, "B G"]
  fork: Int[Array, "B G"]
  branch_segment: Int[Array, "B N"]
  branch_last: Int[Array, "B N"]

  def topology(self) -> Topology:
    return Topology(parent=self.parent, fork=self.fork)

  def branch_positions(self) -> Int[Array, "B N"]:
    """Position of each branch's first generated token."""
    return jnp.take_along_axis(self.positions, self.branch_last, axis=1) + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Limits:
  """Run-time (traced) limits: changing them does not recompile."""

  max_new_tokens: Int[Array, ""]
  eos_ids: Int[Array, "E"]  # -1 entries never match
  key: jax.Array  # PRNG key of the whole run
  sampling: Sampling | None = None  # a `Sampled` strategy's values, one per output row
  controls: Controls | None = None  # the request's controls (`mdjax.controls`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutputBuffer:
  """Generated tokens per output row: `tokens` int32[R, N] (-1 past `count`); `scores`
  float32[R] for strategies that score their outputs (beam search), else None. With the
  controls that ask for them (`mdjax.controls`), else None:

    logprobs      float32[R, N]     each token's log-probability under the distribution
                                    it was chosen from (after every processor)
    top_ids       int32[R, N, k]    the k likeliest tokens there (top_logprobs = k)
    top_logprobs  float32[R, N, k]
    stopped_by    int32[R]          the stop string that ended the row (-1: none)
  """

  tokens: Int[Array, "R N"]
  count: Int[Array, "R"]
  done: Bool[Array, "R"]
  scores: Float[Array, "R"] | None = None
  logprobs: Float[Array, "R N"] | None = None
  top_ids: Int[Array, "R N k"] | None = None
  top_logprobs: Float[Array, "R N k"] | None = None
  stopped_by: Int[Array, "R"] | None = None

  @classmethod
  def empty(cls, rows: int, capacity: int, limits: "Limits | None" = None) -> "OutputBuffer":
    """No token yet; room for what `limits`' controls record."""
    controls = None if limits is None else limits.controls
    top = -1 if controls is None else controls.logprobs
    return cls(tokens=jnp.full((rows, capacity), -1, jnp.int32),
               count=jnp.zeros((rows,), jnp.int32), done=jnp.zeros((rows,), jnp.bool_),
               logprobs=jnp.zeros((rows, capacity), jnp.float32) if top >= 0 else None,
               top_ids=jnp.zeros((rows, capacity, top), jnp.int32) if top > 0 else None,
               top_logprobs=jnp.zeros((rows, capacity, top), jnp.float32) if top > 0 else None,
               stopped_by=(None if controls is None or controls.stops is None
                           else jnp.full((rows,), -1, jnp.int32)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeState:
  """The loop state every strategy with an output buffer carries; a strategy's own
  state subclasses it (and is registered as a pytree too).

    cache     KVCache             the target's cache (the loop's largest carry)
    limits    Limits              max_new_tokens, EOS ids, the run's PRNG key
    buffer    OutputBuffer [R]    generated tokens per output row
    passes    int32[]             target passes after prefill; None where a strategy's
                                  state says it otherwise (a counter fewer for a step to
                                  update: `AutoregressiveState.passes_run`)
  """

  cache: KVCache
  limits: Limits
  buffer: OutputBuffer
  passes: Int[Array, ""] | None


def emit(buffer: OutputBuffer, new: Int[Array, "R A"], num_new: Int[Array, "R"],
         limits: Limits, scored: "Scored | None" = None
         ) -> tuple[OutputBuffer, Bool[Array, "R A"]]:
  """Appends the first `num_new[r]` tokens of `new[r]` to row r (with their
  log-probabilities, `scored`, where the buffer records them).

  A row stops at its first EOS (kept), after the token that completes a stop string
  (kept: `mdjax.stop_strings`) or at `max_new_tokens`; a done row takes nothing.
  Returns the buffer and which of the offered tokens were taken.
  """
  offered = jnp.arange(new.shape[1])[None, :] < num_new[:, None]  # [R, A]
  index = buffer.count[:, None] + jnp.arange(new.shape[1])[None, :]  # [R, A]
  room = offered & (index < limits.max_new_tokens) & ~buffer.done[:, None]
  ends = (new[..., None] == limits.eos_ids).any(-1) & offered  # [R, A]
  stops = limits.controls.stops if limits.controls is not None else None
  if stops is not None:  # which stop string each offered token completes, were it taken
    past_end = buffer.tokens.shape[1]
    completes = completed(stops, set_columns(buffer.tokens, jnp.where(room, index, past_end), new),
                          jnp.where(room, index, -1), limits.controls.stop_tail)  # [R, A]
    ends = ends | (completes >= 0)
  end_before = (jnp.cumsum(ends, axis=1) - ends) > 0
  taken = room & ~end_before
  at = jnp.where(taken, index, buffer.tokens.shape[1])  # [R, A] past the end: dropped
  tokens = set_columns(buffer.tokens, at, new)
  count = buffer.count + taken.sum(axis=1, dtype=jnp.int32)
  done = buffer.done | (taken & ends).any(axis=1) | (count >= limits.max_new_tokens)
  fields = dict(tokens=tokens, count=count, done=done)
  if stops is not None and buffer.stopped_by is not None:
    stopped = taken & (completes >= 0)  # at most one per row: the row ends there
    fields["stopped_by"] = jnp.where(stopped.any(axis=1), completes.max(axis=1, where=stopped,
                                                                         initial=-1),
                                     buffer.stopped_by)
  if buffer.logprobs is not None:
    rows = jnp.arange(new.shape[0])[:, None]
    fields["logprobs"] = set_columns(buffer.logprobs, at, scored.logprobs)
    if buffer.top_ids is not None:
      fields["top_ids"] = buffer.top_ids.at[rows, at].set(scored.top_ids, mode="drop")
      fields["top_logprobs"] = buffer.top_logprobs.at[rows, at].set(scored.top_logprobs,
                                                                    mode="drop")
  return dataclasses.replace(buffer, **fields), taken


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scored:
  """Log-probabilities of offered tokens (`emit`): `logprobs` float32[R, A]; with
  top_logprobs = k, `top_ids` int32[R, A, k] and `top_logprobs` float32[R, A, k]."""

  logprobs: Float[Array, "R A"]
  top_ids: Int[Array, "R A k"] | None = None
  top_logprobs: Float[Array, "R A k"] | None = None

  @classmethod
  def of(cls, processed: Float[Array, "R A V"], tokens: Int[Array, "R A"],
         top: int) -> "Scored":
    """From the processed logits each token was chosen from (filtered tokens at -inf):
    a logit less the row's log-normalizer, never a log-softmax over the vocabulary."""
    processed = processed.astype(jnp.float32)
    normalizer = log_normalizer(processed)  # [R, A, 1]
    chosen = jnp.take_along_axis(processed, tokens[..., None], axis=-1) - normalizer
    if top <= 0:
      return cls(chosen[..., 0])
    best, ids = jax.lax.top_k(processed, top)
    return cls(chosen[..., 0], ids.astype(jnp.int32), best - normalizer)

  @classmethod
  def requested(cls, processed: Float[Array, "R A V"], tokens: Int[Array, "R A"],
                limits: Limits) -> "Scored | None":
    """`of` the logits the tokens were chosen from (controls and sampling values
    applied: `mdjax.sampling.process_logits`) where the request asks for
    log-probabilities, else None."""
    if limits.controls is None or limits.controls.logprobs < 0:
      return None
    return cls.of(processed, tokens, limits.controls.logprobs)


def last_emitted(buffer: OutputBuffer) -> Int[Array, "R"]:
  """Each row's last emitted token (0 where none is): what a strategy that keeps no
  copy of it feeds next (a step that updates one array fewer)."""
  last = jnp.maximum(buffer.count - 1, 0)[:, None]  # [R, 1]
  return jnp.maximum(jnp.take_along_axis(buffer.tokens, last, axis=1)[:, 0], 0)


def prefill(model: ModelFn, params, prompt: Prompt, cache: KVCache,
            slots: Int[Array, "B P"] | None = None
            ) -> tuple[Float[Array, "B N V"], KVCache, Topology]:
  """Every row's context and branch tokens in one pass (into `slots` when given): the
  logits that start each branch, the cache, and the prompt's topology."""
  logits, _, cache, topology = prefill_with_hidden(model, params, prompt, cache, slots)
  return logits, cache, topology


def prefill_with_hidden(model: ModelFn, params, prompt: Prompt, cache: KVCache,
                        slots: Int[Array, "B P"] | None = None
                        ) -> tuple[Float[Array, "B N V"], Float[Array, "B P H"], KVCache, Topology]:
  """`prefill`, and the final-norm hidden states of every prompt token (what heads read)."""
  topology = prompt.topology()
  logits, hidden, cache = model(params, cache, prompt.tokens, prompt.positions, prompt.segments,
                                topology, logits_at=prompt.branch_last, slots=slots)  # [B, N, V]
  return logits, hidden, cache, topology


def branch_membership(prompt: Prompt) -> Bool[Array, "B P N"]:
  """`[b, i, j]`: prompt token i of row b belongs to branch j (its question, suffix)."""
  return ((prompt.segments[:, :, None] == prompt.branch_segment[:, None, :])
          & (prompt.segments >= 0)[..., None])


def branch_token_counts(prompt: Prompt) -> tuple[int, int]:
  """(host) The most shared prompt tokens of a row, and the most prompt tokens of one
  branch: what `regions` must hold besides generated tokens."""
  in_branch = np.asarray(branch_membership(prompt))  # [B, P, N]
  shared = ((np.asarray(prompt.segments) >= 0) & ~in_branch.any(-1)).sum(axis=1)  # [B]
  return int(shared.max()), int(in_branch.sum(axis=1).max())


def region_slot_base(prompt: Prompt, regions: CacheRegions) -> Int[Array, "B N"]:
  """With one cache region per branch (`mdjax.cache.CacheRegions`), branch j's token
  at position p takes slot `base[b, j] + p`: its region's first slot minus its fork
  position, so the branch's tokens fill the region in order from its fork (question,
  then answer)."""
  fork = jnp.take_along_axis(prompt.fork, jnp.maximum(prompt.branch_segment, 0), axis=1)
  first = regions.shared + jnp.arange(prompt.branch_segment.shape[1]) * regions.size  # [N]
  return first - fork  # [B, N]


def region_prompt_slots(prompt: Prompt, regions: CacheRegions) -> Int[Array, "B P"]:
  """The slot of every prompt token with one region per branch: shared tokens keep
  their index (`layout_prompts` and `layout_chains` put them first), branch tokens go
  to their region."""
  in_branch = branch_membership(prompt)  # [B, P, N]
  base = jnp.take_along_axis(region_slot_base(prompt, regions), jnp.argmax(in_branch, -1),
                             axis=1)  # [B, P]
  return jnp.where(in_branch.any(-1), base + prompt.positions,
                   jnp.arange(prompt.tokens.shape[1]))
