"""Batched, compiled generation that keeps what heads train on, from the same pass.

Each of the B rows of the batch decodes one work item (a prompt, and which sample of
it). A row that finishes (EOS, or `max_new_tokens`) is refilled with the next item,
`refill_rows` rows at a time, so the batch stays full (continuous batching)::

    row 0   [prompt a ....][answer a ........EOS]··[prompt e ...][answer e ....
    row 1   [prompt b ..][answer b ....................max_new]··[prompt f ...
    row 2   [prompt c ......][answer c ..EOS]··[prompt d ..][answer d .........
            first fill                          ^ refill        ^ refill
            (··: idle steps, until `refill_rows` rows are free at the end of a call)

A refill is its own pass over `[R, P]` prompt tokens (a fresh `[R, P]`-slot cache,
then copied into the freed rows of the batch's cache), so a refill costs only the
new prompts, never a pass of the whole batch; a compiled call then runs
`steps_per_call` decode steps of one token per row.

Every token, prompt and answer alike, leaves the pass that feeds it with its
final-norm hidden state `[D]` and the residual stream after `aux_layers` `[A, D]`
(float16): a prompt's from its refill pass, an answer token's from the decode step
that feeds it. The passes that compute logits (the last prompt token's, every answer
token's) also leave the model's greedy guess of the token after it (the argmax of the
logits the sampler draws from): what a greedy verifier accepts, with no extra pass. A
finished row feeds its last token (the EOS) once more before it stops, so every token
has its states, which are those of `forward_causal` over the row's tokens: no second
pass.

Sampling keys are per (item, answer token) (`mdjax.sampling.row_keys`): an item's
answer does not depend on the row or the batch that decoded it, so an item lost to a
kill is generated again the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from mdjax import programs
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError, check_count
from mdjax.models.config import ModelConfig
from mdjax.models.model import Model
from mdjax.models.transformer import Params
from mdjax.prompts import bucket
from mdjax.sampling import SamplingParams, process_logits, row_keys
from mdjax.step import decode_step
from mdjax.topology import Topology

MIN_PROMPT_BUCKET = 64  # refill widths are powers of two from here: few compiled programs


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaptureOptions:
  """The static settings of the compiled calls (hashable: a jit static argument).

  eos: the ids that end an answer; steps_per_call: decode steps per compiled call
  (a row that finishes mid-call idles to its end: small, for little waste; large,
  for few host round trips); attention: as `decode_step`'s."""

  config: ModelConfig
  aux_layers: tuple[int, ...]
  sampling: SamplingParams
  max_new_tokens: int
  eos: tuple[int, ...]
  steps_per_call: int = 8
  attention: str = "block_sparse"

  def __post_init__(self):
    check_count("max_new_tokens", self.max_new_tokens, 1)
    check_count("steps_per_call", self.steps_per_call, 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class CaptureState:
  """The batch between compiled calls (B rows).

    cache     KVCache [L, B, S, K, H]  one row per item in flight
    last      int32[B]  the token each row feeds next (its newest answer token)
    next_pos  int32[B]  that token's position
    count     int32[B]  answer tokens so far, `last` included
    item      int32[B]  the row's work item: its sampling keys
    live      bool[B]   has a token to feed
  """

  cache: KVCache
  last: Int[Array, "B"]
  next_pos: Int[Array, "B"]
  count: Int[Array, "B"]
  item: Int[Array, "B"]
  live: Bool[Array, "B"]

  @classmethod
  def empty(cls, config: ModelConfig, batch: int, slots: int) -> "CaptureState":
    zeros = lambda: jnp.zeros((batch,), jnp.int32)  # distinct buffers: the state is donated
    return cls(cache=KVCache.create(config, batch, slots), last=zeros(), next_pos=zeros(),
               count=zeros(), item=zeros() - 1, live=jnp.zeros((batch,), bool))


def pick_tokens(keys: jax.Array, logits: Float[Array, "B V"], sampling: SamplingParams
                ) -> tuple[Int[Array, "B"], Int[Array, "B"]]:
  """(the token drawn, the row's argmax). The draw follows `mdjax.sampling.choose`'s law
  (`process_logits`), by inverse CDF: one uniform per row (its key), the first token
  whose cumulative weight passes it. Cheap on CPU, where the Gumbel noise of a
  full-vocabulary draw costs more than the `lm_head` that made the logits."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
  if sampling.greedy:
    return greedy, greedy
  logits = process_logits(logits, sampling)  # [B, V], filtered tokens at -inf
  cumulative = jnp.cumsum(jnp.exp(logits - logits.max(axis=-1, keepdims=True)), axis=-1)
  drawn = jax.vmap(jax.random.uniform)(keys)[:, None] * cumulative[:, -1:]  # [B, 1]
  return jnp.argmax(cumulative > drawn, axis=-1).astype(jnp.int32), greedy


def _states(hidden: Float[Array, "... D"], aux: list) -> tuple:
  """(hidden, aux or None) in float16: what is kept of a pass."""
  return hidden.astype(jnp.float16), (aux[0].astype(jnp.float16) if aux else None)


@functools.partial(programs.jit, static_argnames=("options",), donate_argnames=("state",))
def refill(params: Params, state: CaptureState, rows: Int[Array, "R"], tokens: Int[Array, "R P"],
           lengths: Int[Array, "R"], items: Int[Array, "R"], key: jax.Array, *,
           options: CaptureOptions):
  """Starts `items` in `rows` (B for an unused entry: dropped) from their prompts,
  `tokens` right-padded to P; samples each first answer token. Returns the state and
  the prompts' `(hidden [R, P, D], aux [R, P, A, D] or None)` in float16 and the
  greedy guess after each prompt's last token `[R]`."""
  r, p = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (r, p))  # [R, P]
  segments = jnp.where(positions < lengths[:, None], 0, -1)  # [R, P] padding: -1
  logits, hidden, fresh, *aux = decode_step(
      params, KVCache.create(options.config, r, p, state.cache.dtype), tokens, positions,
      segments, Topology.causal(r), config=options.config, logits_at=(lengths - 1)[:, None],
      aux_layers=options.aux_layers)  # logits [R, 1, V]
  first, greedy = pick_tokens(row_keys(key, items, jnp.zeros_like(items)), logits[:, 0],
                              options.sampling)
  cache = state.cache
  cache = cache.replace(
      k=cache.k.at[:, rows, :p].set(fresh.k, mode="drop"),
      v=cache.v.at[:, rows, :p].set(fresh.v, mode="drop"),
      pos=cache.pos.at[rows, :p].set(fresh.pos, mode="drop"),
      seg=cache.seg.at[rows].set(-1, mode="drop").at[rows, :p].set(fresh.seg, mode="drop"),
      length=cache.length.at[rows].set(lengths, mode="drop"))
  put = lambda field, value: field.at[rows].set(value, mode="drop")
  state = CaptureState(cache=cache, last=put(state.last, first),
                       next_pos=put(state.next_pos, lengths), count=put(state.count, 1),
                       item=put(state.item, items), live=put(state.live, True))
  return state, (*_states(hidden, aux), greedy)


