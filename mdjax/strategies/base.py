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
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from mdjax import platform
from mdjax.cache import CacheRegions, KVCache, set_columns
from mdjax.models.attention import check_attention, default_attention
from mdjax.models.config import ModelConfig
from mdjax.sampling import SAMPLING_OPTIONS, SamplingParams
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
    return own + sampling + ((cls.layout.option,) if cls.layout.option else ()) + ("attention",)

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampled(Strategy):
  """A strategy with the sampling options (Hugging Face's names and order). It decodes
  greedily unless one of them is set; then it samples, at temperature 1 unless set
  (temperature 0 is greedy)."""

  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None
  min_p: float | None = None

  def __post_init__(self):
    self.sampling  # validates the options

  @property
  def sampling(self) -> SamplingParams:
    given = {name: getattr(self, name) for name in SAMPLING_OPTIONS
             if getattr(self, name) is not None}
    return SamplingParams(**given) if given else SamplingParams(temperature=0.0)


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutputBuffer:
  """Generated tokens per output row: `tokens` int32[R, N] (-1 past `count`); `scores`
  float32[R] for strategies that score their outputs (beam search), else None."""

  tokens: Int[Array, "R N"]
  count: Int[Array, "R"]
  done: Bool[Array, "R"]
  scores: Float[Array, "R"] | None = None

  @classmethod
  def empty(cls, rows: int, capacity: int) -> "OutputBuffer":
    return cls(tokens=jnp.full((rows, capacity), -1, jnp.int32),
               count=jnp.zeros((rows,), jnp.int32), done=jnp.zeros((rows,), jnp.bool_))


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
         limits: Limits) -> tuple[OutputBuffer, Bool[Array, "R A"]]:
  """Appends the first `num_new[r]` tokens of `new[r]` to row r.

  A row stops at its first EOS (kept) or at `max_new_tokens`; a done row takes
  nothing. Returns the buffer and which of the offered tokens were taken.
  """
  offered = jnp.arange(new.shape[1])[None, :] < num_new[:, None]  # [R, A]
  is_eos = (new[..., None] == limits.eos_ids).any(-1) & offered  # [R, A]
  eos_before = (jnp.cumsum(is_eos, axis=1) - is_eos) > 0
  index = buffer.count[:, None] + jnp.arange(new.shape[1])[None, :]  # [R, A]
  taken = offered & ~eos_before & (index < limits.max_new_tokens) & ~buffer.done[:, None]
  at = jnp.where(taken, index, buffer.tokens.shape[1])  # [R, A] past the end: dropped
  tokens = set_columns(buffer.tokens, at, new)
  count = buffer.count + taken.sum(axis=1, dtype=jnp.int32)
  done = buffer.done | (taken & is_eos).any(axis=1) | (count >= limits.max_new_tokens)
  return OutputBuffer(tokens=tokens, count=count, done=done), taken


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


def run_narrowest(widths: tuple[int, ...], need, pass_at, carry, *operands):
  """`(pass_at(w)(carry, *operands), w)` for the narrowest `w` in `widths` (widest
  first) that holds `need` (a traced count) columns. On the CPU every width is
  compiled and only the one taken runs, in place (`switch_in_place`): a pass costs
  its columns' compute there. Elsewhere the widest runs: choosing on the device is a
  while loop or a conditional, whose predicate the host reads (a GPU waits for it),
  and a memory-bound pass of a few more columns costs little more."""
  if not platform.is_cpu():
    return pass_at(widths[0])(carry, *operands), jnp.asarray(widths[0], jnp.int32)
  level = sum((need <= w).astype(jnp.int32) for w in widths[1:])
  carry = switch_in_place(level, [pass_at(w) for w in widths], carry, *operands)
  return carry, jnp.asarray(widths, jnp.int32)[level]


def narrowest_width(widths: tuple[int, ...], need: int) -> int:
  """(host) The columns `run_narrowest` runs with `widths` when `need` columns are fed:
  the narrowest that holds them on the CPU, the widest elsewhere."""
  if not platform.is_cpu():
    return widths[0]
  return min(w for w in widths if w >= need)


def switch_in_place(index, branches, carry, *operands):
  """`branches[index](carry, *operands)` for a traced `index`, each branch returning
  a tree shaped like `carry` (e.g. `(logits, cache)`): what `lax.switch` gives, run
  as one while loop per branch that iterates once when taken, never otherwise.

  Inside a `lax.switch` or `lax.cond` branch, XLA:CPU copies the KV cache between
  layer writes (the attention loops take the whole cache as an operand): at
  multi_question N = 16, context 1024, 4 copies of 55 MB per pass, a third of the
  step. A while loop's body updates it in place.
  """
  for i, branch in enumerate(branches):
    def once(taken_carry, branch=branch):
      return False, branch(taken_carry[1], *operands)
    _, carry = jax.lax.while_loop(lambda taken_carry: taken_carry[0], once, (index == i, carry))
  return carry


def chain_widths(width: int) -> tuple[int, ...]:
  """The columns a verify pass may run on, widest first: the whole chain, half of it
  (chains of 6 or more), or only the last emitted token (nothing drafted). Each width
  is one more compiled pass."""
  half = (-(-width // 2),) if width >= 6 else ()
  return tuple(sorted({width, *half, 1}, reverse=True))


def decode_chains(model: ModelFn, params, cache: KVCache, tokens: Int[Array, "B N C"],
                  positions: Int[Array, "B N C"], segments: Int[Array, "B N C"],
                  topology: Topology) -> tuple[Float[Array, "B N C V"], KVCache, Int[Array, ""]]:
  """`model` over N chains of C columns per row, each chain's scored tokens a
  prefix (segment -1 after it), run only as wide as the longest prefix needs::

      chains   c d0 d1 d2 d3 d4 | c d0 .  .  .  .     longest prefix 3 -> W = 3
      fed      c d0 d1          | c d0 .              (W from `chain_widths(C)`)

  Padding takes no cache slot, so the cache is the same at any W; the logits of the
  columns not fed are zeros (past every prefix: never read). Saves the pass its
  unused columns when chains come out short (no n-gram match, a low-confidence stop,
  a small heuristic budget). Returns the logits, the cache and W.
  """
  batch, branches, width = tokens.shape
  def feed(fed: int, carry):
    def cut(x):
      return x[..., :fed].reshape(batch, branches * fed)
    logits, _, cache = model(params, carry[1], cut(tokens), cut(positions), cut(segments),
                             topology)
    logits = logits.reshape(batch, branches, fed, -1)
    return jnp.pad(logits, ((0, 0), (0, 0), (0, width - fed), (0, 0))), cache

  unfed = jnp.zeros((batch, branches, width, model.vocab_size), jnp.float32)
  (logits, cache), fed_width = run_narrowest(
      chain_widths(width), (segments >= 0).sum(axis=-1).max(),
      lambda w: functools.partial(feed, w), (unfed, cache))
  return logits, cache, fed_width
