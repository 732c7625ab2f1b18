"""tree_budget="auto": with a given cost profile the chosen tree is the hand-computed
optimum (static Medusa trees, dynamic EAGLE-2 trees, several branches); where no tree
pays, plain decoding, token-identical to greedy, and the stats say so; the pass cost
measured once, cached, and measured again when the cache is corrupt; bad input names
the value. (The suite pins a flat profile in conftest; tests here set their own.)"""

import json

import numpy as np
import pytest

import mdjax
from mdjax.heads import init_heads
from mdjax.heads.eagle3 import default_target_layers
from mdjax.heads.tree import rank_accuracy
from mdjax.strategies import tree_choice
from mdjax.strategies.base import ModelFn
from mdjax.strategies.pass_cost import (PIN_VARIABLE, WIDTHS, PassCost, batch_bucket,
                                       cache_entry, pass_cost)
from tests.helpers import heads_config, random_medusa_heads, random_model

PROMPTS = [list(range(3, 12)), [9, 10, 11, 12, 13]]
NEW = 16
# t(n) at n = 1, 2, 4, 8, 16, 32, 64: a pass over 4 tokens costs 1.3 passes over one
COST = PassCost(seconds=(1.0, 1.1, 1.3, 2.0, 3.0, 4.0, 5.0), batch=1, source="pinned")
STEEP = "1,2,4,8,16,32,64"  # t(n) = n: no tree can pay
FLAT = "1,1,1,1,1,1,1"


def test_static_tree_is_the_hand_computed_optimum():
  """Head 1 right at rank 0 / 1 with p .6 / .2, head 2 with .5 / .1. Trees by budget
  (build_tree) and their expected tokens per pass E, t(1 + M) from COST:

      M  tree added     E      t(1 + M)  rate = E / t
      1  (0,)           1.6    1.1       1.4545
      2  (0, 0)  .3     1.9    1.2       1.5833
      3  (1,)    .2     2.1    1.3       1.6154   <- best
      4  (1, 0)  .1     2.2    1.475     1.4915
  """
  accuracy = ((0.6, 0.8), (0.5, 0.6))
  choice = tree_choice.static_tree(accuracy, COST, lambda depth: 0.0)
  assert (choice.budget, choice.depth, choice.top_k) == (3, 2, 0)
  assert choice.tokens_per_pass == pytest.approx(2.1)
  assert choice.speedup == pytest.approx(2.1 / 1.3)
  # Two branches per row: plain feeds 2 tokens (1 / 1.1); M = 1 feeds 4: 1.6 / 1.3 wins
  # over M = 2 (1.9 / t(6) = 1.9 / 1.65) and M = 3 (2.1 / t(8) = 2.1 / 2).
  two = tree_choice.static_tree(accuracy, COST, lambda depth: 0.0, branches=2)
  assert two.budget == 1 and two.speedup == pytest.approx(1.6 / 1.3 * 1.1)
  # Drafting that costs 0.4 of a pass: M = 3 gives 2.1 / 1.7 = 1.235, M = 4 2.2 / 1.875,
  # M = 1 1.6 / 1.5: still M = 3.
  assert tree_choice.static_tree(accuracy, COST, lambda depth: 0.4).budget == 3
  # Each head costs 0.25 of a pass, and a tree of depth D runs D heads: M = 1 (depth 1)
  # gives 1.6 / 1.35 = 1.185, M = 3 (depth 2) 2.1 / 1.8 = 1.167. Had both heads run
  # whatever the tree (0.5), M = 3 would win: 2.1 / 1.8 over M = 1's 1.6 / 1.6.
  per_head = tree_choice.static_tree(accuracy, COST, lambda depth: 0.25 * depth)
  assert (per_head.budget, per_head.depth) == (1, 1)
  assert per_head.speedup == pytest.approx(1.6 / 1.35)
  assert tree_choice.static_tree(accuracy, COST, lambda depth: 0.5).budget == 3


def test_dynamic_tree_is_the_hand_computed_optimum():
  """Rank 0 / 1 right with p .5 / .25 at both depths; drafting costs .05 per level.
  The drafted values, best first, and the best budget of each shape:

      D K  values                          best M: E / (t(1 + M) + .05 D)
      1 1  .5                              1: 1.5 / 1.15 = 1.304
      1 2  .5 .25                          2: 1.75 / 1.25 = 1.4
      2 1  .5 .25                          2: 1.75 / 1.3 = 1.346
      2 2  .5 .25 .25 .125 .125 .0625      3: 2.0 / 1.4 = 1.4286   <- best
  """
  accuracy = ((0.5, 0.75),) * 2
  choice = tree_choice.dynamic_tree(accuracy, COST, lambda depth, top_k: 0.05 * depth,
                                    depths=(1, 2), top_ks=(1, 2))
  assert (choice.budget, choice.depth, choice.top_k) == (3, 2, 2)
  assert choice.tokens_per_pass == pytest.approx(2.0)
  assert choice.speedup == pytest.approx(2.0 / 1.4)
  assert tree_choice.drafted_values(accuracy, 2, 2) == (
      (0.5, 1), (0.25, 1), (0.25, 2), (0.125, 2), (0.125, 2), (0.0625, 2))


