"""speculative_tree: greedy output == the target's greedy decoding for any draft and
tree shape; sampled output follows the target's sampling law (chi-square); the
multi-candidate acceptance rule on hand-computed trees."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax.models.model import Model
from mdjax.sampling import tree_accept, typical_accept
from mdjax.strategies.base import ModelFn
from mdjax.strategies.speculative_tree import SpeculativeTree
from mdjax.strategies.trees import Tree, greedy_path
from tests.helpers import chi_square_p_value, random_model, target_law

# Ragged rows; row 0 is a whole prompt bucket (16) and 64 new tokens a whole budget
# bucket, so with a full tree accepted every step its cache is filled exactly.
PROMPTS = [list(range(3, 19)), [9, 10, 11, 12, 13]]
NEW = 64


@pytest.fixture(scope="module")
def targets():
  return [random_model("llama", 1), random_model("qwen3", 2)]


@pytest.fixture(scope="module")
def greedy(targets):
  return [mdjax.generate(t, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences
          for t in targets]


@pytest.fixture(scope="module")
def near_draft(targets):
  """A draft that often agrees with the llama target: its weights moved 10% of the
  way to another random model's."""
  other = random_model("llama", 9)
  return Model(config=targets[0].config, params=jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b,
                                                             targets[0].params, other.params))


@pytest.mark.parametrize("index", [0, 1])
def test_tree_equals_target_greedy(targets, greedy, near_draft, index):
  """llama: a near draft accepts paths of every length, rows differently; qwen3: a small
  llama (another family and shape) drafts."""
  target = targets[index]
  draft = near_draft if index == 0 else random_model("llama", 7, layers=1, hidden=16, heads=2,
                                                     kv_heads=1)
  out = mdjax.generate(target, PROMPTS, strategy="speculative_tree", draft=draft, tree_depth=3,
                       tree_top_k=3, tree_budget=10, max_new_tokens=NEW, eos_token_id=[],
                       return_metadata=True)
  assert out.sequences == greedy[index]
  stats = out.stats
  assert stats["draft_passes"] == 3 * stats["target_passes"]
  assert stats["drafted"] == sum(stats["drafted_at"]) and stats["accepted"] == sum(
      stats["accepted_at"])
  assert stats["generated_tokens"] == 2 * NEW
  if index == 0:
    assert 0 < stats["accepted_at"][2] < stats["accepted_at"][1] < stats["accepted_at"][0]
  _check_metadata(target, out)


def _check_metadata(target, out):
  """Each token's target probability is the target's after the text before it; the
  drafted flags add up to the accepted nodes; a correction names another token."""
  assert sum(sum(m["drafted"]) for m in out.metadata) == out.stats["accepted"]
  assert sum(sum(m["accepted_per_step"]) for m in out.metadata) == out.stats["accepted"]
  assert any(r != -1 for m in out.metadata for r in m["rejected"])
  for prompt, sequence, meta in zip(PROMPTS, out.sequences, out.metadata):
    logits = mdjax.forward_logits(target, prompt + sequence)[len(prompt) - 1:-1]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(meta["target_prob"], probs[np.arange(NEW), sequence], atol=1e-4)
    assert meta["drafted"][0] is False and meta["rejected"][0] == -1
    for token, drafted, rejected in zip(sequence, meta["drafted"], meta["rejected"]):
      assert rejected != token and not (drafted and rejected != -1)


def test_draft_equal_to_target_accepts_the_full_depth(targets, greedy):
  """Depth 2, top-k 2 and every drafted node kept: the draft's greedy path is in the
  tree, so each step accepts 2 nodes + the target's token, 63 = 21 * 3 tokens after
  the first; row 0 fills its cache exactly (a slot leaked per step would overflow)."""
  target = targets[0]
  out = mdjax.generate(target, PROMPTS, strategy="speculative_tree", draft=target, tree_depth=2,
                       tree_top_k=2, tree_budget=6, max_new_tokens=NEW, eos_token_id=[])
  assert out.sequences == greedy[0]
  assert out.stats["target_passes"] == 21 and out.stats["draft_passes"] == 42
  assert out.stats["accepted_at"] == [42, 42] and out.stats["drafted_at"] == [84, 168]
  assert out.stats["mean_accepted_length"] == 2


def test_eos_inside_an_accepted_path(targets, greedy):
  target = targets[0]
  eos = greedy[0][0][8]  # the second node of the third step (its first occurrence)
  out = mdjax.generate(target, PROMPTS, strategy="speculative_tree", draft=target, tree_depth=2,
                       tree_top_k=2, tree_budget=6, max_new_tokens=NEW, eos_token_id=eos)
  expected = mdjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=eos).sequences
  assert out.sequences == expected and len(expected[0]) == 9


