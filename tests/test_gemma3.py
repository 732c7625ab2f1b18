"""Gemma 3 text models (transformers' Gemma3ForCausalLM): logits parity on tiny random
checkpoints in both config.json layouts, sliding windows shorter than the prompt on
some layers only, greedy generation, export, config errors; every lossless strategy
on a gemma3 == its greedy decoding."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
import transformers
from transformers import masking_utils
from transformers.models.gemma3 import modeling_gemma3

import mdjax
from mdjax.checkpoints import hf
from mdjax.errors import CheckpointError, MdjaxError
from mdjax.models.config import ModelConfig, RopeScaling
from mdjax.models.model import Model
from tests.helpers import (GEMMA3_MIXED, assert_same_greedy, edit_config, hf_greedy,
                           mdjax_logits, random_model, torch_logits, write_tiny_checkpoint)

torch.set_grad_enabled(False)

ATOL = 2e-5  # for logits of order 1; float32 rounding grows with them (REL_TOL)
REL_TOL = 1e-6  # of the largest |logit| (the tied "mixed" variant's reach ~140)
IDS = np.random.default_rng(0).integers(0, 192, 20)  # 20 tokens: far past the windows
ROPE = {"full_attention": dict(rope_type="linear", rope_theta=1e6, factor=8.0),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
# variant -> config overrides of the tiny config (4 heads, 2 kv heads, head_dim 16)
VARIANTS = {
    # like gemma3 270m: tied, no soft-cap, linear RoPE on the full layers; window 5
    "mixed": dict(num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=24,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters=ROPE, tie_word_embeddings=True),
    # untied, soft-capped logits, q/k/v/o biases, the full layer first; window 3
    "capped": dict(sliding_window=3, layer_types=["full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": dict(rope_type="default", rope_theta=500.0),
                                    "sliding_attention": dict(rope_type="linear",
                                                              rope_theta=100.0, factor=2.0)},
                   final_logit_softcapping=3.0, attention_bias=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """variant -> (directory, torch model), written once per module on first use."""
  made = {}

  def get(variant):
    if variant not in made:
      path = tmp_path_factory.mktemp(variant)
      made[variant] = (path, write_tiny_checkpoint(path, "gemma3_text", **VARIANTS[variant]))
    return made[variant]

  return get


def assert_parity(model, torch_model, ids=IDS):
  """The largest |mdjax - transformers| logit, over both attention paths and
  `forward_logits`, is within float32 rounding of the logits' scale."""
  expected = torch_logits(torch_model, ids)  # [T, V]
  got = [mdjax_logits(model, ids, attention) for attention in ("block_sparse", "dense", "fused")]
  got.append(mdjax.forward_logits(model, list(ids)))
  assert all(g.shape == expected.shape for g in got)
  diff = max(float(np.abs(g - expected).max()) for g in got)
  assert diff < max(ATOL, REL_TOL * np.abs(expected).max()), diff


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(checkpoint, variant):
  path, torch_model = checkpoint(variant)
  model = hf.load_hf_dir(path)
  c = model.config
  assert c.family == "gemma3" and c.layer_types == tuple(VARIANTS[variant]["layer_types"])
  rotary = torch_model.model.rotary_emb
  for i, kind in enumerate(c.layer_types):
    np.testing.assert_allclose(c.inv_freq(i), getattr(rotary, f"{kind}_inv_freq").numpy(),
                               rtol=1e-6)
  assert ("lm_head" in model.params) == (not c.tie_word_embeddings)
  assert_parity(model, torch_model)


