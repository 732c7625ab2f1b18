"""Beam search == transformers' `generate(num_beams=k, do_sample=False)`, hypotheses and scores.

Each case compares mdjax's ranked hypotheses (`out.beams`) with transformers'
`num_return_sequences=k` on the same tiny random checkpoint, token for token, and
their scores to 1e-4. No divergence is tolerated: these seeds have no near-tie
(docs/design.md §9 would allow one only at a reference near-tie below 1e-5). With
controls (`mdjax.controls`), transformers gets the same settings (presence and
frequency penalties as a custom processor), and the log-probabilities are its
processed scores of each hypothesis's tokens (`out.scores` along `out.beam_indices`).
"""

import dataclasses
import itertools

import jax
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import mdjax
from mdjax.generate import _compile, _prepare, _start
from tests.helpers import hf_controls, write_tiny_checkpoint

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
  """transformers' `generate` output for one prompt (sequences padded with `eos`), with
  mdjax's controls as transformers takes them: logit_bias as one-token `sequence_bias`,
  presence and frequency penalties as a custom processor."""
  options, processors = hf_controls(len(prompt), options)
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = torch_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos,
                               logits_processor=processors, return_dict_in_generate=True,
                               output_scores=True, **options)
  return out


def hf_beams(torch_model, prompt, eos, num_beams, top: int = 0, **options) -> list[dict]:
  """transformers' k final hypotheses, best first, as mdjax's `out.beams[i]`, with each
  token's processed score ("logprobs": `out.scores` of the beam it continued) and, for
  `top` > 0, that beam's `top` best (id, score) there ("top")."""
  out = hf_generate(torch_model, prompt, eos, num_beams=num_beams,
                    num_return_sequences=num_beams, **options)
  hypotheses = []
  for row, score, beams in zip(out.sequences[:, len(prompt):].tolist(),
                               out.sequences_scores.tolist(), out.beam_indices.tolist()):
    length = sum(b >= 0 for b in beams)  # padding (eos) after a hypothesis has no beam
    scores = [out.scores[s][beams[s]] for s in range(length)]
    hypotheses.append({"tokens": row[:length], "score": score,
                       "logprobs": [float(x[t]) for x, t in zip(scores, row)],
                       "top": [best(x, top) for x in scores] if top else None})
  return hypotheses


def best(scores, count: int) -> list[tuple[int, float]]:
  """The `count` best (id, score) of one step's scores, as mdjax's `out.top_logprobs`."""
  values, ids = torch.topk(scores, count)
  return list(zip(ids.tolist(), values.tolist()))


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
    np.testing.assert_array_equal(np.asarray(cache.k)[:, row, :len(p)],
                                  np.asarray(first.k)[:, row, :len(p)])
    np.testing.assert_array_equal(np.asarray(cache.v)[:, row, :len(p)],
                                  np.asarray(first.v)[:, row, :len(p)])
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


# ----------------------------------------------------------------------------- controls

# llama's beams loop on "23 115" after this prompt, so that every control changes them;
# 115 as EOS ends some hypotheses mid-way
CONTROL_PROMPT, CONTROL_EOS, CONTROL_BEAMS = [5, 9, 14, 9, 5, 30, 31], 115, 3
CONTROL_CASES = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[90], [23, 115]]),
    "min_new_tokens": dict(min_new_tokens=6),
    "logit_bias": dict(logit_bias={40: 3.0, 23: -2.0}),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "everything": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=[[9, 14]],
                       min_new_tokens=4, logit_bias={40: 1.0}, presence_penalty=0.5,
                       frequency_penalty=0.4, length_penalty=0.5),
}
TOP = 3


def assert_same_logprobs(logprobs, top, theirs: dict):
  """One hypothesis's `out.logprobs` and `out.top_logprobs` rows against transformers'."""
  np.testing.assert_allclose(logprobs, theirs["logprobs"], atol=SCORE_TOLERANCE)
  assert [[i for i, _ in step] for step in top] == [[i for i, _ in step] for step in theirs["top"]]
  np.testing.assert_allclose([[v for _, v in step] for step in top],
                             [[v for _, v in step] for step in theirs["top"]], atol=SCORE_TOLERANCE)


