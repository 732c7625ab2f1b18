"""mixed: prompt lookup (several matches), heads of any family (their trees) and a draft
model in one trie, verified in one pass. Greedy output == the target's greedy decoding
(random tries with siblings, ragged rows, an EOS inside an accepted path, trees larger
than the budget); sampled output follows the target's law (chi-square); `auto` chooses
the heads' tree as their own strategy would, and per step and row how many nodes each
source gives; a source that cannot serve is an error naming it, or left out under
`auto`."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax.errors import MdjaxError
from mdjax.heads import vocab
from mdjax import strategies
from mdjax.strategies import mix_choice, trees
from mdjax.strategies.mix_sources import PromptLookup
from mdjax.strategies.trees import PAD, Tree, merge_trees
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


def test_merge_trees_by_hand():
  """The docstring's trie (row 0): source 1's `a b` joins source 0's, its `d` and `a e`
  are new, source 2's `e f` are over the budget. Row 1: source 0 gives only its first
  node, source 2's `a` joins it but its `b` is cut. Row 2: source 1 holds `a b` twice
  (one node), source 2 gives nothing new, source 0 nothing at all."""
  chain = lambda tokens, count: trees.chain(jnp.array(tokens), jnp.array(count))
  tree = Tree(tokens=jnp.array([[1, 2, 4, 5], [7, 2, 4, 5], [1, 2, 4, 2]]),
              parent=jnp.array([[-1, 0, 1, 0]] * 3), depth=jnp.array([[1, 2, 3, 2]] * 3))
  proposals = [chain([[1, 2, 3], [1, 2, 3], [9, 9, 9]], [3, 3, 3]), tree,
               chain([[5, 6], [1, 2], [1, 2]], [2, 2, 2])]
  used = [jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool), jnp.ones((3, 4), bool),
          jnp.ones((3, 2), bool)]
  merged, node_of = jax.jit(merge_trees, static_argnums=(2, 3))(proposals, used, 5, 3)
  np.testing.assert_array_equal(merged.tokens[:2], [[1, 2, 3, 4, 5], [1, 7, 2, 4, 5]])
  np.testing.assert_array_equal(merged.tokens[2, :3], [1, 2, 4])
  np.testing.assert_array_equal(merged.parent, [[-1, 0, 1, 1, 0], [-1, -1, 1, 2, 1],
                                                [-1, 0, 1, PAD, PAD]])
  np.testing.assert_array_equal(merged.depth, [[1, 2, 3, 3, 2], [1, 1, 2, 3, 2],
                                               [1, 2, 3, 0, 0]])
  np.testing.assert_array_equal(node_of[0], [[0, 1, 2], [0, -1, -1], [-1, -1, -1]])
  np.testing.assert_array_equal(node_of[1], [[0, 1, 3, 4], [1, 2, 3, 4], [0, 1, 2, 1]])
  np.testing.assert_array_equal(node_of[2], [[-1, -1], [0, -1], [0, 1]])


def test_prompt_lookup_proposes_its_matches_as_siblings():
  """`5 6` is followed by `9 5` (latest), then `7 5`; `6` alone adds `1 5`: three chains,
  siblings under `c`, parents inside each chain; a row with no match proposes nothing."""
  history = jnp.array([[6, 1, 5, 6, 7, 5, 6, 9, 5, 6], [1, 2, 3, 0, 0, 0, 0, 0, 0, 0]])
  state = types.SimpleNamespace(history=history, length=jnp.array([10, 3]))
  source = PromptLookup(cap=2, max_ngram_size=2, matches=3)
  tree, _, _ = source.propose(None, state, None, None)
  np.testing.assert_array_equal(source.available(state), [6, 0])
  np.testing.assert_array_equal(tree.tokens[0], [9, 5, 7, 5, 1, 5])
  np.testing.assert_array_equal(tree.parent[0], [-1, 0, -1, 2, -1, 4])
  np.testing.assert_array_equal(tree.depth, [[1, 2, 1, 2, 1, 2], [0] * 6])


def test_the_heads_propose_their_own_trees(tiny):
  """An integer budget: parallel heads' best tree of that many nodes (siblings from their
  second guesses), best node first; a sequential head's EAGLE-2 tree."""
  model, _, heads, _ = tiny
  mixed = strategies.get("mixed")
  medusa, _ = mixed.build(model, dict(heads=heads["medusa"], tree_budget=6))
  assert len(medusa.heads_tree) == 6 and (0,) in medusa.heads_tree and (1,) in medusa.heads_tree
  assert medusa.heads_tree[0] == (0,) and medusa.chains[1].size == 6
  eagle, _ = mixed.build(model, dict(heads=heads["eagle"], tree_budget=9, num_heads=3))
  assert eagle.heads_tree == (3, 4, 9) and eagle.chains[1].depth == 3


