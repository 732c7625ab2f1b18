"""The controls (`mdjax.controls`) inside the greedy drafters' drafts: `prompt_lookup`,
`lookahead` and `jacobi` give greedy's tokens with the same controls where a draft
completes a stop string, brings EOS before `min_new_tokens` or repeats a banned n-gram
(on `cycle_model`, whose drafts are accepted: the rule must cut them); and
`entropy_branching` scores its branches with the processed distribution along each
branch's own text (against transformers' processors)."""

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import mdjax
from tests.helpers import cycle_model, torch_logits, write_tiny_checkpoint

DRAFTERS = {"prompt_lookup": dict(prompt_lookup_num_tokens=6, max_ngram_size=2),
            "lookahead": dict(window=3, ngram=3, guess_set=2),
            "jacobi": dict(window=4)}
CYCLE_PROMPT = list(range(3, 19))  # the whole cycle: the model continues 3, 4, 5, ...


def char(token: int) -> str:
  return chr(0x4E00 + token)  # one CJK character per token: a string is its tokens


@pytest.fixture(scope="module")
def cycle():
  """`cycle_model` with a word-level tokenizer whose token t is the one character
  `char(t)` (0: the decoder's prefix, 1: unknown), so that it takes stop strings."""
  model = cycle_model()
  words = {"abcdef": 0, "[UNK]": 1} | {f"##{char(t)}": t for t in range(2, model.config.vocab_size)}
  backend = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
  backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  backend.decoder = decoders.WordPiece(cleanup=False)
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
  return dataclasses.replace(model, tokenizer=tokenizer)


def generate(model, prompt, strategy, max_new_tokens=16, **options):
  return mdjax.generate(model, [prompt], strategy=strategy, max_new_tokens=max_new_tokens,
                        **options, **DRAFTERS.get(strategy, {}))


# The stop-string and min_new_tokens tests below set the same controls (a test's own at
# work, the other's inert: min_new_tokens=0, strings never written) on prompts of the
# same bucket, so that each strategy compiles one program for both.
STOP_PROMPT = list(range(3, 17)) + [3, 4]  # 16 tokens, as `CYCLE_PROMPT`
STOP_STRINGS = [char(8) + char(9), char(99)]
NEVER_WRITTEN = [char(99), char(98)]


@pytest.mark.parametrize("strategy", sorted(DRAFTERS))
def test_a_draft_that_completes_a_stop_string_ends_there(cycle, strategy):
  """The prompt ends `3 4`, as it begins: lookup drafts `5 .. 10` at once (the windows
  guess the cycle too); the stop string `8 9` cuts the row after 9, as greedy's."""
  options = dict(eos_token_id=[], stop_strings=STOP_STRINGS, min_new_tokens=0, logprobs=True)
  greedy = generate(cycle, STOP_PROMPT, "greedy", **options)
  assert greedy.sequences == [[5, 6, 7, 8, 9]]
  ours = generate(cycle, STOP_PROMPT, strategy, **options)
  assert ours.sequences == greedy.sequences
  np.testing.assert_allclose(ours.logprobs[0], greedy.logprobs[0], atol=1e-4)
  assert ours.stats["stopped_by"] == [STOP_STRINGS[0]]
  if strategy == "prompt_lookup":  # the first draft held the string, and went past it
    assert ours.stats["target_passes"] == 1 and ours.stats["drafted"] == 6


@pytest.mark.parametrize("strategy", sorted(DRAFTERS))
def test_min_new_tokens_holds_eos_back_inside_drafts(cycle, strategy):
  """EOS 6 is greedy's 4th token after the cycle, and every drafter's first pass holds
  the 3 tokens before it (lookup copies `4 5 6 ..` from the prompt's start, the window
  guesses `4 5`): with min_new_tokens=8 the target refuses EOS inside the draft, for
  greedy's longer tokens; with 3 it takes it, 3 tokens being generated before it (2 of
  them drafted in the same pass). Greedy's log-probabilities too."""
  plain = generate(cycle, CYCLE_PROMPT, "greedy", eos_token_id=6)
  assert plain.sequences == [[3, 4, 5, 6]]
  for minimum in (8, 3):
    options = dict(eos_token_id=6, min_new_tokens=minimum, stop_strings=NEVER_WRITTEN,
                   logprobs=True)
    greedy = generate(cycle, CYCLE_PROMPT, "greedy", **options)
    ours = generate(cycle, CYCLE_PROMPT, strategy, **options)
    assert ours.sequences == greedy.sequences, minimum
    np.testing.assert_allclose(ours.logprobs[0], greedy.logprobs[0], atol=1e-4)
    assert np.isfinite(ours.logprobs[0]).all()
    assert ours.stats["stopped_by"] == [None]
    if minimum == 8:
      assert len(ours.sequences[0]) > 8 and 6 not in ours.sequences[0][:8]
    else:
      assert ours.sequences == plain.sequences and ours.stats["target_passes"] == 1


