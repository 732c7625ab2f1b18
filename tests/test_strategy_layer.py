"""The strategy layer itself: a new strategy is one class plus one registry line.

`RunnerUp` below exists only in this test: it decodes the second most likely token
every pass, declared and registered exactly as a newcomer would, and must then work
through `mdjax.generate`, `mdjax.stream` and option validation like a shipped one.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float, Int

import mdjax
from mdjax import strategies
from mdjax.controls import CONTROL_OPTIONS
from mdjax.errors import MdjaxError, check_count
from mdjax.strategies import prompt_layouts
from mdjax.strategies.base import DecodeState, OutputBuffer, Strategy, emit, prefill
from mdjax.topology import Topology


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerUpState(DecodeState):
  """`DecodeState`, its `topology` [B, 1] and `next_pos` int32[B]: the position of
  the token fed next."""

  topology: Topology
  next_pos: Int[Array, "B"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerUp(Strategy):
  """The `rank`-th most likely token (0 = greedy) every pass."""

  name: ClassVar[str] = "runner_up"
  layout: ClassVar = prompt_layouts.Plain()
  rank: int = 1

  def __post_init__(self):
    check_count("rank", self.rank, 0)

  def init(self, params, prompt, cache, limits, capacity) -> RunnerUpState:
    logits, cache, topology = prefill(self.model, params, prompt, cache)  # [B, 1, V]
    buffer = OutputBuffer.empty(prompt.lengths.shape[0], capacity)
    state = RunnerUpState(cache=cache, topology=topology, limits=limits, buffer=buffer,
                          passes=jnp.zeros((), jnp.int32), next_pos=prompt.lengths)
    return self._commit(state, logits[:, 0])

  def step(self, params, state: RunnerUpState) -> RunnerUpState:
    last = jnp.take_along_axis(state.buffer.tokens, state.buffer.count[:, None] - 1, axis=1)
    segments = jnp.where(state.buffer.done, -1, 0)[:, None]  # [B, 1]
    logits, _, cache = self.model(params, state.cache, last, state.next_pos[:, None], segments,
                                  state.topology)  # [B, 1, V]
    state = dataclasses.replace(state, cache=cache, next_pos=state.next_pos + 1,
                                passes=state.passes + 1)
    return self._commit(state, logits[:, 0])

  def _commit(self, state: RunnerUpState, logits: Float[Array, "B V"]) -> RunnerUpState:
    token = jnp.argsort(-logits, axis=-1)[:, self.rank].astype(jnp.int32)  # [B]
    buffer, _ = emit(state.buffer, token[:, None], jnp.ones_like(token), state.limits)
    return dataclasses.replace(state, buffer=buffer)


@pytest.fixture(scope="module")
def model():
  strategies.register(RunnerUp)  # the one line that adds a strategy
  yield mdjax.load("random-llama-tiny")
  del strategies.STRATEGIES["runner_up"]


def reference(model, prompt: list[int], rank: int, steps: int) -> list[int]:
  """The rank-th token of the full forward, one token at a time."""
  ids = list(prompt)
  for _ in range(steps):
    ids.append(int(np.argsort(-mdjax.forward_logits(model, ids)[-1], kind="stable")[rank]))
  return ids[len(prompt):]


def test_a_registered_strategy_runs_through_generate_and_stream(model):
  prompts = [[5, 6, 7, 8, 9], [11, 12]]  # ragged rows
  out = mdjax.generate(model, prompts, strategy="runner_up", max_new_tokens=6, eos_token_id=[])
  assert out.sequences == [reference(model, p, 1, 6) for p in prompts]
  assert out.stats["target_passes"] == 5
  greedy = mdjax.generate(model, prompts, strategy="runner_up", rank=0, max_new_tokens=6,
                          eos_token_id=[])
  assert greedy.sequences == mdjax.generate(model, prompts, max_new_tokens=6,
                                            eos_token_id=[]).sequences
  streamed = [[], []]
  for pieces in mdjax.stream(model, prompts, strategy="runner_up", max_new_tokens=6,
                             eos_token_id=[]):
    for row, piece in zip(streamed, pieces):
      row.extend(piece)
  assert streamed == out.sequences


def test_its_options_are_its_fields(model):
  assert strategies.option_names("runner_up") == ("rank", "attention")
  with pytest.raises(MdjaxError, match=r"unknown option 'top_k' for strategy 'runner_up'; "
                                       r"valid options: rank, attention"):
    mdjax.generate(model, [1, 2], strategy="runner_up", top_k=3)
  with pytest.raises(MdjaxError, match=r"rank must be an integer >= 0, got -1"):
    mdjax.generate(model, [1, 2], strategy="runner_up", rank=-1)


def test_only_declared_strategy_dataclasses_register():
  class Undecorated(RunnerUp):  # its own options would not be fields
    name: ClassVar[str] = "undecorated"

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Nameless(Strategy):
    layout: ClassVar = prompt_layouts.Plain()

  with pytest.raises(MdjaxError, match="Undecorated is not a frozen dataclass"):
    strategies.register(Undecorated)
  with pytest.raises(MdjaxError, match="Nameless does not declare its name"):
    strategies.register(Nameless)
  with pytest.raises(MdjaxError, match="is not a frozen dataclass"):
    strategies.register(dict)
  assert "undecorated" not in strategies.STRATEGIES


# The options the public API contract names (docs/design.md §10).
CONTRACT_OPTIONS = {
    "sample": {"temperature", "top_k", "top_p", "min_p"},
    "beam": {"num_beams", "length_penalty", "early_stopping"},
    "multi_question": {"questions", "temperature", "top_k", "top_p", "min_p"},
    "parallel_sample": {"num_samples", "temperature", "top_k", "top_p", "min_p"},
    "speculative": {"draft", "num_draft_tokens", "temperature", "top_k", "top_p", "min_p",
                    "confidence_threshold", "draft_schedule"},
    "prompt_lookup": {"prompt_lookup_num_tokens", "max_ngram_size"},
    "lookahead": {"window", "ngram", "guess_set"},
    "self_speculative": {"draft_layers"},
}


def test_the_contract_options_are_declared_by_their_strategies():
  """Options come from each class's fields alone, so a renamed or dropped field
  silently changes the public API: the contract's names must all still be there."""
  for name, options in CONTRACT_OPTIONS.items():
    assert options <= set(strategies.option_names(name)), name
  assert set(strategies.option_names("greedy")) == {"attention", *CONTROL_OPTIONS}


def test_sample_samples_and_greedy_is_greedy(model):
  """`strategy="sample"` with no options samples at temperature 1."""
  prompt = [3, 4, 5]
  greedy = mdjax.generate(model, prompt, max_new_tokens=12, eos_token_id=[]).sequences
  sampled = {tuple(mdjax.generate(model, prompt, strategy="sample", max_new_tokens=12,
                                  eos_token_id=[], seed=seed).sequences[0]) for seed in range(4)}
  assert len(sampled) > 1 and tuple(greedy[0]) not in sampled
  sample = strategies.get("sample")(model=None)
  assert sample.temperature == 1.0 and not sample.greedy
  with pytest.raises(MdjaxError, match=r"unknown option 'temperature' for strategy 'greedy'"):
    mdjax.generate(model, prompt, strategy="greedy", temperature=0.5)
