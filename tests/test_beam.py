"""Beam search == transformers' `generate(num_beams=k, do_sample=False)`, hypotheses and scores.

Each case compares mdjax's ranked hypotheses (`out.beams`) with transformers'
`num_return_sequences=k` on the same tiny random checkpoint, token for token, and
their scores to 1e-4. No divergence is tolerated: these seeds have no near-tie
(docs/design.md §9 would allow one only at a reference near-tie below 1e-5).
"""

import jax
import numpy as np
import pytest
import torch

import mdjax
from mdjax.generate import _prepare, _start
from tests.helpers import write_tiny_checkpoint

MAX_NEW = 12
SCORE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  """family -> (mdjax model, torch model) of one tiny random checkpoint."""
  result = {}
  for family, seed in (("llama", 3), ("qwen3", 5)):
    path = tmp_path_factory.mktemp(family)
    torch_model = write_tiny_checkpoint(path, family=family, seed=seed)
    result[family] = mdjax.load(str(path), dtype="float32"), torch_model
  return result


def hf_generate(torch_model, prompt, eos, **options):
  """transformers' `generate` output for one prompt (sequences padded with `eos`)."""
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = torch_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos,
                               return_dict_in_generate=True, output_scores=True, **options)
  return out


def hf_beams(torch_model, prompt, eos, num_beams, **options) -> list[dict]:
  """transformers' k final hypotheses, best first, as mdjax's `out.beams[i]`."""
  out = hf_generate(torch_model, prompt, eos, num_beams=num_beams,
                    num_return_sequences=num_beams, **options)
  hypotheses = []
  for row, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
    end = row.index(eos) + 1 if eos in row else len(row)  # padding is eos too
    hypotheses.append({"tokens": row[:end], "score": score})
  return hypotheses


def emitted_token(torch_model, prompt, index, **options) -> int:
  """Token `index` of transformers' best output under `options` (EOS 2): a token the
  model emits early, so that taken as EOS it ends hypotheses mid-way."""
  return hf_generate(torch_model, prompt, eos=2, **options).sequences[0, len(prompt) + index].item()


def assert_same_beams(ours: list[dict], theirs: list[dict]):
  assert [h["tokens"] for h in ours] == [h["tokens"] for h in theirs]
  np.testing.assert_allclose([h["score"] for h in ours], [h["score"] for h in theirs],
                             atol=SCORE_TOLERANCE)


CASES = [  # family, num_beams, length_penalty, early_stopping, prompt seed, EOS: index of the
    # token used as EOS in the output under EOS 2. In each case another early_stopping value
    # gives other hypotheses (checked with transformers), so the stopping rules are tested.
    ("llama", 2, 1.0, False, 1, 1),  # the best ends at EOS after 2 tokens; True: other 2nd
    ("llama", 4, 1.0, True, 5, 1),  # False: other 3rd and 4th
    ("qwen3", 2, 2.0, True, 0, 3),  # False and "never": another best
    ("qwen3", 3, 1.0, "never", 0, 3),  # False and True: another 3rd
]


@pytest.mark.parametrize("family,num_beams,length_penalty,early_stopping,prompt_seed,eos_index",
                         CASES)
def test_beams_match_transformers(pairs, family, num_beams, length_penalty, early_stopping,
                                  prompt_seed, eos_index):
  model, torch_model = pairs[family]
  prompt = np.random.default_rng(prompt_seed).integers(3, model.config.vocab_size, 6).tolist()
  options = dict(num_beams=num_beams, length_penalty=length_penalty,
                 early_stopping=early_stopping)
  eos = emitted_token(torch_model, prompt, eos_index, **options)
  theirs = hf_beams(torch_model, prompt, eos, **options)
  assert any(len(h["tokens"]) < MAX_NEW for h in theirs)  # a hypothesis ended by EOS mid-way
  out = mdjax.generate(model, prompt, strategy="beam", max_new_tokens=MAX_NEW, eos_token_id=eos,
                       **options)
  assert len(out.beams) == 1 and len(out.beams[0]) == num_beams
  assert_same_beams(out.beams[0], theirs)
  assert out.sequences == [theirs[0]["tokens"]]


