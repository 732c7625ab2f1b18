"""self_speculative: the target's first layers draft on the target's own cache;
greedy output == the target's greedy decoding, sampling follows the target's law."""

import numpy as np
import pytest

import mdjax
from tests.helpers import chi_square_p_value, random_model, target_law

VOCAB = 64  # random_model's


@pytest.fixture(scope="module")
def targets():
  return [random_model("llama", 1, layers=3), random_model("qwen3", 2, layers=3)]


@pytest.mark.parametrize("draft_layers,options", [
    (1, dict(num_draft_tokens=3)), (2, dict(num_draft_tokens=5)),
    (1, dict(draft_schedule="heuristic", num_draft_tokens=2, confidence_threshold=0.05)),
])
def test_self_speculative_equals_target_greedy(targets, draft_layers, options):
  rng = np.random.default_rng(draft_layers)
  for target in targets:
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (9, 2, 5)]
    greedy = mdjax.generate(target, prompts, max_new_tokens=29, eos_token_id=[])
    out = mdjax.generate(target, prompts, strategy="self_speculative", draft_layers=draft_layers,
                         max_new_tokens=29, eos_token_id=[], **options)
    assert out.sequences == greedy.sequences
    assert out.stats["target_passes"] < 28  # some drafted tokens were accepted


def test_cache_filled_exactly_and_eos_inside_a_block(targets):
  """Prompt 16 and budget 64 are whole buckets: a slot leaked per step would overflow."""
  target = targets[0]
  prompt = list(range(3, 19))
  free = mdjax.generate(target, [prompt], max_new_tokens=64, eos_token_id=[]).sequences
  out = mdjax.generate(target, [prompt], strategy="self_speculative", draft_layers=2,
                       num_draft_tokens=4, max_new_tokens=64, eos_token_id=[])
  assert out.sequences == free
  eos = free[0][9]
  with_eos = mdjax.generate(target, [prompt, [5, 6]], strategy="self_speculative", draft_layers=1,
                            max_new_tokens=30, eos_token_id=eos)
  assert with_eos.sequences == mdjax.generate(target, [prompt, [5, 6]], max_new_tokens=30,
                                              eos_token_id=eos).sequences


def test_self_speculative_sampling_follows_the_target_law(targets):
  target, prompt, draws, options = targets[0], [4, 5, 6, 7], 3000, dict(temperature=0.9)
  out = mdjax.generate(target, [prompt] * draws, strategy="self_speculative", draft_layers=1,
                       num_draft_tokens=2, max_new_tokens=3, eos_token_id=[], seed=4, **options)
  assert 0 < out.stats["accepted"] < out.stats["drafted"]
  assert chi_square_p_value([s[1] for s in out.sequences],
                            target_law(target, prompt, 1, options)) > 1e-3


@pytest.mark.parametrize("kwargs,match", [
    (dict(), r"needs draft_layers=<how many of the target's 3 layers draft>"),
    (dict(draft_layers=3), r"draft_layers must be an integer in \[1, 2\] .* got 3"),
    (dict(draft_layers=0), r"draft_layers must be an integer in \[1, 2\] .* got 0"),
    (dict(draft_layers=1, num_draft_tokens=0), r"num_draft_tokens must be an integer >= 1"),
])
def test_bad_options(targets, kwargs, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(targets[0], [1, 2], strategy="self_speculative", **kwargs)
