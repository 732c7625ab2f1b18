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

The controls (`mdjax.controls`) act as transformers' logits processors act in its beam
search: on each running beam's log-softmax, with that beam's own text (the prompt, then
its tokens: `BeamState.texts`), and the processed scores are what a candidate adds to
its beam's sum. With one beam transformers runs greedy search, whose processors read
the logits: so does this, then takes the log-softmax. A candidate whose text completes
a stop string ends as one ending in EOS does: among the k best, a finished hypothesis;
never a running beam. Where fewer than k candidates do not end, the best ended ones
run on too, at their score - 1e9 (transformers' penalty, in the same float32 sum).
Where every candidate ended, the row holds k finished hypotheses that no beam at
-1e9 can beat, so the early_stopping rule stops it, where transformers stops its whole
search (once every prompt of its batch is there: each prompt here as if alone).

`logprobs`: for each token of a hypothesis, what it added to the hypothesis's summed
score (transformers' `compute_transition_scores` of its beam search): the token's
processed score in the beam it continued, so that a hypothesis's values sum to its
score times length**length_penalty. Without a processor that is the token's
log-probability; a processor can make it otherwise (a positive logit_bias, above 0).
`top_logprobs`: the best such scores (as many as asked) of that beam at that step.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mdjax.cache import KVCache, gather_slots
from mdjax.controls import CONTROL_OPTIONS, Context, Controls, process
from mdjax.errors import MdjaxError, check_count, check_real
from mdjax.sampling import log_softmax
from mdjax.stop_strings import completed
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


def backtrack(parents: Int[Array, "B N m"], length: Int[Array, "B h"],
              last: Int[Array, "B h"]) -> Int[Array, "B h N"]:
  """Where the tokens of hypotheses of `length` tokens lie: for each step s, the column
  of that step's entries that holds token s (0 past the length). A step's columns are
  its k running beams, then its k best candidates (`BeamState.ended_*`); `parents[b, s,
  j]` is the running beam of step s - 1 that column j continued, and a hypothesis ends
  at column `last` of its last step. Back along the parent pointers, one step a trip::

      step          0   1   2
      column        1   0   k+1      <- last: the 2nd best candidate of step 2
      parents[.]    0   1   0        <- column 0 of step 1 continued running beam 1 of step 0
  """
  def back(column, at):  # column [B, h]: the running beam of step s each hypothesis holds
    s, step_parents = at  # [], [B, m]
    here = jnp.where(s == length - 1, last, column)
    inside = s < length
    up = jnp.take_along_axis(step_parents, here, axis=1)
    return jnp.where(inside, up, column), jnp.where(inside, here, 0)

  steps = jnp.arange(parents.shape[1])
  _, path = jax.lax.scan(back, jnp.zeros_like(length), (steps, jnp.swapaxes(parents, 0, 1)),
                         reverse=True)  # [N, B, h]
  return jnp.moveaxis(path, 0, 2)


def along(history: Array, path: Int[Array, "B h N"]) -> Array:
  """`history[b, s, path[b, i, s]]` for every hypothesis i (`backtrack`'s path):
  `[B, N, m, ...]` -> `[B, h, N, ...]`."""
  index = jnp.swapaxes(path, 1, 2)  # [B, N, h]
  index = index.reshape(index.shape + (1,) * (history.ndim - 3))
  return jnp.swapaxes(jnp.take_along_axis(history, index, axis=2), 1, 2)


def with_ended(running: Array, ended: Array) -> Array:
  """A step's k running beams' entries, then its k best candidates': `[B, N, 2k, ...]`."""
  return jnp.concatenate([running, ended], axis=2)


def write_column(history: Array, new: Array, step: Int[Array, ""]) -> Array:
  """`history` `[B, N, ...]` with column `step` set to `new` `[B, ...]`: a select, which
  XLA:GPU fuses into the step's kernel (`BeamState`)."""
  column = jnp.arange(history.shape[1]) == step
  return jnp.where(column.reshape((1, -1) + (1,) * (history.ndim - 2)), new[:, None], history)


def continued(texts: Int[Array, "B k N"], parent: Int[Array, "B c"], token: Int[Array, "B c"],
              step: Int[Array, ""]) -> Int[Array, "B c N"]:
  """The texts of beams `parent` with `token` appended as their token `step`."""
  chosen = jnp.take_along_axis(texts, parent[..., None], axis=1)  # [B, c, N]
  return jnp.where(jnp.arange(texts.shape[2]) == step, token[..., None], chosen)


def running_beams(score: Float[Array, "B C"], ended: Bool[Array, "B C"], count: int,
                  *values: Array, fill: bool) -> list[Array]:
  """The `count` best candidates that did not end, best first: their score and each of
  `values` `[B, C]` at them. With `fill` (when fewer than `count` may remain: stop
  strings), transformers' rule: every candidate ended at score - 1e9 competes too."""
  if not fill:
    return first_unmasked(ended, count, score, *values)
  best, pick = jax.lax.top_k(score + ended.astype(jnp.float32) * -1e9, count)
  return [best] + [jnp.take_along_axis(v, pick, axis=1) for v in values]


# the `Controls` fields of one value per output row (per prompt: beam's rows)
PER_ROW = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_new_tokens",
           "prompt", "stop_tail")


def per_beam(controls: Controls, k: int) -> Controls:
  """`controls` with each prompt's per-row values repeated for its k beams (row b*k + j)."""
  return dataclasses.replace(controls, **{name: jnp.repeat(getattr(controls, name), k, axis=0)
                                          for name in PER_ROW
                                          if getattr(controls, name) is not None})


def reads_text(controls: Controls | None) -> bool:
  """Whether the controls read each beam's tokens (not only how many it holds)."""
  return controls is not None and (controls.ngram > 0 or any(
      getattr(controls, name) is not None for name in (
          "repetition_penalty", "presence_penalty", "frequency_penalty", "bad_words", "stops")))


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
  gather every beam's tokens each step; so does `texts`, only for controls that read
  them), every candidate that ended a hypothesis stays where it ended (the k best are
  chosen once, at the end: `result`), and every pass adds one token to each beam
  (passes after prefill: `generated`).

    cache            KVCache            the prompt, then a [N, k] block of beam slots per row
    topology         Topology [B, k+1]  segment 0 the prompt, segment j + 1 beam j
    limits           Limits             max_new_tokens, EOS ids, the run's PRNG key, controls
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
                                        ended one (EOS, a stop string, the budget), else -inf
    ended_token      int32[B, N, k]     that candidate's token
    ended_parent     int32[B, N, k]     the running beam of step s - 1 it continued
    closed           bool[B]            the row is done (budget, or early_stopping's rule)

  and, for the controls that need them (else None; K = top_logprobs):

    texts            int32[B, k, N]     [b, j]: running beam j's tokens (-1 after them)
    gain             float32[B, N, k]   [b, s, j]: what running beam j's token s added to
                                        its score (its processed score: logprobs)
    ended_gain       float32[B, N, k]   that of step s's c-th best candidate
    top_ids          int32[B, N, k, K]  [b, s, p]: the K best tokens of running beam p of
                                        step s - 1 at step s, by processed score
    top_scores       float32[B, N, k, K]   and those scores
    ended_stop       int32[B, N, k]     the stop string step s's c-th best candidate
                                        completes (-1: none)
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
  texts: Int[Array, "B k N"] | None = None
  gain: Float[Array, "B N k"] | None = None
  ended_gain: Float[Array, "B N k"] | None = None
  top_ids: Int[Array, "B N k K"] | None = None
  top_scores: Float[Array, "B N k K"] | None = None
  ended_stop: Int[Array, "B N k"] | None = None

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
  controls: ClassVar = CONTROL_OPTIONS  # as transformers' beam search applies them

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
    controls = limits.controls
    top = -1 if controls is None else controls.logprobs
    gain = jnp.zeros((batch, capacity, k)) if top >= 0 else None
    state = BeamState(cache=cache, topology=Topology.fan(prompt.lengths, k), limits=limits,
                      start=prompt.lengths, generated=jnp.zeros((), jnp.int32),
                      scores=jnp.zeros((batch, capacity, k)), tokens=history, parents=history,
                      ended_score=jnp.full((batch, capacity, k), -jnp.inf),
                      ended_token=history, ended_parent=history,
                      closed=jnp.broadcast_to(limits.max_new_tokens <= 0, (batch,)),
                      texts=(jnp.full((batch, k, capacity), -1, jnp.int32)
                             if reads_text(controls) else None),
                      gain=gain, ended_gain=gain,
                      top_ids=jnp.zeros((batch, capacity, k, top), jnp.int32) if top > 0 else None,
                      top_scores=jnp.zeros((batch, capacity, k, top)) if top > 0 else None,
                      ended_stop=(None if controls is None or controls.stops is None
                                  else jnp.full((batch, capacity, k), -1, jnp.int32)))
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
    k, step, limits = self.num_beams, state.generated, state.limits
    processed = self._processed(state, logits)  # [B, k, V]
    scores = processed + state.running_score[..., None]  # [B, k, V]
    count = min((1 + limits.eos_ids.shape[0]) * k, scores.shape[1] * scores.shape[2])
    score, parent, token = top_continuations(scores, count)  # [B, C]
    ended = (token[..., None] == limits.eos_ids).any(-1)  # [B, C]
    stop = self._stop_strings(state, parent, token)  # [B, C] or None
    if stop is not None:
      ended |= stop >= 0
    last = step + 1 >= limits.max_new_tokens
    ends = (ended[:, :k] | last) & ~state.closed[:, None]  # [B, k]
    length = (step + 1).astype(jnp.float32)
    finished = jnp.where(ends, score[:, :k] / length ** self.length_penalty, -jnp.inf)
    values = [parent, token]
    if state.gain is not None:  # each candidate's own processed score
      vocab = processed.shape[-1]
      values.append(jnp.take_along_axis(processed.reshape(processed.shape[0], -1),
                                        parent * vocab + token, axis=1))
    running_score, *running = running_beams(score, ended, k, *values, fill=stop is not None)
    write = lambda history, new: write_column(history, new, step)
    fields = dict(cache=self._reorder(state, running[0]),
                  scores=write(state.scores, running_score), tokens=write(state.tokens, running[1]),
                  parents=write(state.parents, running[0]),
                  ended_score=write(state.ended_score, finished),
                  ended_token=write(state.ended_token, token[:, :k]),
                  ended_parent=write(state.ended_parent, parent[:, :k]))
    if state.texts is not None:
      fields["texts"] = continued(state.texts, running[0], running[1], step)
    if state.gain is not None:
      fields.update(gain=write(state.gain, running[2]),
                    ended_gain=write(state.ended_gain, values[2][:, :k]))
    if state.top_ids is not None:
      best, ids = jax.lax.top_k(processed, state.top_ids.shape[-1])  # [B, k, K]
      fields.update(top_ids=write(state.top_ids, ids.astype(jnp.int32)),
                    top_scores=write(state.top_scores, best))
    if stop is not None:
      fields["ended_stop"] = write(state.ended_stop, stop[:, :k])
    state = dataclasses.replace(state, **fields)
    hopeless = self._hopeless(state, running_score[:, 0], step + 1)
    return dataclasses.replace(state, closed=state.closed | last | hopeless)

  def _processed(self, state: BeamState, logits: Float[Array, "B k V"]) -> Float[Array, "B k V"]:
    """Each running beam's next-token scores: its log-softmax with the controls'
    processors applied after it, on the beam's own text (transformers' beam search), or
    before it with one beam (transformers' greedy search)."""
    controls = state.limits.controls
    if controls is None or not controls.processes:
      return log_softmax(logits)
    batch, k, vocab = logits.shape
    rows = batch * k
    texts = (jnp.full((rows, 1), -1, jnp.int32) if state.texts is None  # only lengths read
             else state.texts.reshape(rows, -1))
    context = Context.plain(texts, jnp.full((rows,), state.generated, jnp.int32))
    run = lambda x: process(x.reshape(rows, 1, vocab), per_beam(controls, k), context,
                            state.limits.eos_ids).reshape(batch, k, vocab)
    return log_softmax(run(logits)) if k == 1 else run(log_softmax(logits))

  def _stop_strings(self, state: BeamState, parent: Int[Array, "B C"], token: Int[Array, "B C"]
                    ) -> Int[Array, "B C"] | None:
    """The stop string each candidate's text (its beam's, then its token) completes
    (-1: none), as transformers' criterion judges every candidate; None without any."""
    controls = state.limits.controls
    if controls is None or controls.stops is None:
      return None
    batch, count = token.shape
    texts = continued(state.texts, parent, token, state.generated).reshape(batch * count, -1)
    return completed(controls.stops, texts, jnp.full((batch * count, 1), state.generated),
                     jnp.repeat(controls.stop_tail, count, axis=0)).reshape(batch, count)

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
    k = self.num_beams
    score, where = state.finished(k)  # [B, k]
    filled = jnp.isfinite(score)
    length = jnp.where(filled, where // k + 1, 0)
    parents = with_ended(state.parents, state.ended_parent)
    path = backtrack(parents, length, k + where % k)  # [B, k, N]
    inside = jnp.arange(state.tokens.shape[1]) < length[..., None]  # [B, k, N]
    tokens = jnp.where(inside, along(with_ended(state.tokens, state.ended_token), path), -1)
    fields = {}
    if state.gain is not None:
      gain = along(with_ended(state.gain, state.ended_gain), path)
      fields["logprobs"] = rank_major(jnp.where(inside, gain, 0.0))
    if state.top_ids is not None:
      source = along(parents, path)  # the running beam each token continued
      fields.update(top_ids=rank_major(along(state.top_ids, source)),
                    top_logprobs=rank_major(along(state.top_scores, source)))
    if state.ended_stop is not None:
      stopped = jnp.take_along_axis(flat(state.ended_stop), where, axis=1)
      fields["stopped_by"] = rank_major(jnp.where(filled, stopped, -1))
    count = rank_major(length)
    buffer = OutputBuffer(tokens=rank_major(tokens), count=count,
                          done=jnp.ones(count.shape, jnp.bool_), scores=rank_major(score),
                          **fields)
    return buffer, {"target_passes": state.generated}
