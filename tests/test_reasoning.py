"""reasoning: voting, the exact join == greedy on the re-prefilled joined text, and the
experimental kv join == the exact one where their layouts coincide (one branch, no gap)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax.pipelines import reasoning
from mdjax.topology import Topology, visibility_limits, visible

PROMPT = 'def add(a, b):\n    """Return the sum of a and b."""\n'


@pytest.fixture(scope="module")
def model():
  return mdjax.load("code-tiny", dtype="float32")


def test_vote_takes_the_most_frequent_answer():
  pattern = re.compile(r"answer: (\d+)")
  answers, majority = reasoning.vote(["answer: 3", "no idea", "answer: 4", "answer: 4"], pattern)
  assert answers == ["3", None, "4", "4"] and majority == "4"
  assert reasoning.vote(["x", "y"], pattern) == ([None, None], None)


def test_join_sees_every_branch_it_joins():
  """The drawing of `mdjax.topology`'s docstring: the join (seg 3) sees everything."""
  joins = np.zeros((1, 4, 4), bool)
  joins[0, 3, 1:3] = True
  topology = Topology(parent=jnp.asarray([[-1, 0, 0, 0]]), fork=jnp.asarray([[0, 2, 2, 2]]),
                      joins=jnp.asarray(joins))
  seg = jnp.asarray([[0, 0, 1, 1, 2, 2, 2, 3]])
  pos = jnp.asarray([[0, 1, 2, 3, 2, 3, 4, 8]])
  seen = np.asarray(visible(visibility_limits(topology), seg, pos, seg, pos)[0])
  assert seen[7].all()
  assert seen[3].tolist() == [True, True, True, True, False, False, False, False]  # a branch


def test_exact_join_is_greedy_on_the_joined_text(model):
  out = mdjax.pipelines.run("reasoning", model, PROMPT, num_branches=3, branch_tokens=16,
                            max_new_tokens=10, seed=2)
  (step,) = out.intermediate
  assert len(step["branches"]) == 3 and len(set(step["branches"])) > 1
  assert out.sequences == mdjax.generate(model, [step["joined_tokens"]], max_new_tokens=10).sequences
  assert out.stats["target_passes"] == 15 + 9


def test_kv_join_equals_exact_join_where_the_layouts_coincide(model):
  out = mdjax.pipelines.run("reasoning", model, PROMPT, num_branches=1, branch_tokens=12,
                            max_new_tokens=8, join="kv", seed=1)
  distance = out.intermediate[0]["kv_join_distance"]
  assert distance["max_abs_logprob_diff"] < 1e-3 and distance["argmax_agreement"] == 1.0
  exact = mdjax.generate(model, [out.intermediate[0]["joined_tokens"]], max_new_tokens=8)
  assert out.sequences == exact.sequences


def test_kv_join_with_several_branches_is_measured(model):
  out = mdjax.pipelines.run("reasoning", model, PROMPT, num_branches=3, branch_tokens=12,
                            max_new_tokens=6, join="kv", position_gap=4, seed=1)
  distance = out.intermediate[0]["kv_join_distance"]
  assert distance["max_abs_logprob_diff"] > 1e-3  # the layouts differ: so do the logits
  assert 0 <= distance["argmax_agreement"] <= 1 and distance["mean_kl"] >= 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(join="fast"), r"join must be 'exact' or 'kv', got 'fast'"),
    (dict(position_gap=-1), r"position_gap must be an integer >= 0, got -1"),
    (dict(num_branches=0), r"num_branches must be an integer >= 1, got 0"),
    (dict(answer_pattern="("), r"answer_pattern '\(' is not a regular expression"),
])
def test_bad_options(model, kwargs, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.pipelines.run("reasoning", model, PROMPT, **kwargs)
