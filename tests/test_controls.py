"""The controls (`mdjax.controls`) against transformers' `generate` with the same
settings, on a tiny random checkpoint in float32: tokens equal at temperature 0,
log-probabilities within 1e-4 of its processed scores, sampling laws by chi-square;
a sweep of values compiles once; bad input is one line naming the option."""

import numpy as np
import pytest
import torch
import transformers

import mdjax
from mdjax import strategies
from mdjax.controls import CONTROL_OPTIONS
from mdjax.errors import MdjaxError
from tests.helpers import (LOSSLESS, OpenAIPenalties, assert_same_greedy, chi_square_p_value,
                           every_strategy, hf_controls, hf_greedy, run_strategy, strategy_heads,
                           write_tiny_checkpoint)

PROMPTS = [[5, 9, 14, 9, 5, 30, 31], [7, 8, 7, 8]]
EOS = 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny")
  torch_model = write_tiny_checkpoint(path, seed=5)
  return mdjax.load(str(path), dtype="float32"), torch_model


def hf_generate(torch_model, prompt, max_new_tokens, eos_token_id=EOS, **settings):
  """transformers' tokens (generated only) and processed scores per step."""
  settings, processors = hf_controls(len(prompt), settings)
  with torch.no_grad():
    out = torch_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                               do_sample=False, max_new_tokens=max_new_tokens,
                               eos_token_id=eos_token_id,
                               pad_token_id=0, logits_processor=processors,
                               output_scores=True, return_dict_in_generate=True, **settings)
  return out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.scores]


CASES = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[72], [73, 67], [30, 31, 28], [8, 171]]),
    "min_new_tokens": dict(min_new_tokens=10, eos_token_id=72),  # greedy's 6th token in row 0
    "logit_bias": dict(logit_bias={40: 3.0, 12: -100.0, 77: 2.5}),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "everything": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=[[9, 14]],
                       min_new_tokens=4, logit_bias={40: 2.0}, presence_penalty=0.5,
                       frequency_penalty=0.4),
}


@pytest.fixture(scope="module")
def case_outputs(pair):
  """`output(case)`: the case's greedy tokens and log-probabilities; `output(case,
  controls=False)`: greedy's without its controls (with its EOS). Each generated once
  for the tests that read them."""
  model, _ = pair
  outputs = {}

  def output(case, controls=True):
    options = dict(CASES[case])
    eos = options.pop("eos_token_id", EOS)
    options = options if controls else {}
    key = (case if controls else None, eos)
    if key not in outputs:
      outputs[key] = mdjax.generate(model, PROMPTS, max_new_tokens=20, eos_token_id=eos,
                                    logprobs=True, **options)
    return outputs[key]

  return output


@pytest.mark.parametrize("case", CASES)
def test_greedy_with_each_control_is_transformers_greedy(pair, case_outputs, case):
  """Tokens equal to transformers' greedy with the same processors, and each token's
  log-probability within 1e-4 of the log-softmax of transformers' processed scores."""
  _, torch_model = pair
  options = dict(CASES[case])
  eos = options.pop("eos_token_id", EOS)
  out = case_outputs(case)
  for prompt, ours, logprobs in zip(PROMPTS, out.sequences, out.logprobs):
    theirs, scores = hf_generate(torch_model, prompt, 20, eos_token_id=eos, **options)
    assert_same_greedy(ours, theirs, torch_model, prompt)
    expected = [float(torch.log_softmax(s, -1)[t]) for s, t in zip(scores, theirs)]
    np.testing.assert_allclose(logprobs, expected[:len(logprobs)], atol=1e-4)


def test_controls_change_the_tokens(case_outputs):
  """The cases above test something: each control changes greedy's tokens here."""
  for case in CASES:
    plain = case_outputs(case, controls=False).sequences
    assert case_outputs(case).sequences != plain, case


def test_top_logprobs_are_the_k_best_of_transformers_scores(pair):
  model, torch_model = pair
  out = mdjax.generate(model, PROMPTS[:1], max_new_tokens=8, eos_token_id=EOS, top_logprobs=4,
                       repetition_penalty=1.5)
  _, scores = hf_generate(torch_model, PROMPTS[0], 8, repetition_penalty=1.5)
  for best, s in zip(out.top_logprobs[0], scores):
    values, ids = torch.topk(torch.log_softmax(s, -1), 4)
    assert [i for i, _ in best] == ids.tolist()
    np.testing.assert_allclose([v for _, v in best], values.numpy(), atol=1e-4)