def test_tree_sampling_follows_the_target_law(targets, near_draft):
  """3000 independent rows drafted by the near draft: the second token is
  decided at the tree's root, the third one level deeper (or by the residual or the
  bonus token). Chi-square p > 1e-3 for both."""
  target, prompt, draws, options = targets[0], [4, 5, 6, 7], 3000, dict(temperature=0.9, top_k=20)
  out = mdjax.generate(target, [prompt] * draws, strategy="speculative_tree",
                       draft=near_draft, tree_depth=2, tree_top_k=2, tree_budget=4,
                       max_new_tokens=3, eos_token_id=[], seed=5, **options)
  accepted, verified = out.stats["accepted_at"], out.stats["drafted"] // 4  # row-steps
  assert 0 < accepted[1] < accepted[0] < verified  # acceptances and rejections at both depths
  for position in (1, 2):
    sample = [s[position] for s in out.sequences]
    assert chi_square_p_value(sample, target_law(target, prompt, position, options)) > 1e-3


# The acceptance rule. A tree over tokens 0..5: root -> nodes 0, 1, 2 (tokens 2, 4, 0);
# node 0 -> nodes 3, 4 (tokens 1, 5). p[:, 0] is the root's distribution, p[:, 1 + n] node n's.
TOKENS, PARENT = [2, 4, 0, 1, 5], [-1, -1, -1, 0, 0]


DRAWS = 4000
_tree_accept = jax.jit(tree_accept, static_argnums=4)


def _accept(p, seed=0):
  """`tree_accept` for the tree above repeated over DRAWS keys: (path, next_token)."""
  keys = jax.random.split(jax.random.key(seed), DRAWS)
  tile = lambda x: jnp.broadcast_to(jnp.asarray(x), (DRAWS, *np.shape(x)))
  path, token = _tree_accept(keys, tile(TOKENS), tile(PARENT), tile(np.asarray(p, np.float32)), 2)
  return np.asarray(path), np.asarray(token)


def _one_hot(*tokens):
  return np.eye(6)[list(tokens)]


def _emitted(path, token, level: int):
  """The token emitted at `level`: the accepted node's, else the next token."""
  return np.where(path[:, level] >= 0, np.asarray(TOKENS)[path[:, level]], token)


def test_acceptance_rule_hand_computed_cases():
  # one-hot p (greedy): the child equal to the argmax, then the argmax after it.
  path, token = _accept(_one_hot(2, 5, 0, 0, 0, 3))
  assert (path == [0, 4]).all() and (token == 3).all()
  # the argmax is no child: reject them all, emit it.
  path, token = _accept(_one_hot(3, 0, 0, 0, 0, 0))
  assert (path == -1).all() and (token == 3).all()
  # a leaf at the last level: the bonus token from its own distribution.
  path, token = _accept(_one_hot(4, 0, 1, 0, 0, 0))
  assert (path == [1, -1]).all() and (token == 1).all()
  # root p = [.5, 0, .5, 0, 0, 0]: node 0 (token 2) w.p. 1/2; else node 2 (token 0) has
  # probability .5 / (1 - .5) = 1 once token 2 is zeroed. Never the residual.
  p = np.full((6, 6), 1 / 6)
  p[0] = [0.5, 0, 0.5, 0, 0, 0]
  path, _ = _accept(p)
  assert set(path[:, 0]) == {0, 2} and abs((path[:, 0] == 0).mean() - 0.5) < 0.03
  # root p = [0, .25, .5, .25, 0, 0]: node 0 w.p. 1/2; node 1 (token 4) and node 2
  # (token 0) have p = 0; the residual [0, .25, 0, .25, 0, 0] gives 1 or 3.
  p[0] = [0, 0.25, 0.5, 0.25, 0, 0]
  path, token = _accept(p)
  first = _emitted(path, token, 0)
  assert set(first) == {1, 2, 3}
  np.testing.assert_allclose(np.bincount(first, minlength=6) / DRAWS, p[0], atol=0.03)


def test_acceptance_rule_rows_are_independent():
  """A batch of two trees: one accepted to the end, one rejected at the root."""
  keys = jax.random.split(jax.random.key(1), 2)
  p = np.stack([_one_hot(2, 5, 0, 0, 0, 3), _one_hot(3, 0, 0, 0, 0, 0)]).astype(np.float32)
  path, token = _tree_accept(keys, jnp.asarray([TOKENS] * 2), jnp.asarray([PARENT] * 2),
                             jnp.asarray(p), 2)
  assert np.asarray(path).tolist() == [[0, 4], [-1, -1]] and np.asarray(token).tolist() == [3, 3]


