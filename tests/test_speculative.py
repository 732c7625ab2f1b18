"""speculative (greedy): output == the target's greedy decoding, whatever the draft."""

import numpy as np
import pytest

import mdjax
from tests.helpers import random_model

VOCAB = 64  # random_model's


@pytest.fixture(scope="module")
def targets():
  return [random_model("llama", 1), random_model("qwen3", 2)]


@pytest.fixture(scope="module")
def draft():
  return random_model("llama", 7, layers=1, hidden=16, heads=2, kv_heads=1)  # another shape


def test_draft_equal_to_target_accepts_every_token(targets):
  """Also a run that fills the cache exactly: prompt and budget are whole buckets
  (16 and 64), so a slot leaked per step would overflow it and change the output."""
  target = targets[0]
  prompt = list(range(3, 19))
  greedy = mdjax.generate(target, [prompt], max_new_tokens=64, eos_token_id=[]).sequences
  for gamma in (1, 3):
    out = mdjax.generate(target, [prompt], strategy="speculative", draft=target,
                         num_draft_tokens=gamma, max_new_tokens=64, eos_token_id=[])
    assert out.stats["accepted"] == out.stats["drafted"]
    assert out.stats["target_passes"] == -(-63 // (gamma + 1))  # (gamma + 1) tokens per pass
    assert out.sequences == greedy


@pytest.mark.parametrize("gamma", [1, 2, 5])
def test_speculative_equals_target_greedy(targets, draft, gamma):
  rng = np.random.default_rng(gamma)
  for target in targets:
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (9, 2, 5)]
    greedy = mdjax.generate(target, prompts, max_new_tokens=29, eos_token_id=[])
    for d in (draft, random_model(target.config.family, 11)):
      out = mdjax.generate(target, prompts, strategy="speculative", draft=d,
                           num_draft_tokens=gamma, max_new_tokens=29, eos_token_id=[])
      assert out.sequences == greedy.sequences
      assert out.stats["draft_passes"] == gamma * out.stats["target_passes"]


def test_eos_inside_an_accepted_block(targets):
  target = targets[0]
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
  free = mdjax.generate(target, prompts, max_new_tokens=20, eos_token_id=[]).sequences
  eos = free[0][6]
  out = mdjax.generate(target, prompts, strategy="speculative", draft=target, num_draft_tokens=4,
                       max_new_tokens=20, eos_token_id=eos)
  assert out.sequences == mdjax.generate(target, prompts, max_new_tokens=20,
                                         eos_token_id=eos).sequences


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_draft_tokens=0), r"num_draft_tokens must be an integer >= 1, got 0"),
    (dict(draft=None), r"needs draft=<an mdjax Model>, got None"),
])
def test_bad_options(targets, draft, kwargs, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(targets[0], [1, 2], strategy="speculative", **{"draft": draft, **kwargs})


def test_draft_with_another_vocabulary_is_refused(targets):
  other = mdjax.load("random-llama-tiny")
  with pytest.raises(mdjax.MdjaxError, match=r"draft's vocabulary \(256 tokens\).*target's \(64"):
    mdjax.generate(targets[0], [1, 2], strategy="speculative", draft=other)
