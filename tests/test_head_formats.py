"""Heads in public layouts (`mdjax.heads.formats`): FasterDecoding's and vLLM's Medusa,
SafeAILab's EAGLE-1.

Each test writes small random heads the way those projects store them (torch `Linear`
weights `[out, in]`, written with `safetensors.numpy`), imports them and checks the
outputs against an independent reference: a numpy Medusa head, and one EAGLE decoder
layer in numpy and in transformers' PyTorch llama. Round trips export -> import give
identical params and the files they came from; bad directories raise errors naming
the tensor or file.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import safetensors.numpy

import mdjax
from mdjax.heads import eagle_causal, init_heads, medusa_logits
from mdjax.heads.formats import LAYOUTS, detect_layout, export_heads, import_heads

TINY = "random-llama-tiny"  # llama, hidden 64, vocab 256, 4 heads of 16, 2 kv heads
D, V = 64, 256
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
  return mdjax.load(TINY, dtype="float32")


def normal(rng, *shape, scale=0.1):
  return (scale * rng.standard_normal(shape)).astype(np.float32)


def write_dir(path, file, tensors, config):
  path.mkdir(parents=True, exist_ok=True)
  safetensors.numpy.save_file(tensors, str(path / file))
  (path / "config.json").write_text(json.dumps(config))
  return path


def read_dir(path, file):
  return (safetensors.numpy.load_file(str(path / file)),
          json.loads((path / "config.json").read_text()))


def same_params(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  return tree_a == tree_b and all(np.array_equal(np.asarray(x), np.asarray(y))
                                  for x, y in zip(leaves_a, leaves_b))


def assert_same_tensors(found, expected):
  assert sorted(found) == sorted(expected)
  for name, tensor in expected.items():
    np.testing.assert_array_equal(found[name], tensor, err_msg=name)


def unembedding(model):  # the model's lm_head as torch stores it, [V, D]
  return np.asarray(model.params["lm_head"]).T


# --------------------------------------------------------------------------- medusa


def medusa_tensors(block, head, heads=3, layers=2, seed=0, bias=True):
  """Random Medusa tensors under `block.format(k, l)` / `head.format(k, L)` names."""
  rng = np.random.default_rng(seed)
  tensors = {}
  for k in range(heads):
    for l in range(layers):
      tensors[block.format(k=k, l=l) + ".weight"] = normal(rng, D, D)
      if bias:
        tensors[block.format(k=k, l=l) + ".bias"] = normal(rng, D)
    tensors[head.format(k=k, L=layers) + ".weight"] = normal(rng, V, D)
  return tensors


def write_fasterdecoding(path, heads=3, layers=2, base=TINY, seed=0):
  tensors = medusa_tensors("{k}.{l}.linear", "{k}.{L}", heads, layers, seed)
  write_dir(path, "medusa_lm_head.safetensors", tensors,
            {"medusa_num_heads": heads, "medusa_num_layers": layers,
             "base_model_name_or_path": base})
  return tensors


def write_vllm(path, model, heads=3, layers=2, bias=True, original_lm_head=False, seed=0):
  tensors = medusa_tensors("blocks.{k}.layers.{l}", "lm_heads.{k}", heads, layers, seed, bias)
  if original_lm_head:
    for k in range(heads):
      del tensors[f"lm_heads.{k}.weight"]
    tensors["lm_heads.0.weight"] = unembedding(model)
  write_dir(path, "model.safetensors", tensors,
            {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": heads,
             "num_hidden_layers": layers, "hidden_size": D, "vocab_size": V,
             "medusa_fc_bias": bias, "original_lm_head": original_lm_head,
             "base_model_name_or_path": TINY})
  return tensors


def medusa_reference(hidden, linears, unembeddings):
  """Head k: x <- x + SiLU(W x + b) for each (W [out, in], b) of linears[k], then its
  unembedding [V, D]. hidden [N, D] -> logits [N, K, V]."""
  out = []
  for blocks, u in zip(linears, unembeddings):
    x = hidden.astype(np.float64)
    for w, b in blocks:
      z = x @ w.T + b
      x = x + z / (1 + np.exp(-z))
    out.append(x @ u.T)
  return np.stack(out, axis=-2)


def check_medusa(heads, model, tensors, block, head, heads_count=3, layers=2, shared=None):
  rng = np.random.default_rng(7)
  hidden = normal(rng, 5, D, scale=1.0)
  linears = [[(tensors[block.format(k=k, l=l) + ".weight"],
               tensors.get(block.format(k=k, l=l) + ".bias", np.zeros(D, np.float32)))
              for l in range(layers)] for k in range(heads_count)]
  unembeddings = ([shared] * heads_count if shared is not None else
                  [tensors[head.format(k=k, L=layers) + ".weight"] for k in range(heads_count)])
  found = medusa_logits(heads.params, model.params, hidden, model_config=model.config)
  assert found.shape == (5, heads_count, V)
  np.testing.assert_allclose(np.asarray(found), medusa_reference(hidden, linears, unembeddings),
                             atol=ATOL, rtol=ATOL)


def test_fasterdecoding_medusa_matches_numpy_reference(model, tmp_path):
  tensors = write_fasterdecoding(tmp_path / "fd")
  (tmp_path / "fd" / "README.md").write_text("# my medusa\n")
  assert detect_layout(tmp_path / "fd") == "medusa"
  heads = mdjax.load_heads(tmp_path / "fd")
  c = heads.config
  assert (c.family, c.base_model, c.base_family, c.num_heads, c.num_layers, c.own_unembedding,
          c.hidden_size, c.vocab_size) == ("medusa", TINY, "llama", 3, 2, True, D, V)
  assert heads.card == "# my medusa\n"
  heads.check_model(model.config)
  check_medusa(heads, model, tensors, "{k}.{l}.linear", "{k}.{L}")


@pytest.mark.parametrize("bias", [True, False], ids=["fc_bias", "no_bias"])
def test_vllm_medusa_matches_numpy_reference(model, tmp_path, bias):
  tensors = write_vllm(tmp_path / "vllm", model, bias=bias)
  assert detect_layout(tmp_path / "vllm") == "vllm-medusa"
  heads = mdjax.load_heads(tmp_path / "vllm")
  assert heads.config.own_unembedding and heads.config.base_family == "llama"
  check_medusa(heads, model, tensors, "blocks.{k}.layers.{l}", "lm_heads.{k}")


def test_vllm_original_lm_head_shares_the_models(model, tmp_path):
  tensors = write_vllm(tmp_path / "vllm", model, original_lm_head=True)
  heads = import_heads(tmp_path / "vllm", model_config=model.config)
  assert not heads.config.own_unembedding and "lm_head" not in heads.params
  check_medusa(heads, model, tensors, "blocks.{k}.layers.{l}", "lm_heads.{k}",
               shared=unembedding(model))


# --------------------------------------------------------------------------- eagle


def eagle_config_json(model, bias=True):
  """A llama config.json for a one-layer EAGLE head over `model` (EAGLE copies the base
  model's config and sets num_hidden_layers = 1)."""
  c = model.config
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "hidden_size": D, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
          "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
          "head_dim": c.head_dim, "vocab_size": V, "rms_norm_eps": c.rms_norm_eps,
          "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
          "bias": bias}