# ------------------------------------------------------------------ exact at temperature 0


@pytest.mark.parametrize("heads_family, options", [
    ("medusa", dict(tree_budget=6, prompt_lookup_num_tokens=4, num_draft_tokens=3)),  # over budget
    ("eagle3", dict(tree_budget=5, num_heads=3, prompt_lookup_num_tokens=3,
                    sources=["heads", "prompt_lookup"])),  # a sequential head first
    ("mtp", dict(tree_budget=40, prompt_lookup_num_tokens=3, prompt_lookup_num_matches=4,
                 num_draft_tokens=2)),  # every source's whole tree
    ("medusa", dict(prompt_lookup_num_tokens=3)),  # "auto"
    ("eagle", dict(prompt_lookup_num_tokens=3, prompt_lookup_num_matches=2)),  # "auto"
])
def test_greedy_output_equals_the_target_greedy(tiny, heads_family, options):
  """Trees larger than an integer budget; a sequential head (EAGLE-3: three target
  layers, a draft vocabulary); every source's whole tree; or under "auto" (per step and
  row), heads whose own `auto` tree is kept, and a draft model of another vocabulary,
  left out."""
  model, draft, heads, greedy = tiny
  heads = heads.get(heads_family) or eagle3_heads(model, vocab.choose(
      np.bincount(np.concatenate(greedy), minlength=model.config.vocab_size) + 1e-3, 100))
  auto = options.get("tree_budget", "auto") == "auto"
  if auto:
    if heads_family == "medusa":
      heads = mdjax.Heads(config=dataclasses.replace(heads.config, top_accuracy=((0.9, 0.95),) * 3),
                          params=heads.params)
    draft = random_model("llama", 2)  # 64 tokens
  out = mdjax.generate(model, PROMPTS, strategy="mixed", heads=heads, draft=draft,
                       max_new_tokens=NEW, eos_token_id=[], **options)
  assert out.sequences == greedy
  stats = out.stats
  if auto:  # the heads' tree is the one their own strategy's `auto` chooses
    assert stats["tree_choice"] == "mix" and stats["sources"] == ("prompt_lookup", "heads")
    assert "vocabulary (64 tokens)" in stats["left_out"]["draft"]
    own = mdjax.generate(model, PROMPTS, strategy=heads_family, heads=heads,
                         max_new_tokens=NEW, eos_token_id=[]).stats
    assert own["tree_choice"] == "tree" and stats["heads_tree_budget"] == own["tree_budget"]
    assert stats["heads_tree_budget"] > stats["heads_tree_depth"]  # siblings
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
  them shares their nodes), each marked drafted in the metadata, then an EOS inside the
  third pass's accepted block."""
  model, heads = permutation
  prompts = [[4, 5, 6, 7], [9, 10]]
  greedy = mdjax.generate(model, prompts, max_new_tokens=NEW, eos_token_id=[]).sequences
  options = dict(heads=heads, tree_budget=16, prompt_lookup_num_tokens=3)
  out = mdjax.generate(model, prompts, strategy="mixed", max_new_tokens=NEW, eos_token_id=[],
                       return_metadata=True, **options)
  assert out.sequences == greedy
  assert out.stats["accepted_heads"] == out.stats["accepted"] == out.stats["accepted_at"][0] * 3
  # metadata keeps the verify's logits (greedy without it reads only their argmax)
  assert sum(sum(m["drafted"]) for m in out.metadata) == out.stats["accepted"]
  assert out.stats["target_passes"] == -(-(NEW - 1) // 4)
  eos = greedy[0][2]  # the second node of the first block (its permutation cycle is short)
  assert eos not in greedy[0][:2]
  out = mdjax.generate(model, prompts, strategy="mixed", max_new_tokens=NEW, eos_token_id=eos,
                       **options)
  expected = mdjax.generate(model, prompts, max_new_tokens=NEW, eos_token_id=eos).sequences
  assert out.sequences == expected and len(expected[0]) == 3


# ------------------------------------------------------------------ sampling


def test_sampling_follows_the_target_law(permutation):
  """3000 independent rows, heads right about the target's argmax (their tree's second
  guesses wrong), a random draft model and prompt lookup in one trie: the second and
  third tokens follow the target's sampling law (chi-square p > 1e-3, fails 1 in 1000)."""
  model, heads = permutation
  draft = random_model("llama", 3, layers=1)
  prompt, draws, options = [4, 5, 6, 7, 4, 5], 3000, dict(temperature=2.0, top_k=12)
  out = mdjax.generate(model, [prompt] * draws, strategy="mixed", heads=heads, draft=draft,
                       num_heads=2, num_draft_tokens=2, prompt_lookup_num_tokens=2,
                       prompt_lookup_num_matches=2, sources=["draft", "prompt_lookup", "heads"],
                       tree_budget=12, max_new_tokens=3, eos_token_id=[], seed=3, **options)
  assert 0 < out.stats["accepted"] < out.stats["drafted"]
  assert out.stats["drafted_draft"] > 0 and out.stats["drafted_heads"] > 0
  assert out.stats["drafted_at"][0] >= 2 * draws  # siblings under `c` in every verify
  for position in (1, 2):
    sample = [s[position] for s in out.sequences]
    assert chi_square_p_value(sample, target_law(model, prompt, position, options)) > 1e-3


# ------------------------------------------------------------------ auto


def test_counts_are_chosen_per_row_from_what_each_source_had_accepted():
  """Two rows, lookup (free, one match of 4) and a chain of 4 heads (0.1 t(1) a node),
  each extra column 0.1 t(1): a row whose lookup was always right gives lookup its whole
  match and the heads nothing; a row whose lookup was always wrong, the reverse."""
  tables = [mix_choice.matches_table(1, 4, 4), mix_choice.chain_table([0.8] * 4, 4, 4)]
  expected = jnp.zeros((2, 2, 4)).at[:, 0].set(40 * 0.5)  # 40 first tokens tried, at 0.5
  hits = jnp.zeros((2, 2, 4), jnp.int32).at[0, 0].set(40)
  correction = mix_choice.factor(expected, hits)
  cost = mix_choice.StepCost(width=tuple(1 + 0.1 * w for w in range(-1, 9)), fixed=0.0,
                             per_token=(0.0, 0.1))
  grid = mix_choice.count_grid((4, 4), 8)
  counts = jax.jit(lambda f, n: mix_choice.choose_counts(mix_choice.stacked(tables), f, n, grid,
                                                         cost))(correction, jnp.array([[4, 4]] * 2))
  np.testing.assert_array_equal(counts, [[4, 0], [0, 4]])
  steep = mix_choice.StepCost(width=(1.0, 1.0) + (50.0,) * 8, fixed=0.0, per_token=(0.0, 0.0))
  plain = mix_choice.request_choice(tables, grid, steep, mix_choice.tree_choice.Batch())
  assert plain.plain and plain.tokens_per_pass == 1.0


def test_reach_tables_by_hand():
  """A chain: a1 a2 ... within its count. Lookup: match 1 right 0.3 as often as match 0,
  independent. A tree: its nodes' values summed per depth, in its order."""
  chain = mix_choice.chain_table([0.5, 0.8], 2, 3)
  np.testing.assert_allclose(chain, [[0, 0, 0], [0.5, 0, 0], [0.5, 0.4, 0]])
  lookup = mix_choice.matches_table(2, 2, 2)
  np.testing.assert_allclose(lookup[2], [0.5, 0.4])
  np.testing.assert_allclose(lookup[3], [1 - 0.5 * 0.85, 0.4])
  np.testing.assert_allclose(lookup[4], [1 - 0.5 * 0.85, 1 - 0.6 * 0.88])
  tree = mix_choice.tree_table([(0.6, 1), (0.3, 2), (0.2, 1)], 2)
  np.testing.assert_allclose(tree, [[0, 0], [0.6, 0], [0.6, 0.3], [0.8, 0.3]])
  np.testing.assert_allclose(mix_choice.step_conditional(tree)[2], [0.6, 0.5])


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
