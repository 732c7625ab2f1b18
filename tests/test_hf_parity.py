"""Hugging Face loader/exporter: logits parity with transformers, round trips, bad input."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import huggingface_hub
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
import torch
import transformers

from helpers import edit_config, mdjax_logits, torch_logits, write_tiny_checkpoint
from mdjax.checkpoints import hf, hf_layout
from mdjax.errors import CheckpointError, MdjaxError
from mdjax.models.config import RopeScaling
from mdjax.models.model import Model

torch.set_grad_enabled(False)

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)
LINEAR_ROPE = dict(rope_type="linear", rope_theta=5000.0, factor=4.0)

# variant -> (family, config overrides of the tiny config: 4 heads, 2 kv heads, head_dim 16)
VARIANTS = {
    "llama_gqa": ("llama", {}),
    "llama_mha": ("llama", dict(num_key_value_heads=4)),
    "llama_head_dim": ("llama", dict(head_dim=24)),
    "llama_llama3_rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama_linear_rope": ("llama", dict(rope_parameters=LINEAR_ROPE)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True)),
    "mistral_window": ("mistral", dict(sliding_window=8)),
}
IDS = np.random.default_rng(0).integers(0, 192, 20)  # 20 tokens: past the window of 8, past 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """variant -> (directory, torch model), written once per module on first use."""
  made = {}

  def get(variant):
    if variant not in made:
      family, overrides = VARIANTS[variant]
      path = tmp_path_factory.mktemp(variant)
      made[variant] = (path, write_tiny_checkpoint(path, family, **overrides))
    return made[variant]

  return get


@pytest.fixture
def broken(checkpoint, tmp_path):
  """A fresh copy of the llama_gqa checkpoint to damage."""
  path = tmp_path / "ckpt"
  shutil.copytree(checkpoint("llama_gqa")[0], path)
  return path


def assert_parity(model, torch_model, ids=IDS):
  expected = torch_logits(torch_model, ids)  # [T, V]
  for attention in ("block_sparse", "dense", "fused"):
    got = mdjax_logits(model, ids, attention)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0, err_msg=attention)


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(checkpoint, variant):
  path, torch_model = checkpoint(variant)
  model = hf.load_hf_dir(path)
  assert model.path == str(path) and model.tokenizer is None
  assert model.config.family == VARIANTS[variant][0]
  np.testing.assert_allclose(model.config.inv_freq(),
                             torch_model.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
  assert ("lm_head" in model.params) == (not model.config.tie_word_embeddings)
  assert_parity(model, torch_model)


def test_parsed_variant_configs(checkpoint):
  assert hf.load_hf_dir(checkpoint("llama_head_dim")[0]).config.head_dim == 24
  assert hf.load_hf_dir(checkpoint("llama_mha")[0]).config.num_kv_heads == 4
  bias = hf.load_hf_dir(checkpoint("llama_bias")[0]).config
  assert bias.qkv_bias and bias.o_bias and bias.mlp_bias
  qwen2 = hf.load_hf_dir(checkpoint("qwen2")[0]).config
  assert qwen2.qkv_bias and not qwen2.o_bias
  assert hf.load_hf_dir(checkpoint("qwen3")[0]).config.qk_norm
  assert hf.load_hf_dir(checkpoint("mistral_window")[0]).config.sliding_window == 8
  llama3 = hf.load_hf_dir(checkpoint("llama_llama3_rope")[0]).config
  assert llama3.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=16)


def test_sliding_window_matters(checkpoint):
  """transformers really applies mistral's window of 8 to 20 tokens (else parity proves nothing)."""
  torch_model = checkpoint("mistral_window")[1]
  windowed = torch_logits(torch_model, IDS)
  torch_model.config.sliding_window = None
  try:
    unwindowed = torch_logits(torch_model, IDS)
  finally:
    torch_model.config.sliding_window = 8
  np.testing.assert_array_equal(windowed[:8], unwindowed[:8])
  assert np.abs(windowed[8:] - unwindowed[8:]).max() > 1e-3