def test_a_batch_waits_for_its_slowest_row():
  """A one-node tree right with p .5: X = 1 or 2 tokens per pass, E X = 1.5, Var X = .25.
  8 rows of 100 tokens: a row needs 100 / 1.5 = 66.67 passes, give or take
  sqrt(100 x .25 / 1.5^3 + (100 x .3 x .5 / 1.5^2)^2) = 7.2008 (the steps' luck, the
  prompt's); the slowest of 8 needs 1.4342 (Blom's z_8) of those more: E = 100 / 76.99."""
  assert tree_choice.PROMPT_SPREAD == 0.3
  assert tree_choice.batch_tokens_per_pass([0.5], tree_choice.Batch()) == 1.5
  eight = tree_choice.Batch(rows=8, new_tokens=100)
  assert tree_choice.batch_tokens_per_pass([0.5], eight) == pytest.approx(1.29880, abs=1e-5)
  assert tree_choice.batch_tokens_per_pass([0.0], eight) == 1.0  # nothing drafted pays
  # A pass of two tokens costs 1.3 of one: the tree pays alone (1.5 / 1.3 = 1.154), not
  # for 8 rows (1.2988 / 1.3 = 0.999), where plain decoding runs.
  cost = PassCost(seconds=(1.0, 1.3, 1.6, 2.0, 3.0, 4.0, 5.0), batch=1, source="pinned")
  one = tree_choice.static_tree(((0.5,),), cost, lambda depth: 0.0)
  assert one.budget == 1 and one.speedup == pytest.approx(1.5 / 1.3)
  assert tree_choice.static_tree(((0.5,),), cost, lambda depth: 0.0, batch=eight).plain
  dynamic = tree_choice.dynamic_tree(((0.5,),), cost, lambda d, k: 0.0, depths=(1,),
                                     top_ks=(1,), batch=eight)
  assert dynamic.plain


def test_a_tree_must_promise_five_percent_more_than_plain_decoding():
  """A one-node tree right with p .5 (E = 1.5) over t(2) = 1.44: 1.5 / 1.44 = 1.042x,
  within what the model misses of a step: plain decoding. At t(2) = 1.4, 1.071x: the tree."""
  assert tree_choice.MIN_GAIN == 1.05
  for t2, plain in ((1.44, True), (1.4, False)):
    cost = PassCost(seconds=(1.0, t2, 1.6, 2.0, 3.0, 4.0, 5.0), batch=1, source="pinned")
    choice = tree_choice.static_tree(((0.5,),), cost, lambda depth: 0.0)
    assert choice.plain == plain and choice.speedup == pytest.approx(1.0 if plain else 1.5 / t2)


def test_a_width_costs_at_most_a_wider_one():
  """A pass of n tokens can run padded as a wider one: t is the suffix minimum of the
  measured times (here 2 tokens cheaper than 1, and 8 cheaper than 4), then linear."""
  cost = PassCost(seconds=(1.0, 0.9, 1.2, 1.1, 2.0, 3.0, 4.0), batch=1, source="measured")
  assert [cost(n) for n in (1, 2, 3, 4, 8, 12, 64, 96)] == pytest.approx(
      [0.9, 0.9, 1.0, 1.1, 1.1, 1.55, 4.0, 5.0])


def test_no_tree_pays_on_a_linear_cost():
  """t(n) = n: a tree of M nodes costs M + 1 passes and gains less than M tokens."""
  steep = PassCost(seconds=tuple(map(float, WIDTHS)), batch=1, source="pinned")
  accuracy = ((0.9, 0.95),) * 3
  for choice in (tree_choice.static_tree(accuracy, steep, lambda depth: 0.0),
                 tree_choice.dynamic_tree(accuracy, steep, lambda d, k: 0.0, depths=(1, 2, 3),
                                          top_ks=(1, 2))):
    assert choice.plain and choice.budget == 0 and choice.speedup == 1.0
  forced = tree_choice.static_tree(accuracy, steep, lambda depth: 0.0, allow_plain=False)
  assert forced.budget == 1 and forced.speedup < 1
  assert choice.stats(greedy=False)["tree_choice"] == "sample"  # plain decoding that samples


