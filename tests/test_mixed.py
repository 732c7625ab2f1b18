"""mixed: prompt lookup, heads of any family and a draft model in one trie, verified in
one pass. Greedy output == the target's greedy decoding (random tries, ragged rows, an
EOS inside an accepted chain, chains longer than the budget); sampled output follows
the target's law (chi-square); `auto` chooses per request and per step and row; a
source that cannot serve is an error naming it, or left out under `auto`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax.errors import MdjaxError
from mdjax.heads import vocab
from mdjax.strategies import mix_choice
from mdjax.strategies.trees import PAD, merge_chains
from tests.helpers import chi_square_p_value, random_model, strategy_heads, target_law
from tests.test_eagle3 import draft_heads as eagle3_heads
from tests.test_medusa import permutation_model_and_heads

PROMPTS = [[5, 6, 7, 5, 6, 7, 8, 9, 5, 6], [9, 10, 11, 9], [40, 41]]  # ragged, some repeats
NEW = 24


@pytest.fixture(scope="module")
def tiny():
  model = mdjax.load("random-llama-tiny")
  draft = random_model("llama", 5, vocab_size=model.config.vocab_size, layers=1, std=0.05)
  greedy = mdjax.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences
  return model, draft, strategy_heads(model), greedy


@pytest.fixture(scope="module")
def permutation():
  return permutation_model_and_heads()


# ------------------------------------------------------------------ the trie


def test_merge_chains_by_hand():
  """The docstring's trie: chains 0 and 1 share `a b`, chain 2's `f` is over budget;
  row 1: chain 2 is chain 0's first token (one node, credited to both)."""
  chains = [(jnp.array([[1, 2, 3], [1, 2, 3]]), jnp.array([3, 2])),
            (jnp.array([[1, 2, 4], [7, 2, 4]]), jnp.array([3, 3])),
            (jnp.array([[5, 6], [1, 2]]), jnp.array([2, 1]))]
  tree, node_of = jax.jit(merge_chains, static_argnums=1)(chains, 5)
  np.testing.assert_array_equal(tree.tokens, [[1, 2, 3, 4, 5], [1, 2, 7, 2, 4]])
  np.testing.assert_array_equal(tree.parent, [[-1, 0, 1, 1, -1], [-1, 0, -1, 2, 3]])
  np.testing.assert_array_equal(tree.depth, [[1, 2, 3, 3, 1], [1, 2, 1, 2, 3]])
  np.testing.assert_array_equal(node_of, [[[0, 1, 2], [0, 1, 3], [4, -1, -1]],
                                          [[0, 1, -1], [2, 3, 4], [0, -1, -1]]])
  short, _ = merge_chains([(jnp.array([[1, 2]]), jnp.array([1]))], 2)  # padding after
  np.testing.assert_array_equal(short.parent, [[-1, PAD]])
  np.testing.assert_array_equal(short.depth, [[1, 0]])


# ------------------------------------------------------------------ exact at temperature 0