@pytest.mark.parametrize("variant,key,scaling", [
    ("llama_llama3_rope", "type", LLAMA3_ROPE),
    ("llama_linear_rope", "rope_type", LINEAR_ROPE),
])
def test_old_config_layout(checkpoint, tmp_path, variant, key, scaling):
  """Top-level rope_theta + rope_scaling {type | rope_type, ...} gives the same model."""
  source, torch_model = checkpoint(variant)
  shutil.copytree(source, tmp_path / "old")

  def to_old_layout(config):
    del config["rope_parameters"]
    config["rope_theta"] = scaling["rope_theta"]
    rest = {k: v for k, v in scaling.items() if k not in ("rope_type", "rope_theta")}
    config["rope_scaling"] = {key: scaling["rope_type"], **rest}

  edit_config(tmp_path / "old", to_old_layout)
  model = hf.load_hf_dir(tmp_path / "old")
  assert model.config == hf.load_hf_dir(source).config
  assert_parity(model, torch_model)


def test_sharded_checkpoint(tmp_path):
  torch_model = write_tiny_checkpoint(tmp_path, "llama", seed=3, max_shard_size="20KB")
  assert (tmp_path / hf_layout.INDEX_FILE).is_file()
  assert not (tmp_path / hf_layout.WEIGHTS_FILE).exists()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  assert_parity(hf.load_hf_dir(tmp_path), torch_model)


def test_bfloat16_load(checkpoint):
  path, torch_model = checkpoint("llama_gqa")
  reference = torch_logits(torch_model, IDS)
  for dtype in ("bfloat16", jnp.bfloat16):
    model = hf.load_hf_dir(path, dtype=dtype)
    assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
  got = mdjax_logits(model, IDS)
  assert got.dtype == np.float32
  assert np.abs(got - reference).max() < 0.05 * np.abs(reference).max()


def test_bfloat16_checkpoint(checkpoint, tmp_path):
  """A checkpoint stored in bfloat16 loads exactly (upcast) into float32."""
  copy.deepcopy(checkpoint("qwen3")[1]).to(torch.bfloat16).save_pretrained(tmp_path)
  upcast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                             attn_implementation="eager")
  assert_parity(hf.load_hf_dir(tmp_path, dtype="float32"), upcast)


# ------------------------------------------------------------------ export


@pytest.mark.parametrize("variant", ["llama_bias", "llama_tied", "llama_llama3_rope", "qwen2",
                                     "qwen3_tied", "mistral_window"])
def test_save_round_trip(checkpoint, tmp_path, variant):
  path, torch_model = checkpoint(variant)
  model = hf.load_hf_dir(path)
  hf.save_hf(model, tmp_path / "export")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging dir left
  again = hf.load_hf_dir(tmp_path / "export")
  assert again.config == model.config
  assert jax.tree.structure(again.params) == jax.tree.structure(model.params)
  for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(model.params)):
    np.testing.assert_array_equal(a, b)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                               attn_implementation="eager")
  assert type(exported) is type(torch_model)
  np.testing.assert_allclose(torch_logits(exported, IDS), torch_logits(torch_model, IDS),
                             atol=1e-5, rtol=0)


def test_save_overwrites_and_bfloat16(checkpoint, tmp_path):
  model = hf.load_hf_dir(checkpoint("llama_gqa")[0])
  target = tmp_path / "export"
  target.mkdir()
  (target / "stale.txt").write_text("old")
  hf.save_hf(model, target, dtype="bfloat16")
  assert not (target / "stale.txt").exists()
  again = hf.load_hf_dir(target)
  np.testing.assert_array_equal(again.params["embed"],
                                model.params["embed"].astype(jnp.bfloat16).astype(jnp.float32))


def test_save_sharded(checkpoint, tmp_path):
  """Shards of at most 40 KB with an index: both mdjax and transformers read them."""
  path, torch_model = checkpoint("llama_gqa")
  model = hf.load_hf_dir(path)
  hf.save_hf(model, tmp_path / "export", max_shard_bytes=40_000)
  shards = sorted((tmp_path / "export").glob("model-*.safetensors"))
  assert len(shards) > 2 and not (tmp_path / "export" / "model.safetensors").exists()
  again = hf.load_hf_dir(tmp_path / "export")
  for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(model.params)):
    np.testing.assert_array_equal(a, b)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                               attn_implementation="eager")
  np.testing.assert_allclose(torch_logits(exported, IDS), torch_logits(torch_model, IDS),
                             atol=1e-5, rtol=0)