def write_eagle(path, model, seed=0, **config_overrides):
  c = model.config
  n, k, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
  rng = np.random.default_rng(seed)
  p = "layers.0."
  tensors = {"embed_tokens.weight": np.array(model.params["embed"]),
             "fc.weight": normal(rng, D, 2 * D), "fc.bias": normal(rng, D),
             p + "self_attn.q_proj.weight": normal(rng, n, D),
             p + "self_attn.k_proj.weight": normal(rng, k, D),
             p + "self_attn.v_proj.weight": normal(rng, k, D),
             p + "self_attn.o_proj.weight": normal(rng, D, n),
             p + "post_attention_layernorm.weight": 1 + normal(rng, D),
             p + "mlp.gate_proj.weight": normal(rng, f, D),
             p + "mlp.up_proj.weight": normal(rng, f, D),
             p + "mlp.down_proj.weight": normal(rng, D, f)}
  write_dir(path, "model.safetensors", tensors, {**eagle_config_json(model), **config_overrides})
  return tensors


def eagle_inputs(seed=3, length=7):
  rng = np.random.default_rng(seed)
  return rng.integers(0, V, length), normal(rng, length, D, scale=1.0)  # [T], [T, D]


def eagle_numpy_reference(t, model, tokens, features):
  """EAGLE-1 in numpy: fc(concat(embedding, feature)), then one llama decoder layer with
  no input norm (RoPE at 0..T-1, causal, grouped kv heads) and no final norm. -> [T, D]"""
  c = model.config
  nh, kh, hd = c.num_heads, c.num_kv_heads, c.head_dim
  length = len(tokens)
  x = np.concatenate([t["embed_tokens.weight"][tokens], features], -1) @ t["fc.weight"].T
  x = (x + t["fc.bias"]).astype(np.float64)
  p = "layers.0."
  q = (x @ t[p + "self_attn.q_proj.weight"].T).reshape(length, nh, hd)
  k = (x @ t[p + "self_attn.k_proj.weight"].T).reshape(length, kh, hd)
  v = (x @ t[p + "self_attn.v_proj.weight"].T).reshape(length, kh, hd)
  angles = np.arange(length)[:, None] / c.rope_theta ** (np.arange(0, hd, 2) / hd)  # [T, H/2]
  cos = np.cos(np.concatenate([angles, angles], -1))[:, None]  # [T, 1, H]
  sin = np.sin(np.concatenate([angles, angles], -1))[:, None]

  def rope(a):
    return a * cos + np.concatenate([-a[..., hd // 2:], a[..., :hd // 2]], -1) * sin
  q, k = rope(q), np.repeat(rope(k), nh // kh, axis=1)
  v = np.repeat(v, nh // kh, axis=1)
  scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(hd)
  scores[:, np.triu(np.ones((length, length), bool), 1)] = -np.inf
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  attn = np.einsum("nts,snh->tnh", probs, v).reshape(length, nh * hd)
  x = x + attn @ t[p + "self_attn.o_proj.weight"].T
  h = x / np.sqrt((x**2).mean(-1, keepdims=True) + c.rms_norm_eps)
  h = h * t[p + "post_attention_layernorm.weight"]
  gate = h @ t[p + "mlp.gate_proj.weight"].T
  mlp = (gate / (1 + np.exp(-gate)) * (h @ t[p + "mlp.up_proj.weight"].T))
  return x + mlp @ t[p + "mlp.down_proj.weight"].T


def mdjax_eagle(heads, model, tokens, features):
  return np.asarray(eagle_causal(heads.params, model.params, tokens[None], features[None],
                                 model_config=model.config))[0]


def test_eagle_imports_in_eagle1_shape(model, tmp_path):
  write_eagle(tmp_path / "eagle", model)
  assert detect_layout(tmp_path / "eagle") == "eagle"
  heads = mdjax.load_heads(tmp_path / "eagle")
  c = heads.config
  assert (c.family, c.base_family, c.num_layers, c.hidden_size, c.vocab_size) == (
      "eagle", "llama", 1, D, V)
  assert "final_norm" not in heads.params and "attn_norm" not in heads.params["layers"][0]
  heads.check_model(model.config)


def test_eagle_matches_numpy_reference(model, tmp_path):
  tensors = write_eagle(tmp_path / "eagle", model)
  heads = import_heads(tmp_path / "eagle", model_config=model.config)
  tokens, features = eagle_inputs()
  np.testing.assert_allclose(mdjax_eagle(heads, model, tokens, features),
                             eagle_numpy_reference(tensors, model, tokens, features),
                             atol=ATOL, rtol=ATOL)


def test_eagle_matches_transformers_llama_layer(model, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.llama import modeling_llama
  tensors = write_eagle(tmp_path / "eagle", model)
  heads = import_heads(tmp_path / "eagle", model_config=model.config)
  tokens, features = eagle_inputs()
  cfg = transformers.LlamaConfig(**{k: v for k, v in eagle_config_json(model).items()
                                    if k != "bias"})
  cfg._attn_implementation = "eager"
  layer = modeling_llama.LlamaDecoderLayer(cfg, layer_idx=0)
  layer.input_layernorm = torch.nn.Identity()  # EAGLE-1's first layer has no input norm
  layer.load_state_dict({name.removeprefix("layers.0."): torch.from_numpy(t)
                         for name, t in tensors.items() if name.startswith("layers.0.")})
  fc = torch.nn.Linear(2 * D, D)
  fc.load_state_dict({"weight": torch.from_numpy(tensors["fc.weight"]),
                      "bias": torch.from_numpy(tensors["fc.bias"])})
  with torch.no_grad():
    embedded = torch.from_numpy(tensors["embed_tokens.weight"])[torch.from_numpy(tokens)]
    x = fc(torch.cat([embedded, torch.from_numpy(features)], -1))[None]  # [1, T, D]
    positions = torch.arange(len(tokens))[None]
    cos_sin = modeling_llama.LlamaRotaryEmbedding(cfg)(x, positions)
    mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
    out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
  out = out[0] if isinstance(out, tuple) else out
  np.testing.assert_allclose(mdjax_eagle(heads, model, tokens, features), out[0].numpy(),
                             atol=ATOL, rtol=ATOL)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout, file, writer", [
    ("medusa", "medusa_lm_head.safetensors", lambda p, m: write_fasterdecoding(p)),
    ("vllm-medusa", "model.safetensors", lambda p, m: write_vllm(p, m)),
    ("vllm-medusa", "model.safetensors", lambda p, m: write_vllm(p, m, original_lm_head=True)),
    ("eagle", "model.safetensors", write_eagle),
], ids=["fasterdecoding", "vllm", "vllm_original_lm_head", "eagle"])
def test_round_trip_gives_the_same_files_and_params(model, tmp_path, layout, file, writer):
  tensors = writer(tmp_path / "in", model)
  heads = import_heads(tmp_path / "in", model_config=model.config)
  export_heads(heads, tmp_path / "out", layout, model=model)
  found, config = read_dir(tmp_path / "out", file)
  assert_same_tensors(found, tensors)
  assert detect_layout(tmp_path / "out") == layout
  again = import_heads(tmp_path / "out", model_config=model.config)
  assert again.config == heads.config
  assert same_params(again.params, heads.params)
  if layout != "eagle":
    written = json.loads((tmp_path / "in" / "config.json").read_text())
    assert {k: config[k] for k in written} == written


@pytest.mark.parametrize("layout", ["medusa", "vllm-medusa"])
def test_mdjax_medusa_heads_export_and_import(model, tmp_path, layout):
  config = mdjax.HeadsConfig(family="medusa", base_model=TINY, base_family="llama",
                             hidden_size=D, vocab_size=V, num_heads=2, num_layers=1,
                             own_unembedding=True)
  heads = init_heads(config, model.config, seed=1)
  rng = np.random.default_rng(0)
  heads = mdjax.Heads(config=config, params={
      **heads.params, "blocks": {"w": normal(rng, 2, 1, D, D), "b": normal(rng, 2, 1, D)}})
  export_heads(heads, tmp_path / "out", layout)
  again = mdjax.load_heads(tmp_path / "out")
  assert again.config == config
  assert same_params(again.params, heads.params)


def test_shared_unembedding_exports_the_models(model, tmp_path):
  """FasterDecoding's layout has no shared unembedding: each head gets a copy."""
  config = mdjax.HeadsConfig(family="medusa", base_model=TINY, base_family="llama",
                             hidden_size=D, vocab_size=V, num_heads=2)
  heads = init_heads(config, model.config)
  with pytest.raises(mdjax.MdjaxError, match="pass model="):
    export_heads(heads, tmp_path / "out", "medusa")
  export_heads(heads, tmp_path / "out", "medusa", model=model)
  again = mdjax.load_heads(tmp_path / "out")
  assert again.config.own_unembedding
  for k in range(2):
    np.testing.assert_array_equal(np.asarray(again.params["lm_head"][k]),
                                  np.asarray(model.params["lm_head"]))


# --------------------------------------------------------------------------- bad input


def test_missing_tensor_is_named(model, tmp_path):
  write_fasterdecoding(tmp_path / "fd")
  tensors, config = read_dir(tmp_path / "fd", "medusa_lm_head.safetensors")
  del tensors["1.0.linear.bias"]
  write_dir(tmp_path / "fd", "medusa_lm_head.safetensors", tensors, config)
  with pytest.raises(mdjax.CheckpointError, match=r"missing tensor '1\.0\.linear\.bias'"):
    mdjax.load_heads(tmp_path / "fd")


def test_wrong_shape_is_named(model, tmp_path):
  tensors = write_eagle(tmp_path / "eagle", model)
  tensors["layers.0.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"][:, :-1]
  write_dir(tmp_path / "eagle", "model.safetensors", tensors, eagle_config_json(model))
  shape = r"has shape \[128, 63\], expected \[128, 64\]"
  with pytest.raises(mdjax.CheckpointError, match=r"'layers\.0\.mlp\.up_proj\.weight'.*" + shape):
    mdjax.load_heads(tmp_path / "eagle")


def test_tensor_the_config_does_not_describe_is_named(tmp_path):
  write_fasterdecoding(tmp_path / "fd", heads=3)
  config = json.loads((tmp_path / "fd" / "config.json").read_text())
  (tmp_path / "fd" / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 2}))
  with pytest.raises(mdjax.CheckpointError, match=r"unexpected tensor '2\.0\.linear\.bias'"):
    mdjax.load_heads(tmp_path / "fd")


@pytest.mark.parametrize("pickle, config", [
    ("pytorch_model.bin", {"model_type": "llama"}),
    ("pytorch_model.bin", {"model_type": "medusa"}),
    ("medusa_lm_head.pt", {"medusa_num_heads": 1, "medusa_num_layers": 1}),
], ids=["eagle_bin", "vllm_bin", "medusa_pt"])
def test_torch_pickles_are_refused_with_a_conversion_hint(tmp_path, pickle, config):
  (tmp_path / pickle).write_bytes(b"not read")
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(mdjax.CheckpointError, match=rf"{pickle} is a torch pickle.*safetensors"):
    mdjax.load_heads(tmp_path)


def test_eagle_config_that_is_not_the_models_is_refused(model, tmp_path):
  write_eagle(tmp_path / "eagle", model, rope_theta=500000.0)
  with pytest.raises(mdjax.CheckpointError, match="rope_theta=500000.0"):
    import_heads(tmp_path / "eagle", model_config=model.config)


def test_unknown_base_model_needs_the_model_config(model, tmp_path):
  write_fasterdecoding(tmp_path / "fd", base="lmsys/vicuna-7b-v1.3")
  with pytest.raises(mdjax.CheckpointError, match="model_config=model.config"):
    mdjax.load_heads(tmp_path / "fd")
  heads = import_heads(tmp_path / "fd", model_config=model.config)
  assert (heads.config.base_model, heads.config.base_family) == ("lmsys/vicuna-7b-v1.3", "llama")


def test_bad_layouts_and_exports(model, tmp_path):
  with pytest.raises(mdjax.MdjaxError, match="unknown heads layout 'hydra'"):
    import_heads(tmp_path, layout="hydra")
  (tmp_path / "empty").mkdir()
  with pytest.raises(mdjax.CheckpointError, match="no heads at"):
    mdjax.load_heads(tmp_path / "empty")
  with pytest.raises(mdjax.CheckpointError, match="no heads in a known layout"):
    import_heads(tmp_path / "empty")
  eagle = init_heads(mdjax.HeadsConfig(family="eagle", base_model=TINY, base_family="llama",
                                       hidden_size=D, vocab_size=V), model.config)
  write_fasterdecoding(tmp_path / "kept")
  before = sorted(p.name for p in (tmp_path / "kept").iterdir())
  with pytest.raises(mdjax.MdjaxError, match="no final norm"):  # init_eagle adds one
    export_heads(eagle, tmp_path / "kept", "eagle", model=model)
  with pytest.raises(mdjax.MdjaxError, match="needs the model"):
    export_heads(eagle, tmp_path / "kept", "eagle")
  with pytest.raises(mdjax.MdjaxError, match="holds medusa heads; these are eagle heads"):
    export_heads(eagle, tmp_path / "kept", "medusa")
  assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == before  # untouched
  assert LAYOUTS == ("medusa", "vllm-medusa", "eagle", "eagle3", "speculators")