def test_sliding_window_is_exact(checkpoint):
  """The window is exactly transformers' (a query at p sees keys with p - pos < window):
  one more or one less key, or none on the sliding layers, changes the logits."""
  path, torch_model = checkpoint("mixed")
  model = hf.load_hf_dir(path)
  expected = torch_logits(torch_model, IDS)
  for window in (4, 6):
    config = dataclasses.replace(model.config, sliding_window=window)
    got = mdjax_logits(Model(config=config, params=model.params), IDS)
    np.testing.assert_allclose(got[:min(window, 5)], expected[:min(window, 5)], atol=1e-4)
    assert np.abs(got - expected).max() > 1e-2, window
  unwindowed = dataclasses.replace(model.config, layer_types=("full_attention",) * 3)
  got = mdjax_logits(Model(config=unwindowed, params=model.params), IDS)
  assert np.abs(got - expected).max() > 1e-2


def test_old_config_layout(checkpoint, tmp_path):
  """Top-level rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern
  (no layer_types, no rope_parameters) mean the same model, to transformers and mdjax."""
  source, torch_model = checkpoint("mixed")
  shutil.copytree(source, tmp_path / "old")

  def to_old_layout(config):
    del config["rope_parameters"], config["layer_types"]
    config.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})

  edit_config(tmp_path / "old", to_old_layout)
  old_torch = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "old",
                                                                attn_implementation="eager")
  np.testing.assert_array_equal(torch_logits(old_torch, IDS), torch_logits(torch_model, IDS))
  model = hf.load_hf_dir(tmp_path / "old")
  assert model.config == hf.load_hf_dir(source).config
  assert_parity(model, torch_model)


def test_attention_softcap_matches_gemma2_style_softcapping(checkpoint):
  """`attn_logit_softcapping` as transformers computes it where it applies it (Gemma 2's
  eager attention; its Gemma3 ignores the setting, so gemma3 checkpoints that set it
  are refused, see test_config_errors)."""
  _, torch_model = checkpoint("capped")
  model = hf.load_hf_dir(checkpoint("capped")[0])
  capped = Model(config=dataclasses.replace(model.config, attn_logit_softcapping=0.5),
                 params=model.params)

  def softcapped(module, *args, **kwargs):
    return modeling_gemma3.eager_attention_forward(module, *args, softcap=0.5, **kwargs)

  transformers.AttentionInterface.register("eager_softcapped_test", softcapped)
  # and eager's additive mask (an unknown implementation would get sdpa's boolean one)
  transformers.AttentionMaskInterface.register("eager_softcapped_test", masking_utils.eager_mask)
  torch_model.set_attn_implementation("eager_softcapped_test")
  try:
    assert_parity(capped, torch_model)
    assert np.abs(mdjax_logits(model, IDS) - torch_logits(torch_model, IDS)).max() > 1e-3
  finally:
    torch_model.set_attn_implementation("eager")


def test_greedy_matches_transformers(checkpoint):
  path, torch_model = checkpoint("mixed")
  model = mdjax.load(str(path))
  rng = np.random.default_rng(1)
  for length in (3, 12):  # within and past the window of 5
    prompt = rng.integers(3, model.config.vocab_size, length).tolist()
    ours = mdjax.generate(model, prompt, max_new_tokens=16, eos_token_id=[]).sequences[0]
    assert len(ours) == 16
    assert_same_greedy(ours, hf_greedy(torch_model, prompt, 16, None), torch_model, prompt)


def test_save_round_trip(checkpoint, tmp_path):
  path, torch_model = checkpoint("capped")
  model = hf.load_hf_dir(path)
  hf.save_hf(model, tmp_path / "export")
  assert hf.load_hf_dir(tmp_path / "export").config == model.config
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                               attn_implementation="eager")
  assert type(exported) is modeling_gemma3.Gemma3ForCausalLM
  np.testing.assert_array_equal(torch_logits(exported, IDS), torch_logits(torch_model, IDS))


# ------------------------------------------------------------------ config


def test_config_defaults_as_transformers():
  """What Gemma3TextConfig assumes when config.json leaves a key out."""
  config = hf.config_from_hf(dict(model_type="gemma3_text", vocab_size=100, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=7,
                                  num_attention_heads=8))
  assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",) + (
      "sliding_attention",)
  assert (config.rope_theta, config.rope_scaling) == (1e6, RopeScaling())
  assert (config.sliding_rope_theta, config.sliding_window) == (1e4, 4096)
  assert (config.head_dim, config.num_kv_heads, config.query_pre_attn_scalar) == (256, 4, 256)
  assert config.tie_word_embeddings and config.qk_norm and config.final_logit_softcapping is None