@pytest.fixture(scope="module")
def uncontrolled(pairs):
  """transformers' hypotheses for the control cases' prompt without a control."""
  return hf_beams(pairs["llama"][1], CONTROL_PROMPT, CONTROL_EOS, CONTROL_BEAMS)


@pytest.mark.parametrize("case", CONTROL_CASES)
def test_controls_match_transformers(pairs, uncontrolled, case):
  """Hypotheses and scores equal transformers' beam search with the same processors
  (applied to each beam's log-softmax, on its own text), and the best one's
  log-probabilities are the processed scores it summed, with their top 3."""
  model, torch_model = pairs["llama"]
  options = CONTROL_CASES[case]
  theirs = hf_beams(torch_model, CONTROL_PROMPT, CONTROL_EOS, CONTROL_BEAMS, top=TOP, **options)
  assert [h["tokens"] for h in theirs] != [h["tokens"] for h in uncontrolled]  # it tests something
  out = mdjax.generate(model, CONTROL_PROMPT, strategy="beam", num_beams=CONTROL_BEAMS,
                       max_new_tokens=MAX_NEW, eos_token_id=CONTROL_EOS, top_logprobs=TOP,
                       **options)
  assert_same_beams(out.beams[0], theirs)
  assert_same_logprobs(out.logprobs[0], out.top_logprobs[0], theirs[0])
  penalty = options.get("length_penalty", 1.0)
  assert sum(out.logprobs[0]) == pytest.approx(
      out.beams[0][0]["score"] * len(out.sequences[0]) ** penalty, abs=SCORE_TOLERANCE)


def test_every_hypothesis_has_its_logprobs_and_new_values_reuse_the_program(pairs):
  """Each of the k output rows (not only the best, which `generate` returns) holds its
  own hypothesis's processed scores; other penalty values run the same program."""
  model, torch_model = pairs["llama"]
  options = dict(CONTROL_CASES["everything"], top_logprobs=TOP)
  plan = _prepare(model, CONTROL_PROMPT, "beam", MAX_NEW, CONTROL_EOS, 0,
                  dict(options, num_beams=CONTROL_BEAMS))
  program, _, _ = _compile(plan.decoder, plan.params, plan.prompt, plan.limits, plan.layout,
                           **plan.static)
  buffer, _ = jax.device_get(program(plan.params, plan.prompt, plan.limits))
  theirs = hf_beams(torch_model, CONTROL_PROMPT, CONTROL_EOS, CONTROL_BEAMS, top=TOP,
                    **CONTROL_CASES["everything"])
  for row, hypothesis in enumerate(theirs):  # one prompt: row r is the r-th best
    count = buffer.count[row]
    assert buffer.tokens[row, :count].tolist() == hypothesis["tokens"]
    top = [list(zip(i, v)) for i, v in zip(buffer.top_ids[row, :count].tolist(),
                                           buffer.top_logprobs[row, :count].tolist())]
    assert_same_logprobs(buffer.logprobs[row, :count], top, hypothesis)
  again = dict(options, repetition_penalty=1.6, presence_penalty=0.2, logit_bias={40: 2.0})
  out = mdjax.generate(model, CONTROL_PROMPT, strategy="beam", num_beams=CONTROL_BEAMS,
                       max_new_tokens=MAX_NEW, eos_token_id=CONTROL_EOS, **again)
  assert not out.stats["compiled"], out.stats["compiled_because"]


def test_per_prompt_values_reach_each_prompts_beams(pairs):
  """A value per prompt, and each prompt's text, apply to all k beams of that prompt:
  each prompt's hypotheses equal transformers' on it alone with its value."""
  model, torch_model = pairs["llama"]
  prompts, penalties = [CONTROL_PROMPT, [7, 8, 7, 8, 7]], [1.8, 1.0]
  out = mdjax.generate(model, prompts, strategy="beam", num_beams=2, max_new_tokens=MAX_NEW,
                       eos_token_id=CONTROL_EOS, repetition_penalty=penalties,
                       no_repeat_ngram_size=2)
  for prompt, penalty, ours in zip(prompts, penalties, out.beams):
    assert_same_beams(ours, hf_beams(torch_model, prompt, CONTROL_EOS, 2,
                                     repetition_penalty=penalty, no_repeat_ngram_size=2))


