"""Draft vocabularies (`mdjax.heads.vocab`): the choice and the maps, Medusa heads that
score only some tokens (their own unembedding cut, or the model's columns gathered per
request) decode exactly greedy and sample the target's law, and the trainer picks,
trains and ships one. EAGLE-3's are tested in test_eagle3.py."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from configs import heads_tiny_test
from mdjax.errors import MdjaxError
from mdjax.heads import Heads, vocab
from mdjax.train import heads as heads_lib
from tests.helpers import (chi_square_p_value, cycle_model, random_medusa_heads, target_law,
                           write_cycle_prompts)
from tests.test_medusa import permutation_model_and_heads

PROMPTS = [list(range(3, 19)), [9, 10, 11, 12, 13]]  # ragged
NEW = 40


def test_choose_keeps_the_most_frequent_ids_ascending():
  counts = np.array([5, 0, 9, 9, 1, 7])
  assert vocab.choose(counts, 3).tolist() == [2, 3, 5]
  assert vocab.choose(counts, 0).tolist() == list(range(6))
  ids = vocab.choose(counts, 4)
  assert vocab.from_offsets(vocab.to_offsets(ids)).tolist() == ids.tolist()
  assert vocab.target_mask(ids, 6).tolist() == [True, False, True, True, False, True]
  assert vocab.coverage(ids, [0, 1, 2, 2]) == 0.75
  column = vocab.column_of(jnp.asarray(ids), 6)
  assert column.tolist() == [0, -1, 1, 2, -1, 3]


@pytest.mark.parametrize("ids,match", [
    ([3, 70], "maps to token id 70, outside the model's vocabulary of 64 tokens"),
    ([3, 3], "strictly ascending"), ([], "non-empty")])
def test_bad_draft_vocabularies_are_named(ids, match):
  with pytest.raises(MdjaxError, match=match):
    vocab.check(np.asarray(ids, np.int32), 64)


def cut(heads: Heads, draft_ids) -> Heads:
  """`heads` scoring only `draft_ids`: their own unembedding's columns, or the ids alone
  (shared unembedding: the strategy gathers the model's columns)."""
  ids = jnp.asarray(np.asarray(draft_ids, np.int32))
  params = dict(heads.params, draft_ids=ids)
  if "lm_head" in params:
    params["lm_head"] = jnp.take(params["lm_head"], ids, axis=-1)
  config = heads.config.__class__(**{**heads.config.to_json(), "draft_vocab_size": len(ids)})
  return Heads(config=config, params=params)


@pytest.fixture(scope="module")
def permutation():
  return permutation_model_and_heads()


@pytest.mark.parametrize("strategy", ["medusa", "blockwise"])
def test_heads_knowing_the_future_accept_every_drafted_node(permutation, strategy):
  """A draft vocabulary holding every token greedy writes: each verify accepts the
  whole depth (3), as with the full vocabulary."""
  model, heads = permutation
  greedy = mdjax.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences
  written = np.unique(np.concatenate(greedy + PROMPTS))
  run = lambda h: mdjax.generate(model, PROMPTS, strategy=strategy, heads=h, max_new_tokens=NEW,
                                 eos_token_id=[])
  out, full = run(cut(heads, written)), run(heads)
  assert out.sequences == greedy
  assert out.stats["accepted_at"] == full.stats["accepted_at"]
  assert out.stats["accepted"] == 3 * len(PROMPTS) * out.stats["target_passes"]


def test_greedy_tokens_outside_the_draft_vocabulary_still_decode_exactly(permutation):
  """Half of the tokens greedy writes are left out: they are never drafted, fewer
  nodes are accepted, the output is greedy's; EOS inside a block too."""
  model, heads = permutation
  greedy = mdjax.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences
  written = np.unique(np.concatenate(greedy))
  kept = np.setdiff1d(np.arange(model.config.vocab_size), written[::2])
  out = mdjax.generate(model, PROMPTS, strategy="medusa", heads=cut(heads, kept),
                       max_new_tokens=NEW, eos_token_id=[])
  assert out.sequences == greedy and 0 < out.stats["accepted"] < 2 * 30 * 3
  eos = greedy[0][9]
  stopped = mdjax.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[eos]).sequences
  out = mdjax.generate(model, PROMPTS, strategy="medusa", heads=cut(heads, kept),
                       max_new_tokens=NEW, eos_token_id=[eos])
  assert out.sequences == stopped


def test_shared_unembedding_columns_in_every_branch_equal_multi_question():
  """Heads sharing the model's unembedding read its draft columns; ragged questions."""
  tiny = mdjax.load("random-llama-tiny")
  heads = cut(random_medusa_heads(tiny, seed=2), np.arange(0, 256, 3))
  contexts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10]]
  kwargs = dict(questions=[[[7, 8], [5], [6, 7, 8, 5]], [[11, 9]]], max_new_tokens=24,
                eos_token_id=[])
  plain = mdjax.generate(tiny, contexts, strategy="multi_question", **kwargs)
  out = mdjax.generate(tiny, contexts, strategy="medusa", heads=heads, tree_budget=8, **kwargs)
  assert out.sequences == plain.sequences


def test_sampling_with_a_draft_vocabulary_follows_the_target_law(permutation):
  """3000 rows: tokens 2 and 3 follow the target's law (chi-square p > 1e-3) with
  heads scoring half of the ids, acceptances and rejections at both depths."""
  model, heads = permutation
  prompt, draws, options = [4, 5, 6, 7], 3000, dict(temperature=2.0, top_k=12)
  out = mdjax.generate(model, [prompt] * draws, strategy="medusa",
                       heads=cut(heads, np.arange(1, model.config.vocab_size, 2)),
                       tree=((0,), (1,), (0, 0), (1, 0)), max_new_tokens=3, eos_token_id=[],
                       seed=3, **options)
  accepted = out.stats["accepted_at"]
  assert 0 < accepted[1] < accepted[0]
  for position in (1, 2):
    sample = [s[position] for s in out.sequences]
    assert chi_square_p_value(sample, target_law(model, prompt, position, options)) > 1e-3


@pytest.mark.parametrize("own", [False, True])
def test_trained_medusa_heads_ship_their_draft_vocabulary(tmp_path, own):
  """On the synthetic base, 20 draft ids hold the 16-id cycle: the heads learn it, the
  export carries the ids and the card their held-out coverage."""
  config = heads_tiny_test.get_config()
  config.data.prompts = str(write_cycle_prompts(tmp_path / "prompts.jsonl", 40))
  config.update(run_dir=str(tmp_path / "run"), own_unembedding=own, draft_vocab_size=20, loss="ce")
  run = heads_lib.train(config, model=cycle_model(), progress=False)
  assert min(run.heldout["heldout_top1"]) > 0.9
  heads = mdjax.load_heads(run.export_dir)
  ids = np.asarray(heads.params["draft_ids"])
  assert len(ids) == 20 and set(range(3, 19)) <= set(ids.tolist())
  assert heads.config.draft_vocab_size == 20 and "100.0%" in heads.card
  if own:
    assert heads.params["lm_head"].shape[-1] == 20
  record = json.loads((tmp_path / "run" / "config.json").read_text())
  assert record["draft_vocab_size"] == 20


def test_a_family_without_a_draft_vocabulary_refuses_one(tmp_path):
  config = heads_tiny_test.get_config()
  config.update(run_dir=str(tmp_path), family="mtp", num_heads=2, draft_vocab_size=16)
  with pytest.raises(MdjaxError, match="config.draft_vocab_size: mtp heads score the whole "
                                       "vocabulary"):
    heads_lib.validate(config)
