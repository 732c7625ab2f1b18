"""layer_loop: stacked layers walked by `lax.scan` == the list walked by a Python loop.

Stacking round-trips; the forward agrees (llama, and a gemma3 whose sliding and full
layers make a period of 2 with a remainder layer); every registered strategy gives
the same tokens in both layouts (and the same statistics; a lossless one is compared
with unrolled greedy, whose tokens it returns, to halve the compiles); a scan model
saved and reloaded is unchanged; training gradients agree; weight decay reaches the
stacked matrices; `grow` keeps the layout; an unknown loop name is a clear error.
Llama's two layouts run the same operations per layer, so their logits agree exactly
and no near-tie allowance is needed.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from configs import lm_tiny_test
from mdjax.checkpoints import hf
from mdjax.models.layer_loop import (LAYER_LOOPS, layer_loop_of, stack_layers, take_layers,
                                     unstack_layers, with_layer_loop)
from mdjax.models.model import Model
from mdjax.models.transformer import causal_logits, forward_causal, layer_period
from mdjax.strategies import STRATEGIES
from mdjax.train import lm
from mdjax.train.grow import grow
from tests.helpers import (GEMMA3_MIXED, LOSSLESS, every_strategy, random_model, run_strategy,
                           strategy_heads)

# sliding, full, sliding, full, sliding: period 2, two scanned groups and one layer after
GEMMA3_FIVE = dict(GEMMA3_MIXED, layer_types=("sliding_attention", "full_attention") * 2
                   + ("sliding_attention",))


def in_layout(model: Model, loop: str) -> Model:
  return dataclasses.replace(model, params=with_layer_loop(model.params, loop))


def gemma3() -> Model:
  return random_model("gemma3", 3, layers=5, **GEMMA3_FIVE)


def test_stack_unstack_round_trip():
  model = gemma3()
  stacked = stack_layers(model.params)
  assert layer_loop_of(stacked) == "scan" and layer_loop_of(model.params) == "unrolled"
  assert set(stacked["layers"]) == set(model.params["layers"][0])
  assert stacked["layers"]["wqkv"].shape == (5, *model.params["layers"][0]["wqkv"].shape)
  assert stack_layers(stacked) is stacked and unstack_layers(model.params) is model.params
  back = unstack_layers(stacked)
  assert jax.tree.structure(back) == jax.tree.structure(model.params)
  jax.tree.map(np.testing.assert_array_equal, back, model.params)
  for n in (1, 3):  # the same first n layers in either layout
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(take_layers(stacked, n)),
                 take_layers(model.params, n))


def test_layers_that_differ_do_not_stack():
  params = dict(random_model().params)
  params["layers"] = [{k: w for k, w in params["layers"][0].items() if k != "attn_norm"},
                      params["layers"][1]]  # EAGLE-1's first layer has no attn_norm
  with pytest.raises(mdjax.MdjaxError, match="cannot stack the layers .* layer 1 has"):
    stack_layers(params)


def test_unknown_layer_loop_is_a_clear_error():
  with pytest.raises(mdjax.MdjaxError, match=r"unknown layer_loop 'Scan'; valid: scan, unrolled"):
    mdjax.load("random-llama-tiny", layer_loop="Scan")
  with pytest.raises(mdjax.MdjaxError, match=r"unknown layer_loop 3; valid: scan, unrolled"):
    with_layer_loop(random_model().params, 3)


def test_forward_logits_scan_equals_unrolled():
  ids = list(range(3, 23))  # 20 tokens: longer than the sliding window (4)
  llama, gemma = mdjax.load("random-llama-tiny", dtype="float32"), gemma3()
  for model in (llama, gemma):
    np.testing.assert_allclose(mdjax.forward_logits(in_layout(model, "scan"), ids),
                               mdjax.forward_logits(model, ids), atol=1e-5, rtol=0)
  assert layer_period(llama.config, 2) == 1 and layer_period(gemma.config, 5) == 2
  jaxpr = str(jax.make_jaxpr(lambda p, t: forward_causal(p, t, config=gemma.config))(
      stack_layers(gemma.params), jnp.zeros((1, 8), jnp.int32)))
  assert "scan[" in jaxpr and "length=2" in jaxpr  # two groups of (sliding, full)


def test_gradients_of_forward_causal_agree():
  model = gemma3()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
  weights = jax.random.normal(jax.random.key(0), (2, 12, 64))

  def loss(params):
    return jnp.sum(causal_logits(params, tokens, config=model.config) * weights)

  unrolled = jax.jit(jax.grad(loss))(model.params)
  scanned = jax.jit(jax.grad(loss))(stack_layers(model.params))
  assert layer_loop_of(scanned) == "scan"
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max(),
                                                       rtol=0),  # float32 summation order
               unstack_layers(scanned), unrolled)
  assert np.abs(scanned["layers"]["wqkv"][4]).max() > 0  # the layer after the groups learns


def test_scan_model_saved_and_reloaded_is_unchanged(tmp_path):
  model = mdjax.load("random-llama-tiny", layer_loop="scan")
  hf.save_hf(model, tmp_path / "m")
  again = mdjax.load(str(tmp_path / "m"), layer_loop="scan")
  assert again.config == model.config
  assert jax.tree.structure(again.params) == jax.tree.structure(model.params)
  jax.tree.map(np.testing.assert_array_equal, again.params, model.params)
  assert layer_loop_of(mdjax.load(str(tmp_path / "m"), layer_loop="unrolled").params) == "unrolled"


def test_grow_keeps_the_layout():
  model = gemma3()
  grown, config = grow(stack_layers(model.params), model.config, num_layers=7)
  assert layer_loop_of(grown) == "scan" and config.num_layers == 7
  expected, _ = grow(model.params, model.config, num_layers=7)
  jax.tree.map(np.testing.assert_array_equal, unstack_layers(grown), expected)


def test_weight_decay_reaches_stacked_and_split_matrices_only():
  """One AdamW step on zero gradients moves exactly the decayed weights: the matrices,
  fused or split (`mdjax.sharding`'s names), per layer or stacked; never norms or biases."""
  config = lm_tiny_test.get_config()
  config.optim.update(lr=0.1, warmup_steps=0, weight_decay=0.5)
  optimizer = lm.make_optimizer(config)
  layers = random_model(qkv_bias=True).params["layers"]
  split = [dict({k: w for k, w in lp.items() if k not in ("wqkv", "bqkv")},
                **dict(zip(("wq", "wk", "wv"), jnp.split(lp["wqkv"], [32, 48], axis=-1))),
                **dict(zip(("bq", "bk", "bv"), jnp.split(lp["bqkv"], [32, 48]))),
                **dict(zip(("w_gate", "w_up"), jnp.split(lp["w_gate_up"], 2, axis=-1))))
           for lp in layers]
  params = {"fused_stacked": stack_layers({"layers": layers}),
            "split_stacked": stack_layers({"layers": split}), "split": {"layers": split}}
  updates, _ = jax.jit(lambda p: optimizer.update(jax.tree.map(jnp.zeros_like, p),
                                                  optimizer.init(p), p))(params)
  for name, tree in updates.items():
    moved = {path[-1].key for path, u in jax.tree_util.tree_leaves_with_path(tree)
             if np.abs(u).max() > 0}
    names = {path[-1].key for path, _ in jax.tree_util.tree_leaves_with_path(tree)}
    assert moved == {k for k in names if k.startswith("w")}, (name, moved)  # the matrices


@pytest.fixture(scope="module")
def runs():
  """Per layout: the model, and the options of every strategy (drafts and heads built
  on that layout's model). Heads keep their own layers as lists."""
  base = mdjax.load("random-llama-tiny", dtype="float32")
  draft = random_model("llama", 5, vocab_size=base.config.vocab_size, layers=1, std=0.05)
  heads = strategy_heads(base)
  out = {}
  for loop in LAYER_LOOPS:
    model = mdjax.load("random-llama-tiny", dtype="float32", layer_loop=loop)
    assert layer_loop_of(model.params) == loop
    out[loop] = (model, every_strategy(in_layout(draft, loop), heads))
  return out


def test_every_strategy_is_covered(runs):
  assert set(runs["scan"][1]) == set(STRATEGIES)


def run(runs, loop: str, strategy: str) -> mdjax.GenerationOutput:
  model, options = runs[loop]
  return run_strategy(model, strategy, options[strategy])


@pytest.mark.parametrize("strategy", sorted(set(STRATEGIES) - LOSSLESS))
def test_scan_equals_unrolled_for_every_strategy(runs, strategy):
  scan, unrolled = run(runs, "scan", strategy), run(runs, "unrolled", strategy)
  assert scan.sequences == unrolled.sequences and sum(map(len, scan.sequences)) > 0
  assert scan.beams == unrolled.beams
  timing = ("wall_s", "compile_s", "compiled", "compiled_because")
  assert ({k: v for k, v in scan.stats.items() if k not in timing}
          == {k: v for k, v in unrolled.stats.items() if k not in timing})


@pytest.mark.parametrize("strategy", sorted(LOSSLESS))
def test_scan_equals_unrolled_for_every_lossless_strategy(runs, strategy):
  """At temperature 0 each of these returns greedy's tokens (their own tests prove it
  unrolled), so the scan run is compared with unrolled greedy: one compile, not two."""
  assert run(runs, "scan", strategy).sequences == run(runs, "unrolled", "greedy").sequences
