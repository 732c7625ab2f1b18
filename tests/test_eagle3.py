"""EAGLE-3's head: the cached step against the cache-free training forward, and the
training-time test's attention against drafting a chain over the cache."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import mdjax
from mdjax.cache import KVCache
from mdjax.errors import CheckpointError, MdjaxError
from mdjax.heads import Heads, HeadsConfig, export_heads, formats, load_heads, store, vocab
from mdjax.heads.eagle3 import (default_target_layers, eagle3_loss, eagle3_step, init_eagle3,
                                layer_config, unrolled_logits)
from mdjax.heads.objective import Objective
from mdjax.models.model import Model
from mdjax.models.transformer import forward_causal
from mdjax.strategies.base import ModelFn
from mdjax.topology import Topology

from tests.helpers import chi_square_p_value, random_model, target_law

T, STEPS = 9, 3


@pytest.fixture(scope="module")
def setup():
  model = random_model("llama", seed=3, layers=4)
  draft_ids = vocab.choose(np.arange(model.config.vocab_size)[::-1], 40)  # 40 of 64 ids
  params = init_eagle3(model.config, draft_ids, seed=1, std=0.3, target_params=model.params)
  params["fc_bias"] = 0.1 * jnp.ones(model.config.hidden_size)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (2, T)), jnp.int32)
  target = jnp.asarray(rng.normal(size=(2, T, 3 * model.config.hidden_size)), jnp.float32)
  return model, params, tokens, target


def cached_pass(model, params, cache, tokens, features, positions):
  b, t = tokens.shape
  return eagle3_step(params, model.params, cache, tokens, features, positions,
                     jnp.zeros((b, t), jnp.int32), Topology.causal(b), model_config=model.config)


def empty_cache(model, batch):
  return KVCache.create(layer_config(model.config), batch, 32)


def test_soft_labels_are_the_targets_law_of_each_shifted_token(setup):
  """Loss "kl" (SpecForge's soft labels): unrolled step j at index p learns the
  target's law of x[p + 2 + j] over the draft vocabulary, softmax(teacher[p + 1 + j]
  U_draft), where x[p + 2 + j] may be a target and its greedy guess has a draft column;
  checked against an explicit loop over rows, indices and steps. Loss "ce" on the same
  batch is the cross-entropy to those greedy guesses."""
  model, params, tokens, _ = setup
  c, n = model.config, T + 2
  rng = np.random.default_rng(5)
  draft_ids = jnp.asarray(vocab.choose(np.arange(c.vocab_size)[::-1], 40))
  target = {"embed": model.params["embed"], "draft_ids": draft_ids}
  target["draft_unembedding"] = vocab.unembedding_columns(target, draft_ids)
  batch = {"tokens": rng.integers(0, c.vocab_size, (2, n)).astype(np.int32),
           "ok": rng.random((2, n)) < 0.8,
           "hidden": rng.normal(size=(2, n - 1, 3 * c.hidden_size)).astype(np.float32),
           "greedy": rng.integers(0, c.vocab_size, (2, n - 1)).astype(np.int32),
           "teacher": rng.normal(size=(2, n - 1, c.hidden_size)).astype(np.float32)}
  objective = Objective(family="eagle3", model_config=c, depth=STEPS, num_layers=1,
                        loss="kl", decay=0.8)
  loss, _ = eagle3_loss(objective, params, batch, target, (1,))
  logits = unrolled_logits(params, target, jnp.asarray(batch["tokens"][:, 1:-1]),
                           jnp.asarray(batch["hidden"][:, :-1]), model_config=c, steps=STEPS)
  column = {int(t): i for i, t in enumerate(np.asarray(draft_ids))}
  law = np.asarray(jax.nn.log_softmax(batch["teacher"] @ np.asarray(
      target["draft_unembedding"]), axis=-1))  # [2, n - 1, 40]
  want = 0.0
  for j, step_logits in enumerate(logits):
    q = np.asarray(jax.nn.log_softmax(step_logits, axis=-1))  # [2, n - 2, 40]
    terms = [np.sum(np.exp(law[b, p + 1 + j]) * (law[b, p + 1 + j] - q[b, p]))
             for b in range(2) for p in range(n - 2)
             if p + 1 + j < n - 1 and batch["ok"][b, p + 2 + j]
             and int(batch["greedy"][b, p + 1 + j]) in column]
    want += 0.8**j * np.mean(terms)
  np.testing.assert_allclose(float(loss), want, rtol=1e-4)
  ce, _ = eagle3_loss(dataclasses.replace(objective, loss="ce"), params, batch, target, (1,))
  assert abs(float(ce) - want) > 0.1  # the two losses differ: the teacher was read


def test_target_layers_follow_eagle3():
  assert default_target_layers(30) == (1, 14, 26)
  assert default_target_layers(4) == (0, 2, 3)


def test_cached_step_equals_the_training_forward(setup):
  model, params, tokens, target = setup
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens.shape)
  logits, outputs, _ = cached_pass(model, params, empty_cache(model, 2), tokens, target, positions)
  assert logits.shape == (2, T, 40)
  np.testing.assert_allclose(logits, unrolled_logits(params, model.params, tokens, target,
                                                     model_config=model.config, steps=1)[0],
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [0, 3, T - STEPS])
def test_training_time_test_sees_what_drafting_sees(setup, t):
  """Step j of the unrolled forward at index t equals drafting the chain after the
  committed x_0..x_t: each step fed the next true token with the head's own last
  output, at the next position, over the head's cache."""
  model, params, tokens, target = setup
  unrolled = unrolled_logits(params, model.params, tokens, target, model_config=model.config,
                             steps=STEPS)
  positions = jnp.broadcast_to(jnp.arange(t + 1, dtype=jnp.int32), (2, t + 1))
  logits, outputs, cache = cached_pass(model, params, empty_cache(model, 2), tokens[:, :t + 1],
                                       target[:, :t + 1], positions)
  np.testing.assert_allclose(logits[:, -1], unrolled[0][:, t], rtol=1e-5, atol=1e-5)
  feature = outputs[:, -1:]  # [B, 1, D]
  for step in range(1, STEPS):
    logits, outputs, cache = cached_pass(model, params, cache, tokens[:, t + step:t + step + 1],
                                         feature, jnp.full((2, 1), t + step, jnp.int32))
    np.testing.assert_allclose(logits[:, 0], unrolled[step][:, t], rtol=1e-5, atol=1e-5)
    feature = outputs


