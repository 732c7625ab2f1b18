"""Function-preserving growth (`mdjax.train.grow`, `experiments.grow_lm`): a grown model
gives the logits of the model it grew from, and its new weights can still learn."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.random_init import init_params
from mdjax.models.transformer import causal_logits
from mdjax.train import grow, lm
from helpers import torch_logits, write_tiny_checkpoint

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 24)))


def test_grown_model_gives_the_same_logits():
  params = init_params(CONFIG, seed=1, std=0.3)
  grown, config = grow.grow(params, CONFIG, num_kv_heads=4, num_layers=5, seed=2)
  assert (config.num_kv_heads, config.num_layers) == (4, 5)
  np.testing.assert_allclose(causal_logits(grown, TOKENS, config=config),
                             causal_logits(params, TOKENS, config=CONFIG), rtol=1e-5, atol=1e-5)


def test_kv_heads_are_copied_to_the_query_heads_that_read_them():
  params = init_params(CONFIG, seed=1)
  grown, _ = grow.grow(params, CONFIG, num_kv_heads=4)
  h, n = CONFIG.head_dim, CONFIG.num_heads
  old, new = params["layers"][0]["wqkv"], grown["layers"][0]["wqkv"]
  assert new.shape == (32, (n + 2 * 4) * h)
  for part in (0, 1):  # keys, then values: query heads 0,1 read old head 0; 2,3 old head 1
    for head in range(4):
      start_new, start_old = (n + part * 4 + head) * h, (n + part * 2 + head // 2) * h
      np.testing.assert_array_equal(new[:, start_new:start_new + h],
                                    old[:, start_old:start_old + h])
  np.testing.assert_array_equal(new[:, :n * h], old[:, :n * h])


def test_new_layers_sit_between_old_ones_silent_but_trainable():
  params = init_params(CONFIG, seed=1)
  grown, config = grow.grow(params, CONFIG, num_layers=5, seed=2)
  new = [1, 3]  # 3 -> 5 layers: old0 NEW old1 NEW old2
  for i, old in zip([0, 2, 4], params["layers"]):
    jax.tree.map(np.testing.assert_array_equal, grown["layers"][i], old)
  for i in new:
    assert not np.any(grown["layers"][i]["wo"]) and not np.any(grown["layers"][i]["w_down"])
    assert np.any(grown["layers"][i]["wqkv"])

  def loss(p):
    return lm.token_losses(p, TOKENS, config)[0].mean()

  grads = jax.grad(loss)(grown)
  for i in new:  # zero outputs still get a gradient: they can learn
    assert np.abs(grads["layers"][i]["wo"]).max() > 0
    assert np.abs(grads["layers"][i]["w_down"]).max() > 0


@pytest.mark.parametrize("change, message", [
    (dict(num_kv_heads=3), "multiple of 2 that divides the 4 query heads"),
    (dict(num_layers=2), "growth only adds layers"),
])
def test_growth_that_cannot_preserve_the_function_is_refused(change, message):
  with pytest.raises(MdjaxError, match=message):
    grow.grow(init_params(CONFIG), CONFIG, **change)


@pytest.mark.parametrize("family, change", [("qwen2", dict(qkv_bias=True)),
                                             ("qwen3", dict(qk_norm=True))])
def test_kv_heads_of_biased_or_normed_attention_grow_with_the_same_logits(family, change):
  config = ModelConfig(**{**CONFIG.__dict__, "family": family, **change})
  params = init_params(config, seed=1, std=0.3)
  grown, grown_config = grow.grow(params, config, num_kv_heads=4, num_layers=4, seed=2)
  np.testing.assert_allclose(causal_logits(grown, TOKENS, config=grown_config),
                             causal_logits(params, TOKENS, config=config), rtol=1e-5, atol=1e-5)


S, F = "sliding_attention", "full_attention"
# gemma3: six layers, the last one full, the others sliding with a window of 4 (< the 24
# tokens), so a layer that changed kind would change the logits
GEMMA3 = ModelConfig(**{**CONFIG.__dict__, "family": "gemma3", "qk_norm": True, "num_layers": 6,
                        "layer_types": (S, S, S, S, S, F), "sliding_window": 4,
                        "sliding_rope_theta": 100.0, "query_pre_attn_scalar": 12})


def test_gemma3_layers_grow_with_their_kinds_and_the_same_logits():
  params = init_params(GEMMA3, seed=1, std=0.3)
  grown, config = grow.grow(params, GEMMA3, num_kv_heads=4, num_layers=8, seed=2)
  # old0 old1 NEW old2 old3 NEW old4 old5: each new layer of the kind of the one before
  assert config.layer_types == (S, S, S, S, S, S, S, F)
  np.testing.assert_allclose(causal_logits(grown, TOKENS, config=config),
                             causal_logits(params, TOKENS, config=GEMMA3), rtol=1e-5, atol=1e-5)
  one = init_params(dataclasses.replace(GEMMA3, num_layers=1, layer_types=(F,)), seed=1)
  assert grow.grow(one, dataclasses.replace(GEMMA3, num_layers=1, layer_types=(F,)),
                   num_layers=2)[1].layer_types == (F, F)  # placed first: the first one's kind


def test_new_gemma3_layers_are_silent_through_their_output_norms_and_trainable():
  """gemma3 norms a block's output before adding it: zero projections would give that
  norm a gradient of 1 / sqrt(eps), so the output norms scale by zero (weight -1) instead,
  and the projections stay random."""
  params = init_params(GEMMA3, seed=1, std=0.3)
  grown, config = grow.grow(params, GEMMA3, num_layers=8, seed=2)
  grads = jax.grad(lambda p: lm.token_losses(p, TOKENS, config)[0].mean())(grown)
  for i in (2, 5):  # the new layers
    layer = grown["layers"][i]
    assert np.all(layer["post_attn_norm"] == -1) and np.all(layer["post_mlp_norm"] == -1)
    assert np.any(layer["wo"]) and np.any(layer["w_down"])
    assert np.abs(grads["layers"][i]["post_attn_norm"]).max() > 0
    assert np.abs(grads["layers"][i]["post_mlp_norm"]).max() > 0


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}),
    ("gemma3_text", dict(layer_types=[S, F], sliding_window=3)),
])
def test_grow_lm_writes_a_model_transformers_reads_with_the_same_logits(tmp_path, family,
                                                                         overrides):
  source = tmp_path / "source"
  torch_model = write_tiny_checkpoint(source, family, **overrides)
  (source / "training_summary.json").write_text(json.dumps({"tokens_seen": 7}))
  out = tmp_path / "grown"
  subprocess.run([sys.executable, "-m", "experiments.grow_lm", f"--model={source}",
                  "--num_kv_heads=4", "--num_layers=4", f"--out={out}"], check=True)
  grown = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert (grown.config.num_key_value_heads, grown.config.num_hidden_layers) == (4, 4)
  if overrides:  # 2 -> 4 layers: both new ones after old0, of its kind
    assert grown.config.layer_types == [S, S, S, F]
  ids = np.random.default_rng(3).integers(0, 192, 20)
  with torch.no_grad():
    np.testing.assert_allclose(torch_logits(grown.eval(), ids), torch_logits(torch_model, ids),
                               rtol=1e-4, atol=1e-4)
  summary = json.loads((out / "training_summary.json").read_text())
  assert summary["tokens_seen"] == 7 and summary["grown_from"]["num_layers"] == 2