@pytest.mark.parametrize("heads_family, options", [
    ("medusa", dict(tree_budget=6, prompt_lookup_num_tokens=4, num_draft_tokens=3)),  # over budget
    ("eagle3", dict(tree_budget=5, num_heads=3, prompt_lookup_num_tokens=3,
                    sources=["heads", "prompt_lookup"])),  # a sequential head first
    ("medusa", dict(prompt_lookup_num_tokens=3)),  # "auto"
])
def test_greedy_output_equals_the_target_greedy(tiny, heads_family, options):
  """Chains longer than an integer budget; a sequential head (EAGLE-3: three target
  layers, a draft vocabulary); or under "auto" (per step and row), heads whose profile
  says they pay, and a draft model of another vocabulary, left out."""
  model, draft, heads, greedy = tiny
  heads = heads.get(heads_family) or eagle3_heads(model, vocab.choose(
      np.bincount(np.concatenate(greedy), minlength=model.config.vocab_size) + 1e-3, 100))
  if options.get("tree_budget", "auto") == "auto":
    heads = mdjax.Heads(config=dataclasses.replace(heads.config, top_accuracy=((0.9,),) * 3),
                        params=heads.params)
    draft = random_model("llama", 2)  # 64 tokens
  out = mdjax.generate(model, PROMPTS, strategy="mixed", heads=heads, draft=draft,
                       max_new_tokens=NEW, eos_token_id=[], **options)
  assert out.sequences == greedy
  stats = out.stats
  if "tree_budget" not in options:
    assert stats["tree_choice"] == "mix" and stats["sources"] == ("prompt_lookup", "heads")
    assert "vocabulary (64 tokens)" in stats["left_out"]["draft"]
  assert stats["target_passes"] < NEW - 1 and stats["accepted"] > 0
  assert stats["accepted"] <= sum(stats[f"accepted_{s}"] for s in stats["sources"])  # shared:
  for source in stats["sources"]:  # credited to each
    assert 0 <= stats[f"accepted_{source}"] <= stats[f"drafted_{source}"]
  # an EOS mid-output (inside a draft or not): the same program, another EOS
  row, index = next((r, i) for r, s in enumerate(greedy) for i in range(4, NEW)
                    if s[i] not in s[:i])
  expected = mdjax.generate(model, PROMPTS, max_new_tokens=NEW,
                            eos_token_id=greedy[row][index]).sequences
  out = mdjax.generate(model, PROMPTS, strategy="mixed", heads=heads, draft=draft,
                       max_new_tokens=NEW, eos_token_id=greedy[row][index], **options)
  assert out.sequences == expected and len(expected[row]) == index + 1