def test_one_beam_processes_the_logits_as_greedy_search(pairs):
  """With one beam transformers runs greedy search, whose processors read the logits,
  not their log-softmax: the tokens are its greedy tokens under the processors, and the
  log-probabilities the log-softmax of its processed scores (what the score sums)."""
  model, torch_model = pairs["llama"]
  out = mdjax.generate(model, CONTROL_PROMPT, strategy="beam", num_beams=1, logprobs=True,
                       max_new_tokens=MAX_NEW, eos_token_id=CONTROL_EOS, repetition_penalty=1.8)
  reference = hf_generate(torch_model, CONTROL_PROMPT, CONTROL_EOS, repetition_penalty=1.8)
  tokens = reference.sequences[0, len(CONTROL_PROMPT):].tolist()
  expected = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(reference.scores, tokens)]
  assert out.sequences == [tokens[:len(out.sequences[0])]]
  np.testing.assert_allclose(out.logprobs[0], expected[:len(out.logprobs[0])],
                             atol=SCORE_TOLERANCE)
  # the penalty on the log-softmax (beam search's order) gives the first token another value
  ids = torch.tensor([CONTROL_PROMPT])
  with torch.no_grad():
    log_probs = torch.log_softmax(torch_model(ids).logits[:, -1], -1)
  penalized = transformers.RepetitionPenaltyLogitsProcessor(1.8)(ids, log_probs)
  assert abs(float(penalized[0, tokens[0]]) - expected[0]) > 10 * SCORE_TOLERANCE


@pytest.fixture(scope="module")
def lettered(pairs):
  """llama with a tokenizer that spells every id in the letters a-d (ids 2.. are "a",
  "b", .., "dddd"; WordPiece's "##" joins them without spaces), for stop strings; and
  that tokenizer, for transformers."""
  model, _ = pairs["llama"]
  texts = ["".join(p) for n in range(1, 5) for p in itertools.product("abcd", repeat=n)]
  words = ["[UNK]", "abcdef"] + ["##" + t for t in texts[:model.config.vocab_size - 2]]
  backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  backend.decoder = decoders.WordPiece(cleanup=False)
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
  return dataclasses.replace(model, tokenizer=tokenizer), tokenizer


@pytest.mark.parametrize("num_beams,stop_strings", [
    (2, ["ba"]),  # begun in the prompt ("..acb"), ended by a first token "a.."
    (3, ["ab", "ba"]),  # on most steps fewer than k candidates run on
    (2, ["a"]),  # every candidate of the first step ends: the search stops
])
def test_stop_strings_end_candidates_as_transformers_does(pairs, lettered, num_beams,
                                                          stop_strings):
  """A candidate that completes a stop string is a finished hypothesis (if among the k
  best) and never runs on; where fewer than k run on, ended ones fill in at score - 1e9;
  when none does, the search stops: transformers' beam search with the same strings."""
  model, tokenizer = lettered
  _, torch_model = pairs["llama"]
  theirs = hf_beams(torch_model, CONTROL_PROMPT, CONTROL_EOS, num_beams,
                    stop_strings=stop_strings, tokenizer=tokenizer)
  plain = hf_beams(torch_model, CONTROL_PROMPT, CONTROL_EOS, num_beams)
  assert [h["tokens"] for h in theirs] != [h["tokens"] for h in plain]
  out = mdjax.generate(model, CONTROL_PROMPT, strategy="beam", num_beams=num_beams,
                       max_new_tokens=MAX_NEW, eos_token_id=CONTROL_EOS,
                       stop_strings=stop_strings)
  assert_same_beams(out.beams[0], theirs)
  stopped_by = out.stats["stopped_by"][0]
  assert stopped_by in stop_strings
  text = tokenizer.decode(CONTROL_PROMPT + out.sequences[0]).replace(" ", "")
  assert stopped_by in text[-len(stopped_by) - 4:]  # within the last token (at most 4 letters)