def test_sampled_token_follows_the_processed_law(pair):
  """2,000 rows of one prompt draw their first token; the counts fit the law of
  transformers' processors (bias, repetition penalty, then temperature, top_k):
  chi-square."""
  model, torch_model = pair
  prompt, settings = PROMPTS[0], dict(temperature=0.8, top_k=12)
  controls = dict(repetition_penalty=2.0, logit_bias={40: 1.5, 12: 2.0})
  out = mdjax.generate(model, [prompt] * 2000, strategy="sample", max_new_tokens=1,
                       eos_token_id=EOS, seed=3, **settings, **controls)
  with torch.no_grad():
    logits = torch_model(torch.tensor([prompt])).logits[:, -1]
  processors = transformers.LogitsProcessorList([
      transformers.SequenceBiasLogitsProcessor({(40,): 1.5, (12,): 2.0}),
      transformers.RepetitionPenaltyLogitsProcessor(2.0),
      transformers.TemperatureLogitsWarper(0.8), transformers.TopKLogitsWarper(12)])
  law = torch.softmax(processors(torch.tensor([prompt]), logits).double(), -1)[0].numpy()
  samples = [s[0] for s in out.sequences]
  assert chi_square_p_value(samples, law) > 1e-3
  plain_law = torch.softmax(logits.double() / 0.8, -1)[0].numpy()
  assert chi_square_p_value(samples, plain_law) < 1e-6  # the processors changed the law


def test_a_sweep_compiles_once(pair):
  """Temperature, top_p and the penalties are data: a new value never recompiles."""
  model, _ = pair
  first = mdjax.generate(model, PROMPTS, strategy="sample", max_new_tokens=6, temperature=0.5,
                         top_p=0.9, repetition_penalty=1.1, eos_token_id=EOS)
  assert first.stats["compiled"] or first.stats["compile_s"] == 0.0
  for i in range(1, 6):
    out = mdjax.generate(model, PROMPTS, strategy="sample", max_new_tokens=6,
                         temperature=0.5 + 0.1 * i, top_p=0.9 - 0.05 * i,
                         repetition_penalty=1.1 + 0.2 * i, logit_bias=None, seed=i,
                         eos_token_id=EOS)
    assert not out.stats["compiled"], out.stats["compiled_because"]
  again = mdjax.generate(model, PROMPTS, strategy="sample", max_new_tokens=6, temperature=0.5,
                         top_p=0.9, top_k=5, repetition_penalty=1.1, eos_token_id=EOS)
  assert again.stats["compiled"] and "filters" in again.stats["compiled_because"]


def test_values_per_prompt_are_each_prompts_own(pair):
  """A list gives one value per prompt: each row equals its row when every prompt takes
  its value (the same program: the values are data)."""
  model, _ = pair
  penalties, biases = [1.0, 2.5], [0.0, 3.0]
  out = mdjax.generate(model, PROMPTS, max_new_tokens=12, eos_token_id=EOS,
                       repetition_penalty=penalties, presence_penalty=biases)
  for row, (penalty, presence, ours) in enumerate(zip(penalties, biases, out.sequences)):
    every = mdjax.generate(model, PROMPTS, max_new_tokens=12, eos_token_id=EOS,
                           repetition_penalty=penalty, presence_penalty=presence)
    assert not every.stats["compiled"], every.stats["compiled_because"]
    assert ours == every.sequences[row]


def test_multi_question_branch_counts_its_own_text(pair):
  """A branch is processed with the shared context and its own question and answer, as
  that question alone: answer j equals greedy on context + question j."""
  model, _ = pair
  context, questions = [5, 9, 14, 9, 5], [[30, 31, 9], [7, 8, 7]]
  options = dict(repetition_penalty=1.7, no_repeat_ngram_size=2, presence_penalty=0.6)
  out = mdjax.generate(model, [context], strategy="multi_question", questions=questions,
                       max_new_tokens=10, eos_token_id=EOS, **options)
  for question, answer in zip(questions, out.sequences):
    alone = mdjax.generate(model, [context + question], max_new_tokens=10, eos_token_id=EOS,
                           **options)
    assert answer == alone.sequences[0]


def test_a_strategy_refuses_a_control_it_does_not_honor(pair, monkeypatch):
  """Every registered strategy honors every control today; one that declares fewer
  (`Strategy.controls`) refuses the others in one line naming both."""
  model, _ = pair
  assert all(set(cls.controls) == set(CONTROL_OPTIONS) for cls in strategies.STRATEGIES.values())
  monkeypatch.setattr(strategies.get("greedy"), "controls", ("logprobs",))
  with pytest.raises(MdjaxError, match="strategy 'greedy' does not honor the control "
                                       "'repetition_penalty'") as error:
    mdjax.generate(model, PROMPTS, repetition_penalty=1.2)
  assert "\n" not in str(error.value)
  mdjax.generate(model, PROMPTS, max_new_tokens=20, logprobs=True)  # `case_outputs`' program