def test_ragged_batch_equals_transformers_per_prompt(pairs):
  """Two prompts of lengths 9 and 2 in one run; the short one's best ends at EOS mid-way."""
  model, torch_model = pairs["llama"]
  rng = np.random.default_rng(8)
  prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (9, 2)]
  options = dict(num_beams=3, length_penalty=0.5, early_stopping=False)
  eos = emitted_token(torch_model, prompts[1], 1, **options)
  out = mdjax.generate(model, prompts, strategy="beam", max_new_tokens=MAX_NEW, eos_token_id=eos,
                       **options)
  theirs = [hf_beams(torch_model, prompt, eos, **options) for prompt in prompts]
  assert len(theirs[1][0]["tokens"]) < MAX_NEW
  assert len(out.beams) == 2
  for ours, reference in zip(out.beams, theirs):
    assert_same_beams(ours, reference)
  assert out.sequences == [reference[0]["tokens"] for reference in theirs]


def test_one_beam_is_greedy(pairs):
  """transformers runs greedy search for num_beams=1, whatever early_stopping says."""
  model, torch_model = pairs["qwen3"]
  prompt = [5, 9, 14, 3]
  eos = emitted_token(torch_model, prompt, 4)
  out = mdjax.generate(model, prompt, strategy="beam", num_beams=1, early_stopping=False,
                       max_new_tokens=MAX_NEW, eos_token_id=eos)
  greedy = hf_generate(torch_model, prompt, eos).sequences[0, len(prompt):].tolist()
  assert out.sequences == [greedy[:greedy.index(eos) + 1]]
  assert [h["tokens"] for h in out.beams[0]] == out.sequences


def test_no_new_tokens_no_hypotheses(pairs):
  """transformers rejects max_new_tokens=0; mdjax, as for its other strategies, returns
  nothing (the options match the first case's, so the program is reused)."""
  model, _ = pairs["llama"]
  out = mdjax.generate(model, [4, 5, 6, 7, 8, 9], strategy="beam", num_beams=2, max_new_tokens=0)
  assert out.sequences == [[]] and out.beams == [[]] and out.stats["target_passes"] == 0


def test_reorder_moves_only_branch_slots(pairs):
  """After prefill and some passes (the strategy's own init and steps): the prompt's K/V
  is unchanged and every pass appended exactly k slots, one per beam's segment."""
  model, _ = pairs["llama"]
  prompts, k, passes = [[4, 5, 6, 7, 8], [9, 10]], 3, 5
  plan = _prepare(model, prompts, "beam", MAX_NEW, [], 0, dict(num_beams=k))

  @jax.jit
  def run(params, prompt, limits):
    first = _start(plan.decoder, params, prompt, limits, **plan.static)
    return first.cache, jax.lax.fori_loop(0, passes, lambda _, s: plan.decoder.step(params, s),
                                          first).cache

  first, cache = jax.device_get(run(plan.params, plan.prompt, plan.limits))
  for row, p in enumerate(prompts):
    np.testing.assert_array_equal(cache.k[:, row, :len(p)], first.k[:, row, :len(p)])
    np.testing.assert_array_equal(cache.v[:, row, :len(p)], first.v[:, row, :len(p)])
    assert cache.length[row] == len(p) + passes * k
    branch = cache.seg[row, len(p):len(p) + passes * k]
    assert (branch == np.tile(np.arange(1, k + 1), passes)).all()


@pytest.mark.parametrize("options,message", [
    (dict(num_beams=0), r"num_beams must be an integer >= 1, got 0"),
    (dict(num_beams=2.0), r"num_beams must be an integer >= 1, got 2\.0"),
    (dict(num_beams=True), r"num_beams must be an integer >= 1, got True"),
    (dict(length_penalty=float("nan")), r"length_penalty must be a finite number, got nan"),
    (dict(length_penalty="long"), r"length_penalty must be a finite number, got 'long'"),
    (dict(early_stopping="always"),
     r"early_stopping must be True, False or 'never', got 'always'"),
    (dict(early_stopping=1), r"early_stopping must be True, False or 'never', got 1"),
    (dict(num_samples=2), r"unknown option 'num_samples' for strategy 'beam'"),
])
def test_bad_options_name_the_value(pairs, options, message):
  model, _ = pairs["llama"]
  with pytest.raises(mdjax.MdjaxError, match=message):
    mdjax.generate(model, [1, 2], strategy="beam", **options)


def test_stream_rejects_beam(pairs):
  model, _ = pairs["llama"]
  with pytest.raises(mdjax.MdjaxError, match=r"stream does not support strategy 'beam'"):
    next(mdjax.stream(model, [1, 2], strategy="beam", num_beams=2))