def test_heads_pay_for_the_unembedding_they_read():
  """A drafting pass costs the heads' weights over the target's, plus the target's
  unembedding only where the heads score with it: not with their own `lm_head` (EAGLE-3's
  over a draft vocabulary, Medusa's own) or the target's draft columns."""
  zeros = lambda *shape: np.zeros(shape, np.int8)
  target = {"embed": zeros(100, 8), "layers": zeros(4, 8, 25)}  # 800 + 800 weights
  layer = {"fc": zeros(8, 8)}
  for heads, weights in ((layer, 64 + 800), ({**layer, "lm_head": zeros(8, 10)}, 64 + 80),
                         ({**layer, "draft_unembedding": zeros(8, 10)}, 64 + 80)):
    assert tree_choice.heads_fraction(heads, target) == weights / 1600


@pytest.fixture(scope="module")
def tiny():
  return random_model("llama", 1)


@pytest.fixture(scope="module")
def requests(tiny):
  """Per strategy, the options of a request with `auto` trees."""
  return {"medusa": dict(heads=random_medusa_heads(tiny)),
          "eagle": dict(heads=init_heads(heads_config(tiny, "eagle"), tiny.config, seed=1)),
          "speculative_tree": dict(draft=random_model("llama", 7, layers=1, hidden=16, heads=2,
                                                      kv_heads=1))}


@pytest.fixture(scope="module")
def greedy(tiny):
  return mdjax.generate(tiny, PROMPTS, max_new_tokens=NEW, eos_token_id=[])


def auto_stats(tiny, greedy, monkeypatch, profile: str, strategy: str, **options) -> dict:
  """The stats of `strategy` with `auto` under the pinned `profile`; its tokens are greedy's."""
  monkeypatch.setenv(PIN_VARIABLE, profile)
  out = mdjax.generate(tiny, PROMPTS, strategy=strategy, max_new_tokens=NEW, eos_token_id=[],
                       **options)
  assert out.sequences == greedy.sequences
  return out.stats


@pytest.mark.parametrize("strategy", ["medusa", "eagle", "speculative_tree"])
def test_where_no_tree_pays_plain_greedy_runs(tiny, greedy, requests, strategy, monkeypatch):
  stats = auto_stats(tiny, greedy, monkeypatch, STEEP, strategy, **requests[strategy])
  assert stats["tree_choice"] == "greedy" and stats["tree_budget"] == 0
  assert stats["target_passes"] == greedy.stats["target_passes"]
  assert "accepted" not in stats  # nothing was drafted
  assert stats["pass_cost_s"] == [float(n) for n in WIDTHS]
  assert stats["pass_cost_source"] == "pinned" and stats["pass_cost_batch"] == 2


def test_plain_decoding_asks_the_target_for_no_hidden_states(tiny, greedy, monkeypatch):
  """EAGLE-3 reads three layers' states; plain decoding drafts nothing, so its passes
  return the final-norm state alone (the passes traced are recorded)."""
  heads = init_heads(heads_config(tiny, "eagle3", own_unembedding=True,
                                  target_layers=default_target_layers(tiny.config.num_layers)),
                     tiny.config, seed=1)
  traced, call = [], ModelFn.__call__
  monkeypatch.setattr(ModelFn, "__call__",
                      lambda self, *a, **k: traced.append(self.hidden_layers) or call(self, *a, **k))
  mdjax.clear_compiled()  # traced anew, not served from an earlier test's program
  stats = auto_stats(tiny, greedy, monkeypatch, STEEP, "eagle", heads=heads)
  assert stats["tree_choice"] == "greedy"
  assert traced and set(traced) == {()}


def test_medusa_falls_back_to_multi_question_in_branches(tiny, requests, monkeypatch):
  monkeypatch.setenv(PIN_VARIABLE, STEEP)
  kwargs = dict(questions=[[[7, 8], [5]], [[11, 9]]], max_new_tokens=NEW, eos_token_id=[])
  plain = mdjax.generate(tiny, PROMPTS, strategy="multi_question", **kwargs)
  out = mdjax.generate(tiny, PROMPTS, strategy="medusa", heads=requests["medusa"]["heads"],
                       **kwargs)
  assert out.sequences == plain.sequences and out.stats["tree_choice"] == "greedy"


