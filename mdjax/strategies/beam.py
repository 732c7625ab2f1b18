"""`beam`: beam search with transformers' semantics, the beams as segments over one prompt.

The prompt is segment 0, prefilled once. Beam j (0 <= j < k) decodes in segment
j + 1, forked from segment 0 at the row's prompt length c, so every beam sees the
prompt and its own tokens only. Each pass feeds one token per beam; `claim_slots`
appends them after the prompt, so step s of beam j always lives in slot
c + s*k + j: the branch region is a fixed `[steps, k]` block per row. One row,
prompt `a b c`, k = 2, after three steps::

    slot   0 1 2 | 3 4 | 5 6 | 7 8 | . .
    seg    0 0 0 | 1 2 | 1 2 | 1 2 |-1 -1     parent = [-1, 0, 0]
    pos    0 1 2 | 3 3 | 4 4 | 5 5 |          fork   = [ 0, 3, 3]
    step   prompt| s=0 | s=1 | s=2 |

If both new beams continue old beam 1 (parents [1, 1]), one `gather_slots` over the
block gives slots 3, 5, 7 the contents (K/V, positions) of slots 4, 6, 8; the segment
labels stay. Only branch slots move: the prompt's K/V is never copied.

Each step, exactly as transformers' `generate(num_beams=k, do_sample=False)`: the
candidates are (beam, token) pairs scored by the beam's summed log-probability plus
the token's log-softmax; one top-k finds the (1 + E) * k best (E EOS ids: at most E * k
of them end in EOS). Of the k best, those ending in EOS (or reaching `max_new_tokens`)
are finished hypotheses, scored `sum_logprob / length**length_penalty` (length counts
generated tokens, EOS included), and replace the worst kept ones; the k best not
ending in EOS are the next running beams, each a parent pointer and a token. A row
stops:

    early_stopping=True      as soon as it holds k finished hypotheses
    early_stopping=False     when, with k finished, the best running beam's score over
                             its current length**length_penalty cannot beat the worst
    early_stopping="never"   the same, but over max_new_tokens**length_penalty when
                             length_penalty > 0 (the best length it could reach)

or at `max_new_tokens`. `num_beams=1` is greedy search (transformers' choice), which is
`early_stopping=True` here. The output rows are the finished hypotheses, best first.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mdjax.cache import KVCache, gather_slots
from mdjax.errors import MdjaxError, check_count, check_real
from mdjax.sampling import log_softmax
from mdjax.strategies import prompt_layouts
from mdjax.strategies.base import Limits, OutputBuffer, Prompt, Strategy, prefill
from mdjax.strategies.registry import register
from mdjax.topology import Topology


def top_continuations(scores: Float[Array, "B k V"], count: int
                      ) -> tuple[Float[Array, "B C"], Int[Array, "B C"], Int[Array, "B C"]]:
  """The `count` best (beam, token) pairs of each row: score, beam and token, best first
  (ties: the lower beam, then the lower token: `jax.lax.top_k`'s order)."""
  vocab = scores.shape[-1]
  best, index = jax.lax.top_k(scores.reshape(scores.shape[0], -1), count)  # [B, C]
  return best, (index // vocab).astype(jnp.int32), (index % vocab).astype(jnp.int32)


def first_unmasked(masked: Bool[Array, "B C"], count: int, *values: Array) -> list[Array]:
  """Each of `values` `[B, C]` at the first `count` columns of a row where `masked` is
  False, in column order (every row has that many): `[B, count]` each. By C selects over
  `[B, count]`, not a reduction over C: XLA:GPU fuses selects into what reads them (the
  step's writes), where a reduction's output is a kernel's own (2 more a step)."""
  out = [jnp.zeros((masked.shape[0], count), v.dtype) for v in values]
  before = jnp.zeros((masked.shape[0], 1), jnp.int32)  # [B, 1]: unmasked columns before c
  for c in range(masked.shape[1]):
    here = ~masked[:, c:c + 1] & (before == jnp.arange(count))  # [B, count]
    out = [jnp.where(here, v[:, c:c + 1], o) for v, o in zip(values, out)]
    before += ~masked[:, c:c + 1]
  return out


def backtrack(tokens: Int[Array, "B N k"], parents: Int[Array, "B N k"],
              length: Int[Array, "B h"], token: Int[Array, "B h"],
              parent: Int[Array, "B h"]) -> Int[Array, "B h N"]:
  """The tokens of hypotheses of `length` tokens whose last is `token`, after running beam
  `parent` of the step before (-1 past their length): back along the running beams'
  parent pointers (`tokens[b, s, j]`: running beam j's token s; `parents[b, s, j]`: the
  running beam of step s - 1 it continued), one step a trip."""
  def back(beam, at):  # beam [B, h]: the running beam of step s each hypothesis holds
    s, step_tokens, step_parents = at  # [], [B, k], [B, k]
    end = s == length - 1  # [B, h]
    here = jnp.where(end, token, jnp.take_along_axis(step_tokens, beam, axis=1))
    up = jnp.where(end, parent, jnp.take_along_axis(step_parents, beam, axis=1))
    inside = s < length
    return jnp.where(inside, up, beam), jnp.where(inside, here, -1)

  steps = jnp.arange(tokens.shape[1])
  _, history = jax.lax.scan(back, jnp.zeros_like(length),
                            (steps, jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(parents, 0, 1)),
                            reverse=True)  # [N, B, h]
  return jnp.moveaxis(history, 0, 2)


def flat(history: Array) -> Array:
  """`[B, N, k]` -> `[B, N*k]`: column s*k + c is step s's entry c."""
  return history.reshape(history.shape[0], -1)


def rank_major(x: Array) -> Array:
  """`[B, k, ...]` -> `[k*B, ...]`: row r*B + i is prompt i's r-th hypothesis."""
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamState:
  """Beam search's loop state (t5x's `BeamState`); k = num_beams, N = capacity. It has
  no `OutputBuffer`: the output is the finished hypotheses, read once at the end. Step s
  writes column s of its histories (one kernel on a GPU, where each array a step
  updates is a kernel or more, and one whose entries move a copy more), `closed` and
  `generated`, nothing else: running beams are parent pointers (transformers and t5x
  gather every beam's tokens each step), every candidate that ended a hypothesis stays
  where it ended (the k best are chosen once, at the end: `result`), and every pass
  adds one token to each beam (passes after prefill: `generated`).

    cache            KVCache            the prompt, then a [N, k] block of beam slots per row
    topology         Topology [B, k+1]  segment 0 the prompt, segment j + 1 beam j
    limits           Limits             max_new_tokens, EOS ids, the run's PRNG key
    start            int32[B]           prompt length: the beams' first slot and position
    generated        int32[]            tokens each running beam holds in the cache (it
                                        holds one more: the last, not yet fed)
    scores           float32[B, N, k]   [b, s, j]: running beam j's summed log-probability
                                        after step s
    tokens           int32[B, N, k]     [b, s, j]: running beam j's token s, chosen at step s
    parents          int32[B, N, k]     [b, s, j]: the running beam of step s - 1 that beam
                                        j continued at step s (its tokens 0..s-1)
    ended_score      float32[B, N, k]   [b, s, c]: the score of step s's c-th best candidate
                                        as a finished hypothesis of s + 1 tokens, if it
                                        ended one (EOS, or the budget), else -inf
    ended_token      int32[B, N, k]     that candidate's token
    ended_parent     int32[B, N, k]     the running beam of step s - 1 it continued
    closed           bool[B]            the row is done (budget, or early_stopping's rule)
  """

  cache: KVCache
  topology: Topology
  limits: Limits
  start: Int[Array, "B"]
  generated: Int[Array, ""]
  scores: Float[Array, "B N k"]
  tokens: Int[Array, "B N k"]
  parents: Int[Array, "B N k"]
  ended_score: Float[Array, "B N k"]
  ended_token: Int[Array, "B N k"]
  ended_parent: Int[Array, "B N k"]
  closed: Bool[Array, "B"]

  @property
  def running_score(self) -> Float[Array, "B k"]:
    """Each running beam's summed log-probability (before the first choice, one beam)."""
    before = jax.lax.dynamic_index_in_dim(self.scores, self.generated - 1, axis=1,
                                          keepdims=False)
    only_first = jnp.where(jnp.arange(before.shape[1]) == 0, 0.0, -jnp.inf)  # [k]
    return jnp.where(self.generated == 0, only_first, before)

  @property
  def last(self) -> Int[Array, "B k"]:
    """Each running beam's last token: what it feeds next."""
    return jax.lax.dynamic_index_in_dim(self.tokens, self.generated, axis=1, keepdims=False)

  def finished(self, count: int) -> tuple[Float[Array, "B h"], Int[Array, "B h"]]:
    """The `count` best finished hypotheses: score (-inf: none) and where they ended,
    `s * k + c` (step s's c-th candidate), best first (ties: the earlier step, then the
    better candidate, as transformers' step-by-step merge keeps them)."""
    return jax.lax.top_k(flat(self.ended_score), count)  # [B, h]


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Beam(Strategy):
  """Beam search; the options mean what they mean in transformers' `generate`."""

  name: ClassVar[str] = "beam"
  layout: ClassVar = prompt_layouts.Plain()
  streams: ClassVar[bool] = False  # the best hypothesis is known only at the end

  num_beams: int = 4
  length_penalty: float = 1.0
  early_stopping: bool | str = False

  def __post_init__(self):
    check_count("num_beams", self.num_beams, 1)
    check_real("length_penalty", self.length_penalty)
    es = self.early_stopping
    if not (isinstance(es, bool) or (isinstance(es, str) and es == "never")):
      raise MdjaxError(f"early_stopping must be True, False or 'never', got {es!r}")

  @property
  def stops_when_full(self) -> bool:
    """Rows stop at k finished hypotheses (one beam: greedy search, stops at EOS)."""
    return self.early_stopping is True or self.num_beams == 1

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, then one slot per generated token of every beam (one branch per row)."""
    return prompt_len + capacity * self.num_beams

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> BeamState:
    logits, cache, _ = prefill(self.model, params, prompt, cache)  # [B, 1, V]
    batch, k = prompt.lengths.shape[0], self.num_beams
    history = jnp.zeros((batch, capacity, k), jnp.int32)
    state = BeamState(cache=cache, topology=Topology.fan(prompt.lengths, k), limits=limits,
                      start=prompt.lengths, generated=jnp.zeros((), jnp.int32),
                      scores=jnp.zeros((batch, capacity, k)), tokens=history, parents=history,
                      ended_score=jnp.full((batch, capacity, k), -jnp.inf),
                      ended_token=history, ended_parent=history,
                      closed=jnp.broadcast_to(limits.max_new_tokens <= 0, (batch,)))
    return self._select(state, jnp.broadcast_to(logits, (batch, k, logits.shape[-1])))

  def step(self, params, state: BeamState) -> BeamState:
    """Feeds every open row's k running tokens (a closed row feeds padding), then selects."""
    segments = jnp.where(state.closed[:, None], -1, jnp.arange(1, self.num_beams + 1))  # [B, k]
    positions = jnp.broadcast_to(state.start[:, None] + state.generated, segments.shape)
    logits, _, cache = self.model(params, state.cache, state.last, positions, segments,
                                  state.topology)  # [B, k, V]
    state = dataclasses.replace(state, cache=cache, generated=state.generated + 1)
    return self._select(state, logits)

  def _select(self, state: BeamState, logits: Float[Array, "B k V"]) -> BeamState:
    """One beam-search choice from each running beam's next-token logits, written in
    column `state.generated` of the histories.

    The running beams hold `state.generated` tokens (all in the cache); the
    candidates add one more. A closed row ends no hypothesis; its running beams are no
    longer read.
    """
    k, step = self.num_beams, state.generated
    scores = log_softmax(logits) + state.running_score[..., None]  # [B, k, V]
    count = min((1 + state.limits.eos_ids.shape[0]) * k, scores.shape[1] * scores.shape[2])
    score, parent, token = top_continuations(scores, count)  # [B, C]
    is_eos = (token[..., None] == state.limits.eos_ids).any(-1)  # [B, C]
    last = step + 1 >= state.limits.max_new_tokens
    ends = (is_eos[:, :k] | last) & ~state.closed[:, None]  # [B, k]
    length = (step + 1).astype(jnp.float32)
    ended = jnp.where(ends, score[:, :k] / length ** self.length_penalty, -jnp.inf)
    running_score, running_parent, running_token = first_unmasked(is_eos, k, score, parent,
                                                                  token)  # [B, k]
    column = jnp.arange(state.tokens.shape[1])[None, :, None] == step  # [1, N, 1]
    write = lambda history, new: jnp.where(column, new[:, None, :], history)  # [B, N, k]
    state = dataclasses.replace(
        state, cache=self._reorder(state, running_parent),
        scores=write(state.scores, running_score), tokens=write(state.tokens, running_token),
        parents=write(state.parents, running_parent), ended_score=write(state.ended_score, ended),
        ended_token=write(state.ended_token, token[:, :k]),
        ended_parent=write(state.ended_parent, parent[:, :k]))
    hopeless = self._hopeless(state, running_score[:, 0], step + 1)
    return dataclasses.replace(state, closed=state.closed | last | hopeless)

  def _hopeless(self, state: BeamState, best_running: Float[Array, "B"], length: Int[Array, ""]
                ) -> Bool[Array, "B"]:
    """Rows whose k finished hypotheses no running beam can beat (the early_stopping rule).

    `length`: tokens the running beams hold now.
    """
    worst = state.finished(self.num_beams)[0][:, -1]  # [B]: the k-th best finished score
    full = jnp.isfinite(worst)
    if self.stops_when_full:
      return full
    if self.early_stopping == "never" and self.length_penalty > 0:
      length = state.limits.max_new_tokens
    best_possible = best_running / length.astype(jnp.float32) ** self.length_penalty
    return full & (best_possible <= worst)

  def _reorder(self, state: BeamState, parent: Int[Array, "B k"]) -> KVCache:
    """New beam j takes the cached tokens of old beam `parent[j]`: for every written step s,
    slot start + s*k + j gets the contents of slot start + s*k + parent[j]."""
    k, start = self.num_beams, state.start
    width = state.tokens.shape[1] * k  # the branch block: capacity steps of k beams
    step, beam = jnp.arange(width) // k, jnp.arange(width) % k  # [W] of every block slot
    source_beam = jnp.where(step < state.generated, parent[:, beam], beam)  # [B, W]
    return gather_slots(state.cache, start, start[:, None] + step * k + source_beam, width)

  def done(self, state: BeamState) -> Bool[Array, "B"]:
    return state.closed

  def result(self, state: BeamState) -> tuple[OutputBuffer, dict]:
    """Finished hypotheses rank-major: output row r*B + i is prompt i's r-th best (rows 0..B-1
    the best ones); a hypothesis never filled (max_new_tokens 0) has score -inf."""
    score, where = state.finished(self.num_beams)  # [B, k]
    length = jnp.where(jnp.isfinite(score), where // self.num_beams + 1, 0)
    at = lambda ended: jnp.take_along_axis(flat(ended), where, axis=1)  # [B, k]
    tokens = backtrack(state.tokens, state.parents, length, at(state.ended_token),
                       at(state.ended_parent))  # [B, k, N]
    count = rank_major(length)
    buffer = OutputBuffer(tokens=rank_major(tokens), count=count,
                          done=jnp.ones(count.shape, jnp.bool_), scores=rank_major(score))
    return buffer, {"target_passes": state.generated}