@functools.partial(programs.jit, static_argnames=("options",), donate_argnames=("state",))
def decode(params: Params, state: CaptureState, key: jax.Array, *, options: CaptureOptions):
  """`options.steps_per_call` decode steps of every live row. Returns the state and,
  per step k and row b, what was fed: `(token [K, B], fed [K, B] (bool: a live row's
  token), hidden [K, B, D], aux [K, B, A, D] or None, greedy [K, B] (the model's
  greedy guess of the token after it))`, states in float16."""
  batch = state.last.shape[0]
  topology = Topology.causal(batch)
  eos = jnp.asarray(options.eos, jnp.int32)

  def step(state: CaptureState, _):
    finishing = jnp.isin(state.last, eos) | (state.count >= options.max_new_tokens)  # [B]
    segments = jnp.where(state.live, 0, -1)[:, None]  # [B, 1]
    logits, hidden, cache, *aux = decode_step(
        params, state.cache, state.last[:, None], state.next_pos[:, None], segments, topology,
        config=options.config, attention=options.attention,
        aux_layers=options.aux_layers)  # logits [B, 1, V]
    token, greedy = pick_tokens(row_keys(key, state.item, state.count), logits[:, 0],
                                options.sampling)
    going = state.live & ~finishing
    fed = (state.last, state.live, *_states(hidden[:, 0], [a[:, 0] for a in aux]), greedy)
    return CaptureState(cache=cache, last=jnp.where(going, token, state.last),
                        next_pos=state.next_pos + state.live, count=state.count + going,
                        item=state.item, live=going), fed

  return jax.lax.scan(step, state, None, length=options.steps_per_call)


