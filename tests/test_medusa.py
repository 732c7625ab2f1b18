"""medusa and blockwise: static trees built and checked by hand; greedy output ==
the target's greedy decoding for any heads (several families, ragged rows, EOS
inside an accepted block, the context limit); heads that know the target's future
accept every node of their path; sampling follows the target's law (chi-square);
typical acceptance on hand-computed trees; bad input names what is wrong."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from experiments import decode
from mdjax.cache import KVCache
from mdjax.heads import Heads, HeadsConfig, init_heads, save_heads
from mdjax.heads.tree import (TreeArrays, build_tree, check_tree, default_accuracy,
                              expected_length)
from mdjax.models.model import Model
from mdjax.sampling import typical_accept
from mdjax.step import decode_step
from mdjax.strategies.base import ModelFn
from mdjax.strategies.medusa import Blockwise, Medusa
from tests.helpers import (GEMMA3_MIXED, chi_square_p_value, heads_config, random_medusa_heads,
                           random_model, target_law)

PROMPTS = [list(range(3, 19)), [9, 10, 11, 12, 13], [40]]  # ragged
NEW = 40


def medusa_config(model: Model, num_heads: int, **fields) -> HeadsConfig:
  return heads_config(model, "medusa", num_heads=num_heads, **fields)


random_heads = random_medusa_heads


def permutation_model_and_heads(num_heads: int = 3, seed: int = 0) -> tuple[Model, Heads]:
  """A random llama whose greedy continuation is x -> pi(x) -> pi(pi(x)) ... for a
  random permutation pi whatever the context, and heads that know it.

  Its embeddings are scaled up 100-fold, so the residual stream, and the final-norm
  hidden state h_t, are (nearly) those of the last token alone: u(x) (unit length).
  Its lm_head's column pi(y) is u(y), so the largest logit at x is pi(x)
  (Cauchy-Schwarz). Head k (from 1) guesses token t + 1 + k = pi^(k+1)(x_t) with its
  own unembedding, column pi^(k+1)(y) = u(y), and identity blocks (w = b = 0).
  """
  base = random_model("llama", seed, tie_word_embeddings=False)
  c, vocab = base.config, base.config.vocab_size
  params = dict(base.params, embed=100 * base.params["embed"])
  tokens = jnp.arange(vocab, dtype=jnp.int32)[:, None]  # [V, 1]: every token alone
  _, hidden, _ = decode_step(params, KVCache.create(c, vocab, 1), tokens, jnp.zeros_like(tokens),
                             jnp.zeros_like(tokens), mdjax.Topology.causal(vocab), config=c)
  unit = np.asarray(hidden[:, 0] / jnp.linalg.norm(hidden[:, 0], axis=-1, keepdims=True))
  pi = np.random.default_rng(seed).permutation(vocab)

  def unembedding(power: int) -> np.ndarray:  # [D, V]: column pi^power(y) = u(y)
    image = np.arange(vocab)
    for _ in range(power):
      image = pi[image]
    w = np.zeros((c.hidden_size, vocab), np.float32)
    w[:, image] = unit.T
    return w

  model = Model(config=c, params=dict(params, lm_head=jnp.asarray(unembedding(1))),
                name="random-llama-permutation")
  d = c.hidden_size
  heads = Heads(config=medusa_config(model, num_heads, own_unembedding=True),
                params={"blocks": {"w": jnp.zeros((num_heads, 1, d, d)),
                                   "b": jnp.zeros((num_heads, 1, d))},
                        "lm_head": jnp.asarray(np.stack([unembedding(k + 2)
                                                         for k in range(num_heads)]))})
  return model, heads


@pytest.fixture(scope="module")
def tiny():
  return mdjax.load("random-llama-tiny")


@pytest.fixture(scope="module")
def permutation():
  return permutation_model_and_heads()


# ------------------------------------------------------------------ trees

# per-rank accuracies: head 1 [.5, .25], head 2 [.5, .25] (exact in binary: ties are ties)
TWO_BY_TWO = ((0.5, 0.75), (0.5, 0.75))


@pytest.mark.parametrize("budget,expected", [
    (1, ((0,),)),
    (2, ((0,), (1,))),  # (1,) and (0, 0) are both worth .25: the shallower first
    (3, ((0,), (1,), (0, 0))),
    (4, ((0,), (1,), (0, 0), (0, 1))),  # (0, 1) and (1, 0) tie at .125: lexicographic
    (5, ((0,), (1,), (0, 0), (0, 1), (1, 0))),
])
def test_build_tree_by_hand(budget, expected):
  assert build_tree(TWO_BY_TWO, budget) == expected


def test_expected_length_by_hand():
  assert expected_length(((0,), (1,), (0, 0)), TWO_BY_TWO) == 1 + 0.5 + 0.25 + 0.25
  assert expected_length(((0,), (0, 0), (0, 0, 0)), ((0.5,),) * 3) == 1 + 0.5 + 0.25 + 0.125


def test_build_tree_prefers_a_chain_of_accurate_heads_and_respects_max_depth():
  accurate = ((0.9, 0.95),) * 3
  assert build_tree(accurate, 3) == ((0,), (0, 0), (0, 0, 0))
  assert build_tree(accurate, 2, max_depth=1) == ((0,), (1,))


def test_build_tree_maximises_the_expected_length():
  """Against every parent-closed 5-node tree of depth <= 2 over ranks < 3."""
  accuracy = ((0.4, 0.6, 0.7), (0.3, 0.5, 0.55))
  candidates = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
  best = 0.0
  for mask in range(1 << len(candidates)):
    tree = [n for i, n in enumerate(candidates) if mask >> i & 1]
    if len(tree) == 5 and all(len(n) == 1 or n[:1] in tree for n in tree):
      best = max(best, expected_length(tree, accuracy))
  assert expected_length(build_tree(accuracy, 5), accuracy) == pytest.approx(best)


def test_default_accuracy_decays_and_builds_a_tree():
  table = default_accuracy(4)
  assert table[0][0] == pytest.approx(0.6) and table[1][0] == pytest.approx(0.45)
  assert all(a <= b <= 1 for row in table for a, b in zip(row, row[1:]))
  tree = build_tree(table, 16)
  assert len(tree) == 16 and tree[0] == (0,) and max(map(len, tree)) == 4
  assert check_tree(tree, 4, 64) == tree  # parents first, children in rank order


def test_tree_arrays_of_the_docstring_tree():
  tree = check_tree([(0, 0, 0), (1, 0), (0, 1), (0, 0), (1,), (0,)], num_heads=3, vocab_size=8)
  assert tree == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
  arrays = TreeArrays.of(tree)
  assert arrays.parent.tolist() == [-1, -1, 0, 0, 1, 2]
  assert arrays.depth.tolist() == [1, 1, 2, 2, 2, 3]
  assert arrays.head.tolist() == [0, 0, 1, 1, 1, 2]
  assert arrays.rank.tolist() == [0, 1, 0, 1, 0, 0]
  assert arrays.max_depth == 3 and arrays.num_ranks == 2


@pytest.mark.parametrize("tree,match", [
    ((), r"a tree must be a non-empty sequence of nodes"),
    (((0,), (1, 0)), r"tree node \(1, 0\) has no parent \(1,\) in the tree"),
    (((0,), (70,)), r"tree node \(70,\) asks for rank 70, beyond the vocabulary \(64 tokens\)"),
    (((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)), r"tree node \(0, 0, 0, 0\) is 4 deep, but only 3"),
    (((0,), (0,)), r"tree node \(0,\) appears twice"),
    (((0,), (-1,)), r"tree node \(-1,\) is not a non-empty path of ranks"),
    (((0,), ()), r"tree node \(\) is not a non-empty path of ranks"),
])
def test_check_tree_names_the_bad_node(tree, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    check_tree(tree, num_heads=3, vocab_size=64)


@pytest.mark.parametrize("table,budget,match", [
    (((0.5, 0.4),), 1, r"top_accuracy row 0 must be non-decreasing cumulative accuracies"),
    (((0.5, 1.5),), 1, r"top_accuracy row 0 must be"),
    ((), 1, r"top_accuracy needs one non-empty row per head"),
    (((0.5, 0.75),), 3, r"tree budget \(3\) exceeds the 2 nodes the accuracy table allows"),
    (((0.5,),), 0, r"tree budget must be an integer >= 1, got 0"),
])
def test_build_tree_rejects_bad_tables(table, budget, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    build_tree(table, budget)


def test_the_tree_a_strategy_verifies(tiny):
  """An explicit tree; else (tree_budget 0) the heads' calibrated tree (cut to the heads
  used); else one built from their accuracies, or from the default ones; blockwise: the
  chain. (The default, "auto", chooses per request: tests/test_tree_auto.py.)"""
  target = ModelFn(config=tiny.config)
  accuracy = ((0.5, 0.75), (0.5, 0.75), (0.5, 0.75))
  calibrated = ((0,), (0, 0), (0, 0, 0), (0, 1))
  plain = medusa_config(tiny, 3)
  measured = medusa_config(tiny, 3, top_accuracy=accuracy)
  shipped = medusa_config(tiny, 3, top_accuracy=accuracy, tree=calibrated)
  assert Medusa(model=target, heads=plain, tree_budget=0).nodes == build_tree(
      default_accuracy(3), 16)
  assert Medusa(model=target, heads=measured, tree_budget=4).nodes == build_tree(accuracy, 4)
  assert Medusa(model=target, heads=shipped, tree_budget=0).nodes == ((0,), (0, 0), (0, 1),
                                                                      (0, 0, 0))
  assert Medusa(model=target, heads=shipped, tree_budget=0, num_heads=2).nodes == (
      (0,), (0, 0), (0, 1))
  assert Medusa(model=target, heads=shipped, tree_budget=2).nodes == ((0,), (1,))
  assert Medusa(model=target, heads=shipped, tree=[[0], [0, 0]]).nodes == ((0,), (0, 0))
  assert Blockwise(model=target, heads=shipped, num_heads=2).nodes == ((0,), (0, 0))
  # only the heads as deep as the tree run: (0,), (1,) reads head 1 alone
  assert Medusa(model=target, heads=shipped, tree_budget=2).drafting_heads == 1
  assert Medusa(model=target, heads=shipped, tree_budget=0).drafting_heads == 3
  assert Blockwise(model=target, heads=shipped, num_heads=2).drafting_heads == 2


# ------------------------------------------------------------------ typical acceptance

# root -> nodes 0 (token 1), 1 (token 2); node 0 -> node 2 (token 3); node 1 -> node 3 (token 0)
TYPICAL_TOKENS, TYPICAL_PARENT = [1, 2, 3, 0], [-1, -1, 0, 1]


def _typical(p, epsilon=0.09, delta=0.3):
  path, token = typical_accept(jax.random.split(jax.random.key(0), 1),
                               jnp.asarray([TYPICAL_TOKENS]), jnp.asarray([TYPICAL_PARENT]),
                               jnp.asarray([p], jnp.float32), 2, epsilon=epsilon, delta=delta)
  return np.asarray(path)[0].tolist(), int(token[0])


def test_typical_acceptance_by_hand():
  root = [0.1, 0.3, 0.5, 0.1]  # H = 1.168, .3 exp(-H) = .093: threshold .09; both children pass
  after_node2 = [0, 0, 1, 0]
  # node 0: uniform, threshold min(.09, .3 * .25) = .075 < .25: node 2 passes;
  # node 1: [.05 .05 .05 .85], threshold .09 > .05: node 3 fails. Deepest: node 2.
  p = [root, [0.25] * 4, [0.05, 0.05, 0.05, 0.85], after_node2, [1, 0, 0, 0]]
  assert _typical(p) == ([0, 2], 2)
  # node 0 peaked on token 0: node 2 (token 3, p .02 < .09) fails; node 1 -> node 3 (token 0,
  # p .5 > min(.09, .3 * .5)) passes: the deepest path wins over the first accepted child.
  p = [root, [0.94, 0.02, 0.02, 0.02], [0.5, 0.5, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]]
  assert _typical(p) == ([1, 3], 3)
  # a one-hot root gives its children p = 0: nothing accepted, the root's token next
  p = [[1, 0, 0, 0], [0.25] * 4, [0.25] * 4, [0.25] * 4, [0.25] * 4]
  assert _typical(p) == ([-1, -1], 0)
  # epsilon 0: every child of nonzero probability passes
  p = [root, [0.94, 0.02, 0.02, 0.02], [0.05, 0.05, 0.05, 0.85], [0, 1, 0, 0], [1, 0, 0, 0]]
  assert _typical(p, epsilon=0.0) == ([0, 2], 1)


# ------------------------------------------------------------------ exactness vs greedy


@pytest.fixture(scope="module")
def gemma3():
  return random_model("gemma3", 3, layers=3, **GEMMA3_MIXED)


@pytest.mark.parametrize("strategy,options", [
    ("medusa", dict()),  # the default, "auto" (a flat cost pinned in conftest: 63 nodes)
    ("medusa", dict(tree_budget=6, num_heads=2)),
    ("medusa", dict(tree=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))),
    ("medusa", dict(tree=((0,), (1,), (2,)))),  # depth 1: only head 1 runs
    ("blockwise", dict()),
])
def test_greedy_output_equals_the_target_greedy(tiny, strategy, options):
  greedy = mdjax.generate(tiny, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
  out = mdjax.generate(tiny, PROMPTS, strategy=strategy, heads=random_heads(tiny),
                       max_new_tokens=NEW, eos_token_id=[], return_metadata=True, **options)
  assert out.sequences == greedy.sequences
  stats = out.stats
  assert 0 < stats["accepted"] < stats["drafted"] and stats["draft_passes"] == 0
  assert stats["target_passes"] <= greedy.stats["target_passes"]
  per_step = [m["accepted_per_step"] for m in out.metadata]
  assert len({tuple(s) for s in per_step}) == len(PROMPTS)  # rows accept differently


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_other_families(gemma3, family):
  model = gemma3 if family == "gemma3" else random_model("qwen3", 2)
  prompts = [[5, 6, 7, 8, 9, 10, 11], [30, 31]]
  greedy = mdjax.generate(model, prompts, max_new_tokens=24, eos_token_id=[]).sequences
  for strategy in ("medusa", "blockwise"):
    out = mdjax.generate(model, prompts, strategy=strategy, heads=random_heads(model, std=0.1),
                         max_new_tokens=24, eos_token_id=[])
    assert out.sequences == greedy


@pytest.mark.parametrize("strategy", ["medusa", "blockwise"])
def test_heads_that_know_the_future_accept_every_node_of_their_path(permutation, strategy):
  """Every verify accepts 3 nodes (the tree's depth) and adds the target's token: 4
  tokens per pass, until the budget takes only the accepted 3 of the last block
  (NEW = 40 = 1 + 9 * 4 + 3)."""
  model, heads = permutation
  greedy = mdjax.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
  out = mdjax.generate(model, PROMPTS, strategy=strategy, heads=heads, max_new_tokens=NEW,
                       eos_token_id=[], return_metadata=True)
  assert out.sequences == greedy.sequences
  assert [m["accepted_per_step"] for m in out.metadata] == [[3] * 10] * len(PROMPTS)
  assert out.stats["target_passes"] == 10 and out.stats["accepted_at"] == [30, 30, 30]
  assert out.stats["mean_accepted_length"] == 3


def test_eos_inside_an_accepted_block(permutation):
  model, heads = permutation
  free = mdjax.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences
  eos = free[0][6]  # the second node of the second block of row 0
  assert eos not in free[0][:6]
  expected = mdjax.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos).sequences
  for strategy in ("medusa", "blockwise"):
    out = mdjax.generate(model, PROMPTS, strategy=strategy, heads=heads, max_new_tokens=NEW,
                         eos_token_id=eos)
    assert out.sequences == expected and len(expected[0]) == 7


@pytest.mark.parametrize("heads_kind", ["random", "knowing"])
def test_up_to_the_context_limit(permutation, heads_kind):
  """prompt + max_new_tokens = the model's 256 positions: the last trees reach past it."""
  model, heads = permutation
  heads = random_heads(model, std=1.0) if heads_kind == "random" else heads
  prompts = [list(np.arange(200) % 60 + 3), [7, 8, 9]]
  new = model.config.max_position_embeddings - 200
  greedy = mdjax.generate(model, prompts, max_new_tokens=new, eos_token_id=[]).sequences
  out = mdjax.generate(model, prompts, strategy="medusa", heads=heads, max_new_tokens=new,
                       eos_token_id=[])
  assert out.sequences == greedy and len(greedy[0]) == new


@pytest.mark.parametrize("strategy", ["medusa", "blockwise"])
def test_heads_inside_every_branch_equal_multi_question(tiny, permutation, strategy):
  """multi_question's answers (== greedy per question) with a tree in each branch:
  ragged question counts; random heads (ragged acceptance) and heads that accept
  every node."""
  contexts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10]]
  questions = [[[7, 8], [5], [6, 7, 8, 5]], [[11, 9]]]
  kwargs = dict(questions=questions, max_new_tokens=24, eos_token_id=[])
  for model, heads in ((tiny, random_heads(tiny)), permutation):
    plain = mdjax.generate(model, contexts, strategy="multi_question", **kwargs)
    out = mdjax.generate(model, contexts, strategy=strategy, heads=heads, **kwargs)
    assert out.sequences == plain.sequences
    assert out.stats["accepted"] > 0
  assert out.stats["target_passes"] == 6  # 1 + 6 x 4 = 25 > 24 tokens: every node accepted


