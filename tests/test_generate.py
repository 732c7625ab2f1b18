"""mdjax.generate: greedy == transformers, batching, sampling laws, streaming."""

import numpy as np
import pytest

import mdjax
from tests.helpers import (assert_same_greedy, chi_square_p_value, expected_first_token_law,
                           hf_greedy, write_tiny_checkpoint)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  torch_model = write_tiny_checkpoint(path, family=request.param, seed=3)
  return mdjax.load(str(path), dtype="float32"), torch_model


def test_greedy_matches_transformers(pair):
  model, torch_model = pair
  rng = np.random.default_rng(0)
  for length in (1, 5, 17):
    prompt = rng.integers(3, model.config.vocab_size, length).tolist()
    ours = mdjax.generate(model, prompt, max_new_tokens=24, eos_token_id=[]).sequences[0]
    theirs = hf_greedy(torch_model, prompt, 24, eos_token_id=None)
    assert len(ours) == 24
    assert_same_greedy(ours, theirs, torch_model, prompt)


def test_greedy_stops_at_eos_like_transformers(pair):
  model, torch_model = pair
  prompt = [5, 9, 14, 3]
  free = mdjax.generate(model, prompt, max_new_tokens=20, eos_token_id=[]).sequences[0]
  eos = free[6]  # a token the model emits mid-way
  ours = mdjax.generate(model, prompt, max_new_tokens=20, eos_token_id=eos).sequences[0]
  assert ours == free[:free.index(eos) + 1]
  assert_same_greedy(ours, hf_greedy(torch_model, prompt, 20, eos), torch_model, prompt)


def test_ragged_batch_equals_one_prompt_at_a_time(pair):
  model, _ = pair
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (3, 11, 1, 7)]
  batched = mdjax.generate(model, prompts, max_new_tokens=12, eos_token_id=[])
  for prompt, seq in zip(prompts, batched.sequences):
    assert seq == mdjax.generate(model, prompt, max_new_tokens=12, eos_token_id=[]).sequences[0]
  assert batched.stats["generated_tokens"] == 4 * 12
  assert batched.stats["target_passes"] == 11


def test_per_row_eos_stops_rows_independently():
  model = mdjax.load("random-llama-tiny")
  prompts = [[4, 5, 6], [7, 8, 9, 10]]
  free = mdjax.generate(model, prompts, max_new_tokens=16, eos_token_id=[]).sequences
  eos = free[0][3]
  out = mdjax.generate(model, prompts, max_new_tokens=16, eos_token_id=[eos]).sequences
  for row_free, row in zip(free, out):
    expected = row_free[:row_free.index(eos) + 1] if eos in row_free else row_free
    assert row == expected


def test_compiled_program_is_reused_across_prompt_lengths():
  model = mdjax.load("random-llama-tiny")
  mdjax.clear_compiled()
  first = mdjax.generate(model, [1, 2, 3], max_new_tokens=9)
  again = mdjax.generate(model, [1, 2, 3, 4, 5], max_new_tokens=10)  # same buckets
  assert first.stats["compile_s"] > 0 and again.stats["compile_s"] == 0
  assert len(mdjax.compiled_programs()) == 1
  mdjax.generate(model, [1, 2, 3], max_new_tokens=40)  # a bigger output bucket: a new program
  assert len(mdjax.compiled_programs()) == 2


def test_stream_yields_the_same_tokens_as_generate():
  model = mdjax.load("random-llama-tiny")
  prompts = [[4, 5, 6], [7, 8]]
  streamed = [[], []]
  for chunk in mdjax.stream(model, prompts, max_new_tokens=7, eos_token_id=[]):
    for row, tokens in zip(streamed, chunk):
      row.extend(tokens)
  assert streamed == mdjax.generate(model, prompts, max_new_tokens=7, eos_token_id=[]).sequences


# --- sampling -------------------------------------------------------------------------------


def test_sampling_is_seeded_and_row_independent():
  model = mdjax.load("random-llama-tiny")
  prompts = [[4, 5, 6], [7, 8]]
  kwargs = dict(strategy="sample", max_new_tokens=12, eos_token_id=[], temperature=1.0)
  a = mdjax.generate(model, prompts, seed=5, **kwargs).sequences
  assert a == mdjax.generate(model, prompts, seed=5, **kwargs).sequences
  assert a != mdjax.generate(model, prompts, seed=6, **kwargs).sequences
  # a row's samples do not depend on the other rows of the batch
  assert a[0] == mdjax.generate(model, prompts[:1], seed=5, **kwargs).sequences[0]


def test_top_k_one_is_greedy():
  model = mdjax.load("random-llama-tiny")
  prompts = [[4, 5, 6], [7, 8]]
  sampled = mdjax.generate(model, prompts, strategy="sample", top_k=1, temperature=0.7, seed=3,
                           max_new_tokens=12, eos_token_id=[]).sequences
  assert sampled == mdjax.generate(model, prompts, max_new_tokens=12, eos_token_id=[]).sequences


@pytest.mark.parametrize("options", [
    dict(temperature=1.5),
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.2, top_p=0.8),
    dict(temperature=2.0, min_p=0.1),
])
def test_first_token_frequencies_match_the_sampling_law(options):
  """Chi-square goodness of fit of 3000 first tokens against softmax(logits / T)
  after top-k / top-p / min-p; p-value threshold 1e-3 (fails by chance 1 in 1000)."""
  model = mdjax.load("random-llama-tiny", seed=2)
  prompt = [4, 5, 6, 7]
  law = expected_first_token_law(mdjax.forward_logits(model, prompt)[-1], **options)
  draws = 3000
  out = mdjax.generate(model, [prompt] * draws, strategy="sample", max_new_tokens=1,
                       eos_token_id=[], seed=11, **options)
  first = np.array([s[0] for s in out.sequences])
  assert law[first].min() > 0, "sampled a token the filters remove"
  assert chi_square_p_value(first, law) > 1e-3