@pytest.mark.parametrize("strategy", ["medusa", "eagle", "speculative_tree"])
def test_where_passes_are_flat_a_tree_runs(tiny, greedy, requests, strategy, monkeypatch):
  """A flat t(n): the widest trees the profile covers."""
  stats = auto_stats(tiny, greedy, monkeypatch, FLAT, strategy, **requests[strategy])
  assert stats["tree_choice"] == "tree" and stats["expected_speedup"] > 1
  assert stats["drafted"] > 0
  if strategy == "medusa":  # E grows with every node: the 63 of a 64-token pass
    assert stats["tree_budget"] == 63 and stats["tree_depth"] == 3


def test_a_given_depth_and_top_k_are_kept(tiny, greedy, requests, monkeypatch):
  stats = auto_stats(tiny, greedy, monkeypatch, FLAT, "speculative_tree", tree_depth=2,
                     tree_top_k=3, **requests["speculative_tree"])
  assert (stats["tree_depth"], stats["tree_top_k"], stats["tree_budget"]) == (2, 3, 12)


def test_return_metadata_keeps_a_tree(tiny, greedy, requests, monkeypatch):
  """Per-token metadata describes drafts: with it, auto takes the best tree even at a loss."""
  stats = auto_stats(tiny, greedy, monkeypatch, STEEP, "medusa", return_metadata=True,
                     **requests["medusa"])
  assert stats["tree_choice"] == "tree" and stats["expected_speedup"] < 1


@pytest.mark.parametrize("strategy", ["medusa", "eagle", "speculative_tree"])
def test_the_choice_is_remembered_by_its_inputs_not_its_strategy(tiny, requests, strategy,
                                                               monkeypatch):
  """Two strategies asking the same question share one search; neither is kept alive by
  the memo (an `lru_cache` on the method kept up to 256 of them)."""
  import gc
  import weakref
  from mdjax import strategies
  from mdjax.strategies.prompt_layouts import Plain

  monkeypatch.setenv(PIN_VARIABLE, FLAT)
  chosen = (tree_choice.chosen_static_tree if strategy == "medusa"
            else tree_choice.chosen_dynamic_tree)
  prompt = Plain().lay_out(tiny, PROMPTS, None, NEW).prompt
  before, kept = chosen.cache_info(), []
  for _ in range(2):
    decoder, params = strategies.get(strategy).build(tiny, dict(requests[strategy]))
    chose = decoder.for_request(params, prompt, 16)
    assert chose.tree_budget > 0
    kept.append(weakref.ref(decoder))
    del decoder, chose, params
  after = chosen.cache_info()
  assert after.hits - before.hits >= 1 and after.misses - before.misses <= 1
  gc.collect()
  assert [ref() for ref in kept] == [None, None]


# ------------------------------------------------------------------ measuring and the cache


def test_pass_cost_is_measured_once_and_cached(tiny, tmp_path, monkeypatch, capsys):
  """A corrupt cache file is measured again (and said so), then cached for every batch
  of its bucket."""
  monkeypatch.delenv(PIN_VARIABLE)
  monkeypatch.setenv("MDJAX_CACHE", str(tmp_path))
  model = ModelFn(config=tiny.config)
  profile = cache_entry(model, tiny.params, 3) / "profile.json"
  profile.parent.mkdir(parents=True)
  profile.write_text('{"key": {"version": 1}, "widths": [1, 2, 4], "seconds": [-1')
  measured = pass_cost(model, tiny.params, 3)
  assert f"the pass-cost cache {str(profile)!r} is corrupt" in capsys.readouterr().err
  assert measured.source == "measured" and measured.batch == batch_bucket(3) == 4
  assert all(s > 0 for s in measured.seconds)
  assert json.loads(profile.read_text())["seconds"] == list(measured.seconds)
  cached = pass_cost(model, tiny.params, 4)
  assert cached.source == "cached" and cached.seconds == measured.seconds


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("strategy", ["medusa", "eagle", "speculative_tree"])
@pytest.mark.parametrize("value", ["big", 2.5, True, None])
def test_tree_budget_must_be_an_int_or_auto(tiny, requests, strategy, value):
  with pytest.raises(mdjax.MdjaxError,
                     match=rf"tree_budget must be an integer or 'auto', got {value!r}"):
    mdjax.generate(tiny, [1, 2], strategy=strategy, tree_budget=value, **requests[strategy])


def test_a_bad_pinned_profile_is_named(tiny, requests, monkeypatch):
  monkeypatch.setenv(PIN_VARIABLE, "1,2")
  with pytest.raises(mdjax.MdjaxError, match=r"\$MDJAX_PASS_COST must be 7 comma-separated "
                                             r"positive ratios .* got '1,2'"):
    mdjax.generate(tiny, [1, 2], strategy="medusa", **requests["medusa"])