def test_the_chain_never_sees_the_true_text_ahead(setup):
  """Changing the tokens after t + j changes nothing of step j at index t."""
  model, params, tokens, target = setup
  t = 2
  changed = tokens.at[:, t + STEPS:].set((tokens[:, t + STEPS:] + 1) % model.config.vocab_size)
  run = lambda x: unrolled_logits(params, model.params, x, target, model_config=model.config,
                                  steps=STEPS)
  for before, after in zip(run(tokens), run(changed)):
    np.testing.assert_allclose(before[:, t], after[:, t], rtol=1e-6, atol=1e-6)


def test_gradients_reach_every_param(setup):
  model, params, tokens, target = setup
  trainable = {k: v for k, v in params.items() if k != "draft_ids"}
  loss = lambda p: sum(jnp.sum(x**2) for x in unrolled_logits(
      {**p, "draft_ids": params["draft_ids"]}, model.params, tokens, target,
      model_config=model.config, steps=2))
  grads = jax.grad(loss)(trainable)
  for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
    assert float(jnp.abs(leaf).max()) > 0, jax.tree_util.keystr(path)


# --- files -------------------------------------------------------------------------------


def eagle3_heads(model, draft_size=40, seed=1):
  draft_ids = vocab.choose(np.arange(model.config.vocab_size)[::-1], draft_size)
  params = init_eagle3(model.config, draft_ids, seed=seed, std=0.3, target_params=model.params)
  config = HeadsConfig(family="eagle3", base_model=model.name, base_family=model.config.family,
                       hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                       own_unembedding=True, draft_vocab_size=draft_size, target_layers=(0, 2, 3))
  return Heads(config=config, params=params, name="toy-eagle3")


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_public_layouts_round_trip(tmp_path, layout):
  model = random_model("llama", seed=3, layers=4)
  heads = eagle3_heads(model)
  export_heads(heads, tmp_path / layout, layout, model=model)
  assert formats.detect_layout(tmp_path / layout) == layout
  back = load_heads(tmp_path / layout)
  assert back.config.family == "eagle3" and back.config.target_layers == (0, 2, 3)
  assert back.config.draft_vocab_size == 40
  ours, theirs = store.flatten(heads.params), store.flatten(back.params)
  theirs.pop("fc_bias", None)  # speculators' files carry a (zero) fc bias
  assert sorted(ours) == sorted(theirs)
  for name in ours:
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_speculators_config_names_what_vllm_reads(tmp_path):
  model = random_model("llama", seed=3, layers=4)
  export_heads(eagle3_heads(model), tmp_path / "s", "speculators", model=model)
  cfg = json.loads((tmp_path / "s" / "config.json").read_text())
  assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 40
  assert cfg["speculators_config"]["algorithm"] == "eagle3"
  assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # inputs of layers: one more
  assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
  tensors = safetensors.numpy.load_file(str(tmp_path / "s" / "model.safetensors"))
  assert tensors["layers.0.self_attn.q_proj.weight"].shape == (32, 64)  # [N H, 2D]
  assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == bool