def test_save_exports_generation_config(checkpoint, tmp_path):
  model = hf.load_hf_dir(checkpoint("qwen3")[0])
  model = Model(config=dataclasses.replace(model.config, eos_token_id=(5, 7)), params=model.params)
  hf.save_hf(model, tmp_path / "export")
  generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
  assert generation["eos_token_id"] == [5, 7]
  assert hf.load_hf_dir(tmp_path / "export").config == model.config


def test_save_rejects_what_the_family_cannot_express(checkpoint, tmp_path):
  model = hf.load_hf_dir(checkpoint("llama_gqa")[0])
  model = Model(config=dataclasses.replace(model.config, qkv_bias=True), params=model.params)
  with pytest.raises(MdjaxError, match="o_bias=False"):
    hf.save_hf(model, tmp_path / "x")
  assert not list(tmp_path.iterdir())


def test_tokenizer_loaded_and_exported(checkpoint, tmp_path):
  shutil.copytree(checkpoint("llama_gqa")[0], tmp_path / "ckpt")
  vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(
      tmp_path / "ckpt")
  model = hf.load_hf_dir(tmp_path / "ckpt")
  assert model.tokenizer("hello world")["input_ids"] == [3, 4]
  hf.save_hf(model, tmp_path / "export")
  assert hf.load_hf_dir(tmp_path / "export").tokenizer("world hello")["input_ids"] == [4, 3]


# ------------------------------------------------------------------ config parsing


def test_config_from_hf_defaults_and_eos():
  base = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=8, eos_token_id=[3, 4], rope_theta=5e5,
              rope_scaling=None, head_dim=None)
  config = hf.config_from_hf(base)
  assert (config.head_dim, config.num_kv_heads, config.eos_token_id) == (8, 8, (3, 4))
  assert config.rope_theta == 5e5 and config.rope_scaling == RopeScaling()
  assert hf.config_from_hf({**base, "eos_token_id": 9}).eos_token_id == (9,)
  assert hf.config_from_hf({**base, "model_type": "mistral", "sliding_window": None}
                           ).sliding_window is None


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gpt2"), "gpt2"),
    (dict(model_type=None), "None"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "yarn"),
    (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "dynamic"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=8.0)), "low_freq_factor"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
    (dict(num_hidden_layers="2"), "num_hidden_layers"),
    (dict(num_key_value_heads=3), "num_kv_heads=3"),
])
def test_config_from_hf_rejects(change, match):
  base = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=8)
  with pytest.raises(CheckpointError, match=match):
    hf.config_from_hf({**base, **change})


# ------------------------------------------------------------------ bad checkpoints


def test_missing_path(tmp_path):
  with pytest.raises(CheckpointError, match="no-such-dir"):
    hf.load_hf_dir(tmp_path / "no-such-dir")


def test_missing_config(broken):
  (broken / "config.json").unlink()
  with pytest.raises(CheckpointError, match="config.json"):
    hf.load_hf_dir(broken)


def test_missing_weights(broken):
  (broken / hf_layout.WEIGHTS_FILE).unlink()
  with pytest.raises(CheckpointError, match=hf_layout.WEIGHTS_FILE):
    hf.load_hf_dir(broken)