@pytest.mark.parametrize("options, named", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(bad_words_ids=[[3, 500]]), "bad_words_ids"),
    (dict(bad_words_ids=[[]]), "bad_words_ids"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1000: 1.0}), "logit_bias"),
    (dict(top_logprobs=10_000), "top_logprobs"),
    (dict(min_new_tokens=40), "min_new_tokens"),
    (dict(no_repeat_ngram_size=-2), "no_repeat_ngram_size"),
    (dict(repetition_penalty=[1.1, 1.2, 1.3]), "repetition_penalty"),
    (dict(temperature=[0.5]), "temperature"),
    (dict(stop_strings=["a"]), "stop_strings"),  # the tiny model has no tokenizer
])
def test_bad_input_names_the_option(pair, options, named):
  model, _ = pair
  strategy = "sample" if "temperature" in options else "greedy"
  with pytest.raises(MdjaxError, match=named) as error:
    mdjax.generate(model, PROMPTS, strategy=strategy, max_new_tokens=20, **options)
  assert "\n" not in str(error.value)


CONTROLLED = dict(repetition_penalty=1.6, no_repeat_ngram_size=2, bad_words_ids=[[40], [12, 13]],
                  min_new_tokens=5, logit_bias={30: 1.5}, presence_penalty=0.4,
                  frequency_penalty=0.3)


@pytest.fixture(scope="module")
def strategy_requests(pair):
  model, _ = pair
  draft = mdjax.load(str(model.path), dtype="float32")
  return every_strategy(draft, strategy_heads(model))


@pytest.fixture(scope="module")
def controlled_greedy(pair, strategy_requests):
  """Greedy with `CONTROLLED` on the lossless strategies' prompts (all `STRATEGY_PROMPTS`)."""
  model, _ = pair
  assert not any(strategy_requests[strategy][0] for strategy in LOSSLESS)
  return run_strategy(model, "greedy", ([], dict(CONTROLLED, logprobs=True)), max_new_tokens=16)


@pytest.mark.parametrize("strategy", sorted(LOSSLESS))
def test_lossless_strategies_keep_greedys_tokens_under_the_controls(pair, strategy_requests,
                                                                    controlled_greedy, strategy):
  """At temperature 0 with every control on, each lossless strategy that honors them
  gives greedy's tokens with the same controls (drafts processed along their own path),
  and the same log-probabilities."""
  model, _ = pair
  prompts, options = strategy_requests[strategy]
  controlled = dict(CONTROLLED, logprobs=True)
  ours = run_strategy(model, strategy, (prompts, dict(options, **controlled)), max_new_tokens=16)
  assert ours.sequences == controlled_greedy.sequences
  for a, b in zip(ours.logprobs, controlled_greedy.logprobs):
    np.testing.assert_allclose(a, b, atol=1e-4)


SAMPLED_PROMPT = PROMPTS[1]
SAMPLED_SETTINGS = dict(temperature=0.9, top_k=8)
SAMPLED_CONTROLS = dict(repetition_penalty=1.8, logit_bias={40: 1.0}, presence_penalty=0.5)


@pytest.fixture(scope="module")
def sampled_draft(tmp_path_factory):
  """A draft that disagrees with the target."""
  path = tmp_path_factory.mktemp("draft")
  write_tiny_checkpoint(path, seed=6)
  return mdjax.load(str(path), dtype="float32")


@pytest.fixture(scope="module")
def second_token_law(pair):
  """The law of the second token under `SAMPLED_SETTINGS` and `SAMPLED_CONTROLS`: the
  first token's, then the next one's after it, transformers' processors on each prefix."""
  _, torch_model = pair
  prompt = SAMPLED_PROMPT

  def law(ids):
    with torch.no_grad():
      logits = torch_model(torch.tensor([ids])).logits[:, -1].double()
    processors = transformers.LogitsProcessorList([
        transformers.SequenceBiasLogitsProcessor({(40,): 1.0}),
        transformers.RepetitionPenaltyLogitsProcessor(1.8),
        OpenAIPenalties(len(prompt), 0.5, 0.0),
        transformers.TemperatureLogitsWarper(0.9), transformers.TopKLogitsWarper(8)])
    return torch.softmax(processors(torch.tensor([ids]), logits), -1)[0].numpy()

  first = law(prompt)
  return sum(p * law(prompt + [x]) for x, p in enumerate(first) if p > 0)