def test_wrong_kinds_of_files_are_clear_errors(tmp_path):
  model = random_model("llama", seed=3, layers=4)
  export_heads(eagle3_heads(model), tmp_path / "e3", "eagle3", model=model)
  with pytest.raises(CheckpointError, match="EAGLE-3 heads.*layout 'eagle3'"):
    formats.import_heads(tmp_path / "e3", layout="eagle")
  spec = tmp_path / "spec"
  export_heads(eagle3_heads(model), spec, "speculators", model=model)
  cfg = json.loads((spec / "config.json").read_text())
  cfg["speculators_config"]["algorithm"] = "mlp_speculator"
  (spec / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match="'mlp_speculator'.*only 'eagle3'"):
    load_heads(spec)


def test_bad_draft_vocabulary_and_layers_are_named(tmp_path):
  model = random_model("llama", seed=3, layers=4)
  export_heads(eagle3_heads(model), tmp_path / "e3", "eagle3", model=model)
  path = tmp_path / "e3" / "model.safetensors"
  tensors = safetensors.numpy.load_file(str(path))
  tensors["d2t"][-1] += 100  # the last draft id now maps past the 64-token vocabulary
  tensors.pop("t2d")
  safetensors.numpy.save_file(tensors, str(path))
  with pytest.raises(MdjaxError, match="token id 139, outside the model's vocabulary of 64"):
    load_heads(tmp_path / "e3")
  shallow = random_model("llama", seed=3, layers=2)
  with pytest.raises(MdjaxError, match="target layer 2 .*2-layer model"):
    eagle3_heads(model).check_model(shallow.config)


# --- decoding ----------------------------------------------------------------------------

PROMPTS = [list(range(3, 19)), [9, 10, 11, 12, 13]]  # ragged
NEW = 40


@pytest.fixture(scope="module")
def target():
  return mdjax.load("random-llama-tiny", dtype="float32")


@pytest.fixture(scope="module")
def greedy(target):
  return mdjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences


def draft_heads(model, draft_ids, seed=2):
  """Random EAGLE-3 heads over `draft_ids`, reading EAGLE-3's default layers."""
  params = init_eagle3(model.config, draft_ids, seed=seed, std=0.3, target_params=model.params)
  config = HeadsConfig(family="eagle3", base_model=model.name, base_family=model.config.family,
                       hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                       own_unembedding=True, draft_vocab_size=len(draft_ids),
                       target_layers=default_target_layers(model.config.num_layers))
  return Heads(config=config, params=params)


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 3, 8), "auto"])
def test_draft_vocabulary_decodes_exactly_greedy(target, greedy, shape):
  """A draft vocabulary of the 100 most frequent ids of greedy's own output and
  others: ragged rows, several trees, every output token-identical to greedy."""
  used = np.bincount(np.concatenate(greedy), minlength=target.config.vocab_size)
  heads = draft_heads(target, vocab.choose(used + 1e-3 * np.arange(256)[::-1], 100))
  tree = (dict(tree_budget="auto") if shape == "auto" else
          dict(tree_depth=shape[0], tree_top_k=shape[1], tree_budget=shape[2]))
  out = mdjax.generate(target, PROMPTS, strategy="eagle", heads=heads, max_new_tokens=NEW,
                       eos_token_id=[], **tree)
  assert out.sequences == greedy
  assert out.stats["draft_passes"] > 0 or out.stats.get("tree_choice") == "greedy"


def test_greedy_tokens_outside_the_draft_vocabulary_still_decode_exactly(target, greedy):
  """The heads can propose none of the tokens greedy writes: nothing is accepted, and
  the target's own tokens (the verify's) make the output; EOS inside a block too."""
  written = np.unique(np.concatenate(greedy))
  outside = np.setdiff1d(np.arange(target.config.vocab_size), written)
  heads = draft_heads(target, outside[:64])
  out = mdjax.generate(target, PROMPTS, strategy="eagle", heads=heads, max_new_tokens=NEW,
                       eos_token_id=[], tree_depth=3, tree_top_k=2, tree_budget=6)
  assert out.sequences == greedy and out.stats["accepted"] == 0
  eos = greedy[0][7]
  stopped = mdjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[eos]).sequences
  out = mdjax.generate(target, PROMPTS, strategy="eagle", heads=heads, max_new_tokens=NEW,
                       eos_token_id=[eos], tree_depth=3, tree_top_k=2, tree_budget=6)
  assert out.sequences == stopped


def test_sampling_with_a_draft_vocabulary_follows_the_target_law(target):
  """3000 rows at temperature 0.9: tokens 2 and 3 follow the target's law (chi-square
  p > 1e-3), with a draft vocabulary holding half of the ids."""
  model = Model(config=target.config, name=target.name, params=dict(
      target.params, lm_head=30.0 * target.params["lm_head"]) if "lm_head" in target.params
      else dict(target.params, embed=30.0 * target.params["embed"]))
  prompt, draws, options = [4, 5, 6, 7], 3000, dict(temperature=0.9, top_k=20)
  heads = draft_heads(model, np.arange(0, model.config.vocab_size, 2))
  out = mdjax.generate(model, [prompt] * draws, strategy="eagle", heads=heads, tree_depth=2,
                       tree_top_k=2, tree_budget=4, max_new_tokens=3, eos_token_id=[], seed=5,
                       **options)
  assert out.stats["accepted"] > 0
  for position in (1, 2):
    sample = [s[position] for s in out.sequences]
    assert chi_square_p_value(sample, target_law(model, prompt, position, options)) > 1e-3


def test_the_verify_pass_hands_over_the_target_layers_of_a_full_forward(target):
  """`ModelFn(hidden_layers=...)`'s hidden, what EAGLE-3 heads fuse, equals the residual
  stream after those layers in a full cache-free forward, concatenated."""
  layers = default_target_layers(target.config.num_layers)
  tokens = jnp.asarray([PROMPTS[0]], jnp.int32)
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  model = ModelFn(config=target.config, hidden_layers=layers)
  cache = KVCache.create(target.config, 1, 32)
  _, hidden, _ = model(target.params, cache, tokens, positions, jnp.zeros_like(tokens),
                       Topology.causal(1))
  _, aux = forward_causal(target.params, tokens, config=target.config, aux_layers=layers)
  assert hidden.shape == (1, tokens.shape[1], 3 * target.config.hidden_size)
  np.testing.assert_allclose(hidden, aux.reshape(*aux.shape[:2], -1), rtol=1e-5, atol=1e-5)
