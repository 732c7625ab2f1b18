"""prompt_lookup: the proposal rule, the greedy acceptance rule, and exactness vs greedy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from tests.helpers import random_model
from mdjax.cache import KVCache
from mdjax.sampling import greedy_accept
from mdjax.step import decode_step
from mdjax.strategies.base import ModelFn
from mdjax.strategies.lookup import lookup_matches, propose_by_lookup
from mdjax.strategies.widths import chain_widths, decode_chains
from mdjax.topology import Topology


def test_lookup_matches_by_hand():
  history = jnp.asarray([[5, 6, 7, 5, 6, 9, 5, 6, 0, 0],    # "5 6" occurs at 0 and 3: latest 3
                         [1, 2, 3, 4, 0, 0, 0, 0, 0, 0],    # "4" never occurred before
                         [8, 8, 8, 0, 0, 0, 0, 0, 0, 0]])   # "8" at 1 (latest earlier), then 8
  length = jnp.asarray([8, 4, 3])
  proposal, count = lookup_matches(history, length, max_ngram_size=2, num_tokens=3)
  assert count[:, 0].tolist() == [3, 0, 1]
  assert proposal[0, 0].tolist() == [9, 5, 6]
  assert proposal[2, 0, 0] == 8
  proposal, count = lookup_matches(history, length, max_ngram_size=1, num_tokens=4)
  assert count[:, 0].tolist() == [3, 0, 1]  # row 0: "6" last seen at 4; only 3 tokens follow it
  assert proposal[0, 0].tolist()[:3] == [9, 5, 6]


def test_several_matches_are_distinct_longest_then_latest():
  """Row 0: "5 6" is followed by `9 5 6` (latest), then `7 5 6`; "6" alone by `1 5 6`.
  Row 1: both occurrences of "5 6" continue `9 5 6`: one match."""
  history = jnp.asarray([[6, 1, 5, 6, 7, 5, 6, 9, 5, 6], [5, 6, 9, 5, 6, 9, 5, 6, 0, 0]])
  proposal, count = lookup_matches(history, jnp.asarray([10, 8]), max_ngram_size=2,
                                   num_tokens=3, num_matches=4)
  assert count.tolist() == [[3, 3, 3, 0], [3, 0, 0, 0]]
  assert proposal[0, :3].tolist() == [[9, 5, 6], [7, 5, 6], [1, 5, 6]]
  assert proposal[1, 0].tolist() == [9, 5, 6]


def test_proposal_never_reaches_past_the_text():
  history = jnp.asarray([[3, 4, 3, 4, 3, 0, 0, 0]])
  proposal, count = propose_by_lookup(history, jnp.asarray([5]), max_ngram_size=3, num_tokens=6)
  # last 3 tokens "3 4 3" occur at 0, followed by "4 3": only 2 real tokens
  assert count.tolist() == [2] and proposal[0, :2].tolist() == [4, 3]


def test_greedy_accept_by_hand():
  proposal = jnp.asarray([[4, 5, 6], [4, 5, 6], [4, 5, 6], [9, 9, 9]])
  count = jnp.asarray([3, 3, 1, 0])
  choice = jnp.asarray([[4, 5, 6, 7], [4, 0, 6, 7], [4, 5, 6, 7], [9, 9, 9, 9]])
  assert greedy_accept(proposal, count, choice).tolist() == [3, 1, 1, 0]


@pytest.fixture(scope="module")
def models():
  return [mdjax.load("random-llama-tiny", dtype="float32"), random_model("qwen3", seed=4, std=0.02)]


@pytest.mark.parametrize("options", [dict(), dict(prompt_lookup_num_tokens=3, max_ngram_size=1),
                                     dict(prompt_lookup_num_tokens=7, max_ngram_size=4)])
def test_prompt_lookup_equals_greedy(models, options):
  rng = np.random.default_rng(0)
  for model in models:
    vocab = model.config.vocab_size
    motif = rng.integers(3, vocab, 5).tolist()
    prompts = [motif * 3 + [7], rng.integers(3, vocab, 9).tolist(), motif[:2]]
    greedy = mdjax.generate(model, prompts, max_new_tokens=37, eos_token_id=[])
    lookup = mdjax.generate(model, prompts, strategy="prompt_lookup", max_new_tokens=37,
                            eos_token_id=[], **options)
    assert lookup.sequences == greedy.sequences
    assert lookup.stats["target_passes"] <= greedy.stats["target_passes"]
    assert 0 <= lookup.stats["accepted"] <= lookup.stats["drafted"]


def test_prompt_lookup_stops_at_eos_inside_an_accepted_block(models):
  model = models[0]
  prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12]]
  free = mdjax.generate(model, prompts, max_new_tokens=30, eos_token_id=[]).sequences
  for eos in {free[0][5], free[1][3]}:
    greedy = mdjax.generate(model, prompts, max_new_tokens=30, eos_token_id=eos)
    lookup = mdjax.generate(model, prompts, strategy="prompt_lookup", max_new_tokens=30,
                            eos_token_id=eos)
    assert lookup.sequences == greedy.sequences


def test_prompt_lookup_saves_passes_on_repetitive_text(models):
  """Random models fall into loops; copying them is what prompt lookup is for."""
  model = models[0]
  prompt = [4, 5, 6]
  greedy = mdjax.generate(model, prompt, max_new_tokens=64, eos_token_id=[])
  seq = greedy.sequences[0]
  assert len(set(seq[-20:])) < 10, "the test expects the random model to loop"
  lookup = mdjax.generate(model, prompt, strategy="prompt_lookup", max_new_tokens=64,
                          eos_token_id=[])
  assert lookup.sequences == greedy.sequences
  assert lookup.stats["target_passes"] * 2 <= greedy.stats["target_passes"]


def test_decode_chains_feeds_only_the_longest_prefix_and_matches_the_full_pass(models):
  """Chains of 6 columns whose scored prefixes are at most 3 long: the pass runs on 3
  columns, with the logits and cache a full-width `decode_step` gives."""
  model = models[1]
  cfg, params = model.config, model.params
  rng = np.random.default_rng(2)
  prompt = jnp.asarray(rng.integers(3, 64, (2, 5)), jnp.int32)
  topology = Topology(parent=jnp.full((2, 1), -1, jnp.int32), fork=jnp.zeros((2, 1), jnp.int32))
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  _, _, cache = decode_step(params, KVCache.create(cfg, 2, 32), prompt, positions,
                            jnp.zeros((2, 5), jnp.int32), topology, config=cfg)
  tokens = jnp.asarray(rng.integers(3, 64, (2, 1, 6)), jnp.int32)
  chain_positions = (5 + jnp.arange(6))[None, None, :].repeat(2, axis=0)
  scored = jnp.asarray([[3], [1]])  # prefixes: 3 tokens in row 0, 1 in row 1
  segments = jnp.where(jnp.arange(6)[None, None, :] < scored[..., None], 0, -1)
  spare = jax.tree.map(jnp.copy, cache)  # decode_step donates its cache
  full_logits, _, full_cache = decode_step(params, spare, tokens[:, 0], chain_positions[:, 0],
                                           segments[:, 0], topology, config=cfg)
  logits, narrow_cache, fed = decode_chains(ModelFn(config=cfg, attention="block_sparse"), params,
                                            cache, tokens, chain_positions, segments, topology)
  assert chain_widths(6) == (6, 3, 1) and int(fed) == 3
  np.testing.assert_allclose(logits[:, 0, :3], full_logits[:, :3], atol=1e-5)
  assert not np.asarray(logits[:, 0, 3:]).any()  # never fed
  np.testing.assert_array_equal(narrow_cache.length, full_cache.length)
  np.testing.assert_allclose(narrow_cache.k, full_cache.k, atol=1e-5)


def test_passes_without_a_match_feed_one_column(models):
  model = models[0]
  out = mdjax.generate(model, [5], strategy="prompt_lookup", max_new_tokens=6, eos_token_id=[],
                       prompt_lookup_num_tokens=8)
  assert out.sequences[0][0] != 5, "the test needs a first token that the prompt lacks"
  # the first pass looks the first token up in [5]: no match, one column instead of 9
  assert out.stats["columns_fed"] <= (out.stats["target_passes"] - 1) * 9 + 1, out.stats
  assert out.sequences == mdjax.generate(model, [5], max_new_tokens=6, eos_token_id=[]).sequences


@pytest.mark.parametrize("option,value", [("prompt_lookup_num_tokens", 0),
                                          ("max_ngram_size", 0), ("max_ngram_size", 1.5)])
def test_bad_options_name_the_value(models, option, value):
  with pytest.raises(mdjax.MdjaxError, match=f"{option} must be an integer >= 1, got {value}"):
    mdjax.generate(models[0], [1, 2], strategy="prompt_lookup", **{option: value})


@pytest.mark.parametrize("model_index", [0, 1])
def test_prompt_lookup_inside_every_branch_equals_multi_question(models, model_index):
  """multi_question's answers (== greedy per question) with prompt lookup in each branch:
  ragged question counts, proposals found in the context and in each answer."""
  model = models[model_index]
  contexts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10]]
  questions = [[[7, 8], [5], [6, 7, 8, 5]], [[11, 9]]]
  kwargs = dict(questions=questions, max_new_tokens=24, eos_token_id=[])
  plain = mdjax.generate(model, contexts, strategy="multi_question", **kwargs)
  looked = mdjax.generate(model, contexts, strategy="prompt_lookup", prompt_lookup_num_tokens=4,
                          **kwargs)
  assert looked.sequences == plain.sequences
  assert looked.stats["accepted"] > 0
  assert looked.stats["target_passes"] < plain.stats["target_passes"]