@pytest.mark.parametrize("strategy", ["sample", "speculative", "speculative_tree"])
def test_sampled_strategies_follow_the_processed_law(pair, sampled_draft, second_token_law,
                                                     strategy):
  """The second token of 1,500 rows (its law: the first token's, then the next one's
  after it, transformers' processors on each prefix), with a draft that disagrees with
  the target: the speculative rules keep the processed target law. Chi-square."""
  model, _ = pair
  draft, rows = sampled_draft, 1500
  options = {"sample": {}, "speculative": dict(draft=draft, num_draft_tokens=2),
             "speculative_tree": dict(draft=draft, tree_depth=2, tree_top_k=2,
                                      tree_budget=4)}[strategy]
  out = mdjax.generate(model, [SAMPLED_PROMPT] * rows, strategy=strategy, max_new_tokens=2,
                       eos_token_id=[], seed=7, **options, **SAMPLED_SETTINGS,
                       **SAMPLED_CONTROLS)
  second = [s[1] for s in out.sequences]
  assert chi_square_p_value(second, second_token_law) > 1e-3
  if strategy != "sample":
    assert out.stats["accepted"] < out.stats["drafted"]  # the draft was rejected at times


@pytest.fixture(scope="module")
def smollm2():
  """Its layers scanned: a program compiles in a fraction of the unrolled time, with the
  same tokens (`tests/test_layer_loop.py`)."""
  return mdjax.load("smollm2-135m-instruct", layer_loop="scan")


STOP_PROMPTS = ["The four seasons of the year are", "Count from one to ten: one, two,"]
STOP_NEW_TOKENS = 12  # each row's stop string ends by its 8th token


@pytest.fixture(scope="module")
def stop_case(smollm2):
  """Greedy's tokens of `STOP_PROMPTS`, the stop strings (a piece of row 0's text, one
  row 1 writes, one never written), and per row how many tokens end right after the
  token where transformers' `StopStringCriteria` first fires on greedy's own tokens."""
  plain = mdjax.generate(smollm2, STOP_PROMPTS, max_new_tokens=STOP_NEW_TOKENS)
  stops = [plain.texts[0][20:24], ", six", "never in this text"]
  criterion = transformers.StopStringCriteria(smollm2.tokenizer, stops)
  ends = []
  for prompt, full in zip(STOP_PROMPTS, plain.sequences):
    ids = smollm2.tokenizer(prompt)["input_ids"]
    fires = [bool(criterion(torch.tensor([ids + full[:i + 1]]), None)[0])
             for i in range(len(full))]
    assert any(fires), "a stop string that never occurs tests nothing"
    ends.append(fires.index(True) + 1)
  return plain.sequences, stops, ends


@pytest.mark.parametrize("strategy, options", [
    ("greedy", {}), ("self_speculative", dict(draft_layers=8, num_draft_tokens=4))])
def test_stop_strings_cut_where_transformers_cuts(smollm2, stop_case, strategy, options):
  """Each row ends right after the token where transformers' `StopStringCriteria`
  first fires on greedy's own tokens (the text keeps the string); `out.stats` names
  the string that ended each row. A chain's several tokens a step are each checked."""
  plain, stops, ends = stop_case
  ours = mdjax.generate(smollm2, STOP_PROMPTS, strategy=strategy,
                        max_new_tokens=STOP_NEW_TOKENS, stop_strings=stops, **options)
  for full, end, cut, stopped_by in zip(plain, ends, ours.sequences, ours.stats["stopped_by"]):
    assert cut == full[:end]
    text = smollm2.tokenizer.decode(cut)
    assert stopped_by in stops[:2] and stopped_by in text


def test_smollm2_greedy_with_every_control_is_transformers(smollm2):
  """On the shipped SmolLM2 (float32; transformers reads the same weights from the
  folder mdjax converted its GGUF into): greedy with every control on equals
  transformers' greedy with the same processors, log-probabilities within 1e-4; the
  controls (some picked from transformers' greedy tokens without them) change those."""
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(
      smollm2.path, dtype=torch.float32).eval()
  prompt = mdjax.chat.chat_ids(smollm2, "List five animals that live in the sea.")
  eos = list(smollm2.config.eos_token_id)
  plain = hf_greedy(torch_model, prompt, 24, eos)
  options = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, presence_penalty=0.4,
                 frequency_penalty=0.2, bad_words_ids=[[plain[3]], plain[6:8]],
                 logit_bias={plain[10]: -2.0, 28: 1.5}, min_new_tokens=20)
  out = mdjax.generate(smollm2, [prompt], max_new_tokens=24, logprobs=True, **options)
  theirs, scores = hf_generate(torch_model, prompt, 24, eos_token_id=eos, **options)
  assert out.sequences[0] != plain
  assert_same_greedy(out.sequences[0], theirs, torch_model, prompt)
  expected = [float(torch.log_softmax(s, -1)[t]) for s, t in zip(scores, theirs)]
  np.testing.assert_allclose(out.logprobs[0], expected[:len(out.logprobs[0])], atol=1e-4)