def test_lookup_never_accepts_the_repetition_it_drafts(cycle):
  """The prompt is the cycle twice: lookup drafts its continuation (`3 4 5 ..` after
  `17 18`), every bigram of which the text already holds. With no_repeat_ngram_size=2
  the target rejects them: greedy's tokens, and no generated bigram repeats one before."""
  prompt = CYCLE_PROMPT * 2
  options = dict(eos_token_id=[], no_repeat_ngram_size=2, logprobs=True)
  greedy = generate(cycle, prompt, "greedy", **options)
  ours = generate(cycle, prompt, "prompt_lookup", **options)
  assert ours.sequences == greedy.sequences
  np.testing.assert_allclose(ours.logprobs[0], greedy.logprobs[0], atol=1e-4)
  text = prompt + ours.sequences[0]
  bigrams = list(zip(text, text[1:]))
  for i in range(len(prompt) - 1, len(bigrams)):
    assert bigrams[i] not in bigrams[:i], f"generated token {i - len(prompt) + 1} repeats"
  assert ours.stats["drafted"] > ours.stats["accepted"]  # drafts were cut
  unbanned = generate(cycle, prompt, "prompt_lookup", eos_token_id=[])
  assert unbanned.sequences[0][:4] == [3, 4, 5, 6]  # what lookup drafted: the repetition


def test_lookahead_processes_each_pool_candidate_along_its_own_guesses(cycle):
  """From `3 4` the model writes the cycle, from the pool's n-grams as often as not; at
  the wrap, no_repeat_ngram_size=2 bans `4` after `3` and the text wanders, banning
  whatever follows a repeated token: each candidate's column must see the text and the
  candidate's own guesses before it to ban what greedy bans."""
  options = dict(eos_token_id=[], no_repeat_ngram_size=2, max_new_tokens=32)
  greedy = generate(cycle, [3, 4], "greedy", **options)
  ours = generate(cycle, [3, 4], "lookahead", **options)
  assert ours.sequences == greedy.sequences
  assert greedy.sequences[0][13:15] == [18, 3] and greedy.sequences[0][15] != 4
  assert ours.stats["accepted_from_pool"] > 0


# ------------------------------------------------------------------ entropy_branching

PROMPTS = [[5, 9, 14, 9, 5, 30, 31], [7, 8, 7, 8]]
EOS = 2
CONTROLLED = dict(repetition_penalty=1.6, no_repeat_ngram_size=2, bad_words_ids=[[40], [12, 13]],
                  min_new_tokens=5, logit_bias={30: 1.5})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny")
  torch_model = write_tiny_checkpoint(path, seed=5)
  return mdjax.load(str(path), dtype="float32"), torch_model


def processed_logprobs(torch_model, prompt, tokens) -> list[torch.Tensor]:
  """transformers' processors of `CONTROLLED` (mdjax's order) on each prefix of
  `tokens`: the log-probabilities each token was drawn from, [V] each."""
  processors = transformers.LogitsProcessorList([
      transformers.SequenceBiasLogitsProcessor({(30,): 1.5}),
      transformers.RepetitionPenaltyLogitsProcessor(1.6),
      transformers.NoRepeatNGramLogitsProcessor(2),
      transformers.NoBadWordsLogitsProcessor([[40], [12, 13]]),
      transformers.MinNewTokensLengthLogitsProcessor(len(prompt), 5, EOS)])
  logits = torch.tensor(torch_logits(torch_model, prompt + tokens))
  return [torch.log_softmax(processors(torch.tensor([prompt + tokens[:i]]),
                                       logits[len(prompt) - 1 + i][None].clone()), -1)[0]
          for i in range(len(tokens))]


def test_entropy_branching_without_a_fork_is_greedy_under_the_controls(tiny):
  model, _ = tiny
  options = dict(CONTROLLED, max_new_tokens=16, eos_token_id=EOS, logprobs=True)
  greedy = mdjax.generate(model, PROMPTS, **options)
  ours = mdjax.generate(model, PROMPTS, strategy="entropy_branching", branch_entropy=100.0,
                        **options)
  assert ours.sequences == greedy.sequences and ours.stats["forks"] == 0
  for a, b in zip(ours.logprobs, greedy.logprobs):
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_entropy_branches_read_the_processed_law_along_their_own_text(tiny):
  """Forking wherever it can, every emitted token (a linear one, or a kept branch's)
  has the log-probability and the 2 best tokens of transformers' processed scores on
  its own prefix: each branch was processed with the text and its own tokens, and the
  entropy of a law with removed (-inf) tokens is a number (forks happen)."""
  model, torch_model = tiny
  out = mdjax.generate(model, PROMPTS, strategy="entropy_branching", num_branches=2,
                       branch_tokens=3, branch_entropy=0.0, max_new_tokens=16, eos_token_id=EOS,
                       top_logprobs=2, **CONTROLLED)
  assert out.stats["forks"] >= 4
  for prompt, tokens, logprobs, best in zip(PROMPTS, out.sequences, out.logprobs,
                                            out.top_logprobs):
    assert len(tokens) > 5
    expected = processed_logprobs(torch_model, prompt, tokens)
    np.testing.assert_allclose(logprobs, [float(e[t]) for e, t in zip(expected, tokens)],
                               atol=1e-4)
    assert np.isfinite(logprobs).all()
    for pairs, e in zip(best, expected):
      assert [i for i, _ in pairs] == torch.topk(e, 2).indices.tolist()