@dataclasses.dataclass(frozen=True)
class CapturedRow:
  """One finished item: its prompt then answer tokens, and their states."""

  item: int
  tokens: np.ndarray  # int32 [n]: prompt tokens then answer tokens (the EOS, if any, last)
  prompt_length: int
  hidden: np.ndarray  # float16 [n, D]: final-norm hidden state of each token
  aux: np.ndarray  # float16 [n, A, D]: residual stream after each aux layer (A may be 0)
  greedy: np.ndarray  # int32 [n]: the model's greedy guess of the token after each one;
                      # -1 before the prompt's last token (no logits computed there)

  @property
  def answer_length(self) -> int:
    return len(self.tokens) - self.prompt_length


@dataclasses.dataclass
class CaptureStats:
  """Work done, for tokens/s and padding waste: prompt tokens started and answer
  tokens fed (rows in flight included); the token slots the passes computed (useful
  or padding) in refills and decode steps."""

  prompt_tokens: int = 0
  answer_tokens: int = 0
  refill_slots: int = 0
  decode_slots: int = 0
  seconds: float = 0.0

  @property
  def padding_waste(self) -> float:
    """The fraction of computed token slots that held no token."""
    slots = self.refill_slots + self.decode_slots
    return 1 - (self.prompt_tokens + self.answer_tokens) / slots if slots else 0.0

  def summary(self) -> dict:
    seconds = max(self.seconds, 1e-9)
    return {"prompt_tokens": self.prompt_tokens, "answer_tokens": self.answer_tokens,
            "seconds": self.seconds, "answer_tokens_per_s": self.answer_tokens / seconds,
            "tokens_per_s": (self.prompt_tokens + self.answer_tokens) / seconds,
            "padding_waste": self.padding_waste}


class _HostRows:
  """The rows in flight on the host: tokens and states appended as passes return them."""

  def __init__(self, batch: int, slots: int, hidden: int, aux: int):
    self.tokens = np.zeros((batch, slots), np.int32)
    self.hidden = np.zeros((batch, slots, hidden), np.float16)
    self.aux = np.zeros((batch, slots, aux, hidden), np.float16)  # A = 0: no aux layers
    self.greedy = np.full((batch, slots), -1, np.int32)
    self.length = np.zeros(batch, np.int32)
    self.prompt_length = np.zeros(batch, np.int32)
    self.item = np.full(batch, -1, np.int64)

  def start(self, rows: np.ndarray, items, prompts: np.ndarray, lengths: np.ndarray,
            hidden: np.ndarray, aux: np.ndarray | None, greedy: np.ndarray) -> None:
    p = prompts.shape[1]
    self.tokens[rows, :p], self.hidden[rows, :p] = prompts, hidden
    if aux is not None:
      self.aux[rows, :p] = aux
    self.greedy[rows] = -1
    self.greedy[rows, lengths - 1] = greedy
    self.length[rows] = self.prompt_length[rows] = lengths
    self.item[rows] = items

  def append(self, token: np.ndarray, fed: np.ndarray, hidden: np.ndarray,
             aux: np.ndarray | None, greedy: np.ndarray) -> None:
    """One decode call's `[K, B, ...]` outputs: each fed token after its row's last.
    A fed token's greedy guess belongs to it; the token itself was sampled after the
    previous one, whose guess is already in place."""
    for k in range(len(fed)):
      rows = np.flatnonzero(fed[k])
      at = self.length[rows]
      self.tokens[rows, at], self.hidden[rows, at] = token[k, rows], hidden[k, rows]
      self.greedy[rows, at] = greedy[k, rows]
      if aux is not None:
        self.aux[rows, at] = aux[k, rows]
      self.length[rows] += 1

  def take(self, row: int) -> CapturedRow:
    n = self.length[row]
    return CapturedRow(item=int(self.item[row]), tokens=self.tokens[row, :n].copy(),
                       prompt_length=int(self.prompt_length[row]),
                       hidden=self.hidden[row, :n].copy(), aux=self.aux[row, :n].copy(),
                       greedy=self.greedy[row, :n].copy())