# ------------------------------------------------------------------ sampling


def test_sampling_follows_the_target_law(permutation):
  """3000 independent rows, a tree with two children at the root and one under each:
  the second token is decided at the root, the third one level deeper (or by the
  residual, or after a full accept). Chi-square p > 1e-3 for both."""
  model, heads = permutation
  prompt, draws, options = [4, 5, 6, 7], 3000, dict(temperature=2.0, top_k=12)
  out = mdjax.generate(model, [prompt] * draws, strategy="medusa", heads=heads,
                       tree=((0,), (1,), (0, 0), (1, 0)), max_new_tokens=3, eos_token_id=[],
                       seed=3, **options)
  accepted, verifies = out.stats["accepted_at"], out.stats["drafted_at"][0] // 2
  assert 0 < accepted[1] < accepted[0] < verifies  # acceptances and rejections at both depths
  for position in (1, 2):
    sample = [s[position] for s in out.sequences]
    assert chi_square_p_value(sample, target_law(model, prompt, position, options)) > 1e-3


def test_typical_acceptance_with_epsilon_zero_accepts_every_path_node(permutation):
  """With threshold 0 every node of positive probability passes: full depth each pass."""
  model, heads = permutation
  out = mdjax.generate(model, PROMPTS, strategy="medusa", heads=heads, max_new_tokens=NEW,
                       eos_token_id=[], temperature=1.0, acceptance="typical",
                       typical_epsilon=0.0, return_metadata=True)
  assert [m["accepted_per_step"] for m in out.metadata] == [[3] * 10] * len(PROMPTS)
  assert all(len(s) == NEW for s in out.sequences)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("options,match", [
    (dict(heads=None), r"strategy 'medusa' needs heads=<mdjax Heads> \(mdjax.load_heads\), "
                       r"got None"),
    (dict(num_heads=4), r"num_heads \(4\) exceeds the 3 heads"),
    (dict(num_heads=-1), r"num_heads must be an integer >= 0, got -1"),
    (dict(tree_budget=-2), r"tree_budget must be an integer >= 0, got -2"),
    (dict(tree=((0,), (1, 0))), r"tree node \(1, 0\) has no parent \(1,\)"),
    (dict(tree=((0,), (300,))), r"tree node \(300,\) asks for rank 300, beyond the vocabulary"),
    (dict(tree=((0,),), tree_budget=4), r"give tree or tree_budget, not both"),
    (dict(acceptance="fuzzy"), r"acceptance must be one of exact, typical, got 'fuzzy'"),
    (dict(acceptance="typical"), r"acceptance='typical' needs sampling"),
    (dict(acceptance="typical", temperature=1.0, typical_epsilon=2.0),
     r"typical_epsilon must be in \[0, 1\], got 2.0"),
    (dict(num_draft_tokens=3), r"unknown option 'num_draft_tokens'"),
])
def test_bad_options(tiny, options, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(tiny, [1, 2], strategy="medusa", **{"heads": random_heads(tiny), **options})


def test_blockwise_has_no_tree_options(tiny):
  with pytest.raises(mdjax.MdjaxError, match=r"unknown option 'tree_budget' for strategy "
                                             r"'blockwise'"):
    mdjax.generate(tiny, [1, 2], strategy="blockwise", heads=random_heads(tiny), tree_budget=4)


def test_heads_of_another_family_or_model_are_refused(tiny):
  eagle = init_heads(HeadsConfig(family="eagle", base_model="random-llama-tiny",
                                 base_family="llama", hidden_size=64, vocab_size=256),
                     tiny.config)
  with pytest.raises(mdjax.MdjaxError, match=r"strategy 'medusa' needs medusa or mtp heads, got "
                                             r"eagle heads 'random-llama-tiny'"):
    mdjax.generate(tiny, [1, 2], strategy="medusa", heads=eagle)
  other = random_model("llama", 3, vocab_size=80, hidden=64)
  with pytest.raises(mdjax.MdjaxError, match=r"trained on 'random-llama-tiny' \(vocabulary 256\) "
                                             r"and cannot run on this model \(vocabulary 80\)"):
    mdjax.generate(other, [1, 2], strategy="blockwise", heads=random_heads(tiny))


# ------------------------------------------------------------------ the CLI's path


@pytest.mark.parametrize("name", ["medusa", "blockwise"])
def test_config_with_heads_from_a_directory(tiny, tmp_path, name):
  """configs/<name>.py through `experiments.decode` (what the CLI runs), with heads
  saved to a directory and loaded by path: greedy's tokens."""
  save_heads(random_heads(tiny), tmp_path / "heads")
  config = importlib.import_module(f"configs.{name}").get_config()
  config.model, config.heads, config.chat = "random-llama-tiny", str(tmp_path / "heads"), False
  config.prompt, config.prompt_ids, config.eos_token_id = "", "5,6,7,8", "none"
  config.max_new_tokens = 12
  summary = decode.decode(config)
  config.strategy = "greedy"
  assert summary["sequences"] == decode.decode(config)["sequences"]
  assert summary["stats"]["target_passes"] <= config.max_new_tokens