GEMMA3_BASE = dict(model_type="gemma3_text", vocab_size=100, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=8)


@pytest.mark.parametrize("change,match", [
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "'chunked_attention'"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries for num_layers=2"),
    (dict(sliding_window=None), "sliding_window is None"),
    (dict(rope_parameters={"full_attention": dict(rope_type="yarn", factor=4.0)}),
     "'yarn' for full_attention layers"),
    (dict(rope_parameters={"sliding_attention": dict(rope_type="dynamic", factor=2.0)}),
     "'dynamic' for sliding_attention layers"),
    (dict(rope_scaling=dict(type="longrope", factor=2.0)), "'longrope' for full_attention"),
    (dict(rope_parameters=dict(rope_type="linear", factor=2.0)), "keyed by layer type"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(model_type="gemma3"), "multimodal"),
    (dict(sliding_window_pattern="6"), "sliding_window_pattern must be an integer"),
])
def test_config_errors(change, match):
  with pytest.raises(CheckpointError, match=match):
    hf.config_from_hf({**GEMMA3_BASE, **change})


def test_model_config_errors():
  base = dict(family="gemma3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, sliding_window=4)
  with pytest.raises(MdjaxError, match="'local'"):
    ModelConfig(**base, layer_types=("local", "full_attention"))
  with pytest.raises(MdjaxError, match="'yarn'"):
    ModelConfig(**base, sliding_rope_scaling=RopeScaling(rope_type="yarn"))
  with pytest.raises(MdjaxError, match="qk_norm=True"):
    ModelConfig(**{**base, "qk_norm": False})
  with pytest.raises(MdjaxError, match="gemma2"):
    ModelConfig(**{**base, "family": "gemma2"})


# ------------------------------------------------------------------ strategies


@pytest.fixture(scope="module")
def gemma3():
  """Three layers (sliding, full, sliding) with a window of 4: shorter than the contexts."""
  return random_model("gemma3", 3, layers=3, **GEMMA3_MIXED)


@pytest.mark.parametrize("attention", ["block_sparse", "dense"])
def test_multi_question_answers_equal_greedy_on_context_plus_question(gemma3, attention):
  rng = np.random.default_rng(0)
  context = rng.integers(3, 64, 9).tolist()
  questions = [rng.integers(3, 64, n).tolist() for n in (3, 1, 5)]
  out = mdjax.generate(gemma3, context, strategy="multi_question", questions=questions,
                       max_new_tokens=12, eos_token_id=[], attention=attention)
  assert out.sequences == [mdjax.generate(gemma3, context + q, max_new_tokens=12,
                                          eos_token_id=[]).sequences[0] for q in questions]


@pytest.mark.parametrize("strategy,options", [
    ("speculative", dict(num_draft_tokens=3)),  # the draft: another random gemma3
    ("self_speculative", dict(draft_layers=1, num_draft_tokens=3)),  # a sliding layer drafts
    ("prompt_lookup", dict(prompt_lookup_num_tokens=3)),
])
def test_lossless_strategies_equal_greedy(gemma3, strategy, options):
  if strategy == "speculative":
    options = dict(options, draft=random_model("gemma3", 8, layers=3, **GEMMA3_MIXED))
  rng = np.random.default_rng(2)
  prompts = [rng.integers(3, 64, n).tolist() for n in (9, 2, 5)]
  prompts[0] = prompts[0] + prompts[0]  # something for prompt lookup to find
  greedy = mdjax.generate(gemma3, prompts, max_new_tokens=20, eos_token_id=[])
  out = mdjax.generate(gemma3, prompts, strategy=strategy, max_new_tokens=20, eos_token_id=[],
                       **options)
  assert out.sequences == greedy.sequences