@pytest.mark.parametrize("seed", range(3))
def test_greedy_tree_rule_is_the_exact_and_typical_rules_on_one_hot_targets(seed):
  """`trees.greedy_path` (greedy verification: no draw, no walk) gives what `tree_accept`
  and `typical_accept` give on a one-hot p at the target's choice: random trees of 12
  nodes over 16 tokens (distinct among siblings, as a drafter's top-k), 3 levels, 64 rows."""
  rng = np.random.default_rng(seed)
  rows, nodes, vocab, depth = 64, 12, 16, 3
  parent = np.full((rows, nodes), -1)
  level = np.ones((rows, nodes), int)
  tokens = np.zeros((rows, nodes), int)
  for r in range(rows):
    for n in range(nodes):  # parents before children, at most `depth` levels
      parent[r, n] = rng.choice([m for m in range(n) if level[r, m] < depth] + [-1])
      level[r, n] = 1 if parent[r, n] < 0 else level[r, parent[r, n]] + 1
      siblings = {tokens[r, m] for m in range(n) if parent[r, m] == parent[r, n]}
      tokens[r, n] = rng.choice([t for t in range(vocab) if t not in siblings])
  # the target's choice after the root and each node: mostly one of its children's tokens
  choice = rng.integers(0, vocab, (rows, nodes + 1))
  for r in range(rows):
    for n in range(-1, nodes):
      children = tokens[r][parent[r] == n]
      if len(children) and rng.random() < 0.7:
        choice[r, n + 1] = rng.choice(children)
  one_hot = jnp.asarray(np.eye(vocab, dtype=np.float32)[choice])  # [rows, nodes + 1, vocab]
  args = jnp.asarray(tokens, jnp.int32), jnp.asarray(parent, jnp.int32)
  path, token = greedy_path(Tree(*args, depth=jnp.asarray(level, jnp.int32)),
                            jnp.asarray(choice, jnp.int32), depth)
  keys = jax.random.split(jax.random.key(seed), rows)
  for rule in (tree_accept, functools.partial(typical_accept, epsilon=0.3, delta=0.09)):
    expected_path, expected_token = rule(keys, *args, one_hot, depth)
    np.testing.assert_array_equal(path, expected_path)
    np.testing.assert_array_equal(token, expected_token)
  assert (np.asarray(path)[:, 1] >= 0).any()  # some rows accepted two levels


def test_acceptance_rule_emits_the_target_law():
  """Random p: the first emitted token ~ p[:, 0]; after node 0 was accepted, the
  second ~ node 0's own distribution p[:, 1]."""
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(6), 6)
  p[0] = [0.1, 0.1, 0.4, 0.1, 0.2, 0.1]  # node 0 (token 2) is accepted in 40% of the draws
  path, token = _accept(p, seed=2)
  assert chi_square_p_value(_emitted(path, token, 0), p[0]) > 1e-3
  after = path[:, 0] == 0
  assert chi_square_p_value(_emitted(path[after], token[after], 1), p[1]) > 1e-3


def test_kept_nodes_form_a_tree_despite_ties(targets):
  """Children scoring as much as their parents (probability 1): ties keep the
  shallower node, so no kept node misses its parent."""
  target = ModelFn(config=targets[0].config)
  strategy = SpeculativeTree(model=target, draft=target, tree_depth=2, tree_top_k=2, tree_budget=3)
  drafted = Tree(tokens=jnp.arange(6)[None], parent=jnp.asarray([[-1, -1, 1, 1, 0, 0]]),
                 depth=jnp.asarray([[1, 1, 2, 2, 2, 2]]))
  tree, kept = strategy._keep(drafted, jnp.asarray([[-1.0, 0, 0, -2, -1, -3]]))
  assert np.asarray(kept).tolist() == [[0, 1, 2]]
  assert np.asarray(tree.parent).tolist() == [[-1, -1, 1]]


@pytest.mark.parametrize("options,match", [
    (dict(tree_depth=0), r"tree_depth must be an integer >= 1, got 0"),
    (dict(tree_top_k=0), r"tree_top_k must be an integer >= 1, got 0"),
    (dict(tree_budget=-1), r"tree_budget must be an integer >= 1, got -1"),
    (dict(tree_top_k=65), r"tree_top_k \(65\) exceeds the vocabulary \(64 tokens\)"),
    (dict(tree_depth=2, tree_top_k=2, tree_budget=7),
     r"tree_budget \(7\) exceeds the 6 nodes drafted with tree_depth 2 and tree_top_k 2"),
    (dict(draft=None), r"strategy 'speculative_tree' needs draft=<an mdjax Model>, got None"),
    (dict(num_draft_tokens=3), r"unknown option 'num_draft_tokens'"),
])
def test_bad_options(targets, options, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(targets[0], [1, 2], strategy="speculative_tree",
                   **{"draft": targets[0], **options})


def test_draft_with_another_vocabulary_is_refused(targets):
  other = random_model("llama", 3, vocab_size=80)
  with pytest.raises(mdjax.MdjaxError, match=r"draft's vocabulary \(80 tokens\).*target's \(64"):
    mdjax.generate(targets[0], [1, 2], strategy="speculative_tree", draft=other)