def test_heads_that_know_the_future_get_every_token_credited(permutation):
  """Heads always right: every pass accepts their 3 tokens (a lookup chain agreeing with
  them shares their nodes), then an EOS inside the third pass's accepted block."""
  model, heads = permutation
  prompts = [[4, 5, 6, 7], [9, 10]]
  greedy = mdjax.generate(model, prompts, max_new_tokens=NEW, eos_token_id=[]).sequences
  options = dict(heads=heads, tree_budget=8, prompt_lookup_num_tokens=3)
  out = mdjax.generate(model, prompts, strategy="mixed", max_new_tokens=NEW, eos_token_id=[],
                       **options)
  assert out.sequences == greedy
  assert out.stats["accepted_heads"] == out.stats["accepted"] == out.stats["accepted_at"][0] * 3
  assert out.stats["target_passes"] == -(-(NEW - 1) // 4)
  eos = greedy[0][2]  # the second node of the first block (its permutation cycle is short)
  assert eos not in greedy[0][:2]
  out = mdjax.generate(model, prompts, strategy="mixed", max_new_tokens=NEW, eos_token_id=eos,
                       **options)
  expected = mdjax.generate(model, prompts, max_new_tokens=NEW, eos_token_id=eos).sequences
  assert out.sequences == expected and len(expected[0]) == 3


# ------------------------------------------------------------------ sampling


def test_sampling_follows_the_target_law(permutation):
  """3000 independent rows, heads right about the target's argmax, a random draft model
  and prompt lookup in one trie: the second and third tokens follow the target's
  sampling law (chi-square p > 1e-3, fails 1 in 1000)."""
  model, heads = permutation
  draft = random_model("llama", 3, layers=1)
  prompt, draws, options = [4, 5, 6, 7, 4, 5], 3000, dict(temperature=2.0, top_k=12)
  out = mdjax.generate(model, [prompt] * draws, strategy="mixed", heads=heads, draft=draft,
                       num_heads=2, num_draft_tokens=2, prompt_lookup_num_tokens=2,
                       tree_budget=5, max_new_tokens=3, eos_token_id=[], seed=3, **options)
  assert 0 < out.stats["accepted"] < out.stats["drafted"]
  assert out.stats["drafted_draft"] > 0 and out.stats["drafted_heads"] > 0
  for position in (1, 2):
    sample = [s[position] for s in out.sequences]
    assert chi_square_p_value(sample, target_law(model, prompt, position, options)) > 1e-3


# ------------------------------------------------------------------ auto


def test_lengths_are_chosen_per_row_from_what_each_source_had_accepted():
  """Two rows, lookup (free) and heads (0.1 t(1) a token), each extra column 0.1 t(1):
  a row whose lookup chains were always right gives lookup its whole cap and the heads
  nothing; a row whose lookup was always wrong, the reverse."""
  prior = jnp.array([[0.5] * 4, [0.8] * 4])
  tried = jnp.zeros((2, 2, 4), jnp.int32).at[:, 0].set(40)
  hits = jnp.zeros((2, 2, 4), jnp.int32).at[0, 0].set(40)
  accuracy = mix_choice.estimate(prior, tried, hits)
  cost = mix_choice.StepCost(width=tuple(1 + 0.1 * w for w in range(-1, 9)), fixed=0.0,
                             per_token=(0.0, 0.1))
  grid = mix_choice.length_grid((4, 4), 8)
  lengths = jax.jit(lambda a, n: mix_choice.choose_lengths(a, n, grid, cost))(
      accuracy, jnp.array([[4, 4], [4, 4]]))
  np.testing.assert_array_equal(lengths, [[4, 0], [0, 4]])
  steep = mix_choice.StepCost(width=(1.0, 1.0) + (50.0,) * 8, fixed=0.0, per_token=(0.0, 0.0))
  plain = mix_choice.request_choice(np.full((2, 4), 0.5), (4, 4), 8, steep,
                                    mix_choice.tree_choice.Batch())
  assert plain.plain and plain.tokens_per_pass == 1.0


def test_auto_falls_back_to_plain_decoding_when_no_mix_pays(tiny, monkeypatch):
  """Extra columns never pay: plain decoding (heads of another model left out, said
  why); prompt lookup alone with nothing to match: plain decoding, said why."""
  model, _, _, greedy = tiny
  foreign = strategy_heads(random_model("llama", 2))["medusa"]
  monkeypatch.setenv("MDJAX_PASS_COST", "1,8,16,32,64,128,256")
  out = mdjax.generate(model, PROMPTS, strategy="mixed", heads=foreign, max_new_tokens=NEW,
                       eos_token_id=[])
  assert out.sequences == greedy
  assert out.stats["tree_choice"] == "greedy" and out.stats["target_passes"] == NEW - 1
  assert "trained on" in out.stats["left_out"]["heads"]
  monkeypatch.undo()
  lonely = mdjax.generate(model, [[40 + i for i in range(len(p))] for p in PROMPTS],
                          strategy="mixed", max_new_tokens=NEW)  # the same plain program
  assert "nothing to match" in lonely.stats["left_out"]["prompt_lookup"]
  assert lonely.stats["tree_choice"] == "greedy"


# ------------------------------------------------------------------ bad input


def test_a_source_that_cannot_serve_is_named(tiny):
  model, draft, heads, _ = tiny
  other = random_model("llama", 2)  # another vocabulary (64) and hidden size
  foreign = strategy_heads(other)["medusa"]
  cases = [(dict(heads=foreign), "source 'heads' .* cannot serve .* trained on"),
           (dict(draft=other), r"source 'draft' .* cannot serve .* vocabulary \(64 tokens\)"),
           (dict(sources=["prompt_lookup"]), "source 'prompt_lookup' .* nothing to match"),
           (dict(sources=["heads"]), "source 'heads' .*needs heads="),
           (dict(sources="heads"), "sources must be a list"),
           (dict(sources=["ngram"]), "sources must be distinct names among"),
           (dict(heads=heads["medusa"], num_heads=9), r"num_heads \(9\) exceeds")]
  for options, match in cases:
    with pytest.raises(MdjaxError, match=match):
      mdjax.generate(model, [[40, 41, 42]], strategy="mixed", tree_budget=4, max_new_tokens=4,
                     **options)