def capture(model: Model, items: Iterable[tuple[int, list[int]]], options: CaptureOptions, *,
            batch: int, refill_rows: int, max_prompt_tokens: int, seed: int,
            keep_going: Callable[[], bool] = lambda: True,
            stats: CaptureStats | None = None) -> Iterator[CapturedRow]:
  """Generates an answer to every `(item id, prompt ids)` of `items`, in order, `batch`
  rows at a time, refilling `refill_rows` rows at once (module docstring); yields each
  row as it finishes (not in item order). Once `keep_going()` is false no item is
  started and the rows in flight finish. `stats`, when given, is updated in place."""
  check_count("batch", batch, 1)
  if not 1 <= refill_rows <= batch:
    raise MdjaxError(f"refill_rows must be in [1, batch={batch}], got {refill_rows!r}")
  config, stats = options.config, stats if stats is not None else CaptureStats()
  slots = bucket(max_prompt_tokens, MIN_PROMPT_BUCKET) + options.max_new_tokens
  state = CaptureState.empty(config, batch, -(-slots // 16) * 16)
  host = _HostRows(batch, slots, config.hidden_size, len(options.aux_layers))
  key, pending, free = jax.random.key(seed), iter(items), list(range(batch))
  started = time.perf_counter()
  while True:
    while len(free) >= refill_rows and keep_going():
      starting = [next(pending, None) for _ in range(refill_rows)]
      starting = [s for s in starting if s is not None]
      if not starting:
        break
      state = _start(model, state, host, free[:len(starting)], starting, batch, refill_rows,
                     max_prompt_tokens, key, options, stats)
      del free[:len(starting)]
    if len(free) == batch:
      break
    state, outputs = decode(model.params, state, key, options=options)
    token, fed, hidden, aux, greedy = jax.device_get(outputs)
    host.append(token, fed, hidden, aux, greedy)
    stats.answer_tokens += int(fed.sum())
    stats.decode_slots += batch * options.steps_per_call
    live = np.asarray(state.live)
    for row in sorted(set(range(batch)) - set(free) - set(np.flatnonzero(live).tolist())):
      stats.seconds = time.perf_counter() - started
      free.append(row)
      yield host.take(row)
  stats.seconds = time.perf_counter() - started


def _start(model: Model, state: CaptureState, host: _HostRows, rows: list[int],
           starting: list[tuple[int, list[int]]], batch: int, refill_rows: int,
           max_prompt_tokens: int, key: jax.Array, options: CaptureOptions,
           stats: CaptureStats) -> CaptureState:
  """One `refill` of `rows` with the items `starting` (padded to `refill_rows` entries)."""
  lengths = np.ones(refill_rows, np.int32)
  lengths[:len(starting)] = [len(ids) for _, ids in starting]
  if lengths.max() > max_prompt_tokens:
    item, ids = next(s for s in starting if len(s[1]) == lengths.max())
    raise MdjaxError(f"item {item}'s prompt has {len(ids)} tokens, more than "
                     f"max_prompt_tokens={max_prompt_tokens}")
  width = bucket(int(lengths.max()), MIN_PROMPT_BUCKET)
  prompts = np.zeros((refill_rows, width), np.int32)  # [R, P]
  for i, (_, ids) in enumerate(starting):
    prompts[i, :len(ids)] = ids
  items = np.zeros(refill_rows, np.int32)
  items[:len(starting)] = [item for item, _ in starting]
  where = np.full(refill_rows, batch, np.int32)  # unused entries: row B, dropped
  where[:len(rows)] = rows
  state, (hidden, aux, greedy) = refill(
      model.params, state, jnp.asarray(where), jnp.asarray(prompts), jnp.asarray(lengths),
      jnp.asarray(items), key, options=options)
  n = len(starting)
  hidden, aux, greedy = jax.device_get((hidden[:n], None if aux is None else aux[:n],
                                        greedy[:n]))
  host.start(np.asarray(rows), items[:n], prompts[:n], lengths[:n], hidden, aux, greedy)
  stats.prompt_tokens += int(lengths[:n].sum())
  stats.refill_slots += refill_rows * width
  return state