def test_truncated_safetensors(broken):
  file = broken / hf_layout.WEIGHTS_FILE
  data = file.read_bytes()
  file.write_bytes(data[:len(data) // 2])
  with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
    hf.load_hf_dir(broken)


@pytest.mark.parametrize("where,garbage", [(0, b"\xff" * 8), (8, b"\x00\xfe{]\x01")])
def test_corrupt_safetensors_header(broken, where, garbage):
  file = broken / hf_layout.WEIGHTS_FILE
  data = bytearray(file.read_bytes())
  data[where:where + len(garbage)] = garbage
  file.write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match=r"corrupt safetensors file .*model\.safetensors"):
    hf.load_hf_dir(broken)


def test_unsupported_model_type(broken):
  edit_config(broken, lambda c: c.update(model_type="gpt2"))
  with pytest.raises(CheckpointError, match="gpt2"):
    hf.load_hf_dir(broken)


def test_unsupported_rope_type(broken):
  edit_config(broken, lambda c: c.update(rope_parameters=dict(rope_type="yarn", factor=4.0,
                                                                rope_theta=1e4)))
  with pytest.raises(CheckpointError, match="yarn"):
    hf.load_hf_dir(broken)


@pytest.mark.parametrize("tensor,match", [
    ("model.layers.1.mlp.up_proj.weight", r"layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"),
    ("lm_head.weight", "lm_head.weight"),  # the model is untied: the head is required
])
def test_missing_tensor(broken, tensor, match):
  file = broken / hf_layout.WEIGHTS_FILE
  tensors = safetensors.numpy.load_file(file)
  del tensors[tensor]
  safetensors.numpy.save_file(tensors, file)
  with pytest.raises(CheckpointError, match=match):
    hf.load_hf_dir(broken)


def test_tensor_dtype_numpy_cannot_hold(broken):
  file = broken / hf_layout.WEIGHTS_FILE
  tensors = safetensors.numpy.load_file(file)
  tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(ml_dtypes.float8_e4m3fn)
  safetensors.numpy.save_file(tensors, file)
  with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*F8_E4M3.*model\.safetensors"):
    hf.load_hf_dir(broken)


def test_missing_tensor_in_shard_index(tmp_path):
  write_tiny_checkpoint(tmp_path, "llama", seed=3, max_shard_size="20KB")
  index = json.loads((tmp_path / hf_layout.INDEX_FILE).read_text())
  del index["weight_map"]["model.norm.weight"]
  (tmp_path / hf_layout.INDEX_FILE).write_text(json.dumps(index))
  with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*index"):
    hf.load_hf_dir(tmp_path)


def test_missing_shard_file(tmp_path):
  write_tiny_checkpoint(tmp_path, "llama", seed=3, max_shard_size="20KB")
  shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
  shard.unlink()
  with pytest.raises(CheckpointError, match=rf"missing safetensors shard .*{shard.name}.*index"):
    hf.load_hf_dir(tmp_path)


def test_wrong_tensor_shape(broken):
  edit_config(broken, lambda c: c.update(intermediate_size=80))
  with pytest.raises(CheckpointError, match=r"gate_proj.weight.*\[96, 64\], expected \[80, 64\]"):
    hf.load_hf_dir(broken)


def test_bad_dtype(broken):
  with pytest.raises(MdjaxError, match="int8"):
    hf.load_hf_dir(broken, dtype="int8")


# ------------------------------------------------------------------ resolve


def test_resolve_directory(broken):
  assert hf.resolve(broken) == broken
  assert hf.resolve(str(broken)) == broken


def test_resolve_shipped_name(monkeypatch, tmp_path):
  (tmp_path / "tiny").mkdir()
  (tmp_path / "tiny" / "config.json").write_text("{}")
  (tmp_path / "not-a-model").mkdir()
  monkeypatch.setattr(hf, "ASSETS_DIR", tmp_path)
  assert hf.shipped_names() == ["tiny"]
  assert hf.resolve("tiny") == tmp_path / "tiny"
  with pytest.raises(CheckpointError, match="'nope'; known names: tiny, random-llama"):
    hf.resolve("nope")


def test_resolve_unknown_name():
  with pytest.raises(CheckpointError, match="no such model directory or known name: 'no-such-mod"):
    hf.resolve("no-such-model")


def test_resolve_hub_failure(monkeypatch):
  def offline(repo_id, **kwargs):
    assert kwargs["allow_patterns"] == hf.HUB_PATTERNS
    raise OSError("offline")

  monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
  with pytest.raises(CheckpointError, match="some-org/some-model.*offline"):
    hf.resolve("some-org/some-model")
