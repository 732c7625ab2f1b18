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
the token's log-softmax. Of the k best candidates, those ending in EOS (or reaching
`max_new_tokens`) are finished hypotheses, scored `sum_logprob / length**length_penalty`
(length counts generated tokens, EOS included), and replace the worst kept ones; the
k best candidates not ending in EOS are the next running beams. A row stops:

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
from mdjax.strategies import prompt_layouts
from mdjax.strategies.base import Limits, OutputBuffer, Prompt, Strategy, prefill
from mdjax.strategies.registry import register
from mdjax.topology import Topology


def extend(tokens: Int[Array, "B k N"], parent: Int[Array, "B C"], token: Int[Array, "B C"],
           step: Int[Array, ""]) -> Int[Array, "B C N"]:
  """Candidate c's tokens: those of beam `parent[c]`, then `token[c]` at index `step`."""
  inherited = jnp.take_along_axis(tokens, parent[..., None], axis=1)  # [B, C, N]
  return inherited.at[:, :, step].set(token)


def top_continuations(scores: Float[Array, "B k V"], count: int
                      ) -> tuple[Float[Array, "B C"], Int[Array, "B C"], Int[Array, "B C"]]:
  """The `count` best (beam, token) pairs of each row: score, beam and token, best first."""
  vocab = scores.shape[-1]
  best, index = jax.lax.top_k(scores.reshape(scores.shape[0], -1), count)  # [B, C]
  return best, (index // vocab).astype(jnp.int32), (index % vocab).astype(jnp.int32)


def rank_major(x: Array) -> Array:
  """`[B, k, ...]` -> `[k*B, ...]`: row r*B + i is prompt i's r-th hypothesis."""
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamState:
  """Beam search's loop state (t5x's `BeamState`); k = num_beams, N = capacity. It has
  no `OutputBuffer`: the output is the finished hypotheses, read once at the end. A
  step updates few arrays (on a GPU each is a kernel or more): a running beam's last
  token is read from its tokens, and every pass adds one token to each beam (passes
  after prefill: `generated`).

    cache            KVCache            the prompt, then a [N, k] block of beam slots per row
    topology         Topology [B, k+1]  segment 0 the prompt, segment j + 1 beam j
    limits           Limits             max_new_tokens, EOS ids, the run's PRNG key
    start            int32[B]           prompt length: the beams' first slot and position
    generated        int32[]            tokens each running beam holds in the cache (it
                                        holds one more: the last, not yet fed)
    running_score    float32[B, k]      each running beam's summed log-probability
    running_tokens   int32[B, k, N]     each running beam's tokens (-1 past them)
    finished_score   float32[B, k]      finished hypotheses' scores, best first (-inf: none yet)
    finished_tokens  int32[B, k, N]     their tokens (-1 past their length)
    finished_length  int32[B, k]        their lengths (EOS included)
    closed           bool[B]            the row is done (budget, or early_stopping's rule)
  """

  cache: KVCache
  topology: Topology
  limits: Limits
  start: Int[Array, "B"]
  generated: Int[Array, ""]
  running_score: Float[Array, "B k"]
  running_tokens: Int[Array, "B k N"]
  finished_score: Float[Array, "B k"]
  finished_tokens: Int[Array, "B k N"]
  finished_length: Int[Array, "B k"]
  closed: Bool[Array, "B"]

  @property
  def last(self) -> Int[Array, "B k"]:
    """Each running beam's last token: what it feeds next."""
    return jax.lax.dynamic_index_in_dim(self.running_tokens, self.generated, axis=2,
                                        keepdims=False)


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
    no_tokens = jnp.full((batch, k, capacity), -1, jnp.int32)
    only_first = jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf)  # one beam until the first choice
    state = BeamState(cache=cache, topology=Topology.fan(prompt.lengths, k), limits=limits,
                      start=prompt.lengths, generated=jnp.zeros((), jnp.int32),
                      running_score=jnp.broadcast_to(only_first, (batch, k)),
                      running_tokens=no_tokens, finished_score=jnp.full((batch, k), -jnp.inf),
                      finished_tokens=no_tokens, finished_length=jnp.zeros((batch, k), jnp.int32),
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
    """One beam-search choice from each running beam's next-token logits.

    The running beams hold `state.generated` tokens (all in the cache); the
    candidates add one more. A closed row's running beams are no longer read.
    """
    step = state.generated
    scores = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1) + \
        state.running_score[..., None]  # [B, k, V]
    is_eos = (jnp.arange(scores.shape[-1])[:, None] == state.limits.eos_ids).any(-1)  # [V]
    last = step + 1 >= state.limits.max_new_tokens
    state = self._finish(state, scores, is_eos, last)
    running_score, parent, token = top_continuations(jnp.where(is_eos, -jnp.inf, scores),
                                                     self.num_beams)  # [B, k]
    cache = self._reorder(state, parent)
    closed = state.closed | last | self._hopeless(state, running_score[:, 0], step + 1)
    return dataclasses.replace(state, cache=cache, running_score=running_score, closed=closed,
                               running_tokens=extend(state.running_tokens, parent, token, step))

  def _finish(self, state: BeamState, scores: Float[Array, "B k V"], is_eos: Bool[Array, "V"],
              last: Bool[Array, ""]) -> BeamState:
    """Of each open row's k best candidates, those ending in EOS (or at the budget) join
    its finished hypotheses, of which the k best stay (sorted, best first)."""
    k, step = self.num_beams, state.generated
    score, parent, token = top_continuations(scores, k)  # [B, k]
    ends = (is_eos[token] | last) & ~state.closed[:, None]
    length = step + 1
    score = jnp.where(ends, score / length.astype(jnp.float32) ** self.length_penalty, -jnp.inf)
    merged_score = jnp.concatenate([state.finished_score, score], axis=1)  # [B, 2k]
    best, pick = jax.lax.top_k(merged_score, k)  # [B, k]
    merged_tokens = jnp.concatenate(
        [state.finished_tokens, extend(state.running_tokens, parent, token, step)], axis=1)
    merged_length = jnp.concatenate(
        [state.finished_length, jnp.broadcast_to(length, score.shape)], axis=1)  # [B, 2k]
    return dataclasses.replace(
        state, finished_score=best,
        finished_tokens=jnp.take_along_axis(merged_tokens, pick[..., None], axis=1),
        finished_length=jnp.take_along_axis(merged_length, pick, axis=1))

  def _hopeless(self, state: BeamState, best_running: Float[Array, "B"], length: Int[Array, ""]
                ) -> Bool[Array, "B"]:
    """Rows whose k finished hypotheses no running beam can beat (the early_stopping rule).

    `length`: tokens the running beams hold now.
    """
    full = jnp.isfinite(state.finished_score).all(axis=1)  # [B]
    if self.stops_when_full:
      return full
    if self.early_stopping == "never" and self.length_penalty > 0:
      length = state.limits.max_new_tokens
    best_possible = best_running / length.astype(jnp.float32) ** self.length_penalty
    return full & (best_possible <= state.finished_score.min(axis=1))

  def _reorder(self, state: BeamState, parent: Int[Array, "B k"]) -> KVCache:
    """New beam j takes the cached tokens of old beam `parent[j]`: for every written step s,
    slot start + s*k + j gets the contents of slot start + s*k + parent[j]."""
    k, start = self.num_beams, state.start
    width = state.running_tokens.shape[2] * k  # the branch block: capacity steps of k beams
    step, beam = jnp.arange(width) // k, jnp.arange(width) % k  # [W] of every block slot
    source_beam = jnp.where(step < state.generated, parent[:, beam], beam)  # [B, W]
    return gather_slots(state.cache, start, start[:, None] + step * k + source_beam, width)

  def done(self, state: BeamState) -> Bool[Array, "B"]:
    return state.closed

  def result(self, state: BeamState) -> tuple[OutputBuffer, dict]:
    """Finished hypotheses rank-major: output row r*B + i is prompt i's r-th best (rows 0..B-1
    the best ones); a hypothesis never filled (max_new_tokens 0) has score -inf."""
    count = rank_major(state.finished_length)
    buffer = OutputBuffer(tokens=rank_major(state.finished_tokens), count=count,
                          done=jnp.ones(count.shape, jnp.bool_),
                          scores=rank_major(state.finished_score))
    return buffer, {"target_passes": state.generated}
