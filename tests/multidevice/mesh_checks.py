"""Sharded == one device, on a simulated mesh of 8 CPU devices.

JAX fixes its device count when its backend starts, so these run in a process of
their own: `tests/test_sharding.py` starts pytest on this file (its name keeps the
main run from collecting it). Without 8 devices every check fails at import.
Every registered strategy on a 2x4 mesh is checked across two processes, which share
one such mesh, by `tests/test_distributed.py`.
"""

import dataclasses
import re
import types

import jax

jax.config.update("jax_num_cpu_devices", 8)
if len(jax.devices()) != 8:
  raise RuntimeError(f"the mesh checks need 8 CPU devices, got {jax.devices()}")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import mdjax  # noqa: E402
from mdjax import sharding  # noqa: E402
from mdjax.checkpoints import gguf as gguf_reader  # noqa: E402
from mdjax.checkpoints import gguf_native, hf, hf_layout  # noqa: E402
from mdjax.checkpoints.registry import RANDOM_MODELS  # noqa: E402
from mdjax.models.layer_loop import with_layer_loop  # noqa: E402
from mdjax.models.quantized import quantize_params  # noqa: E402
from tests import helpers  # noqa: E402
from tests.gguf_files import write_gguf  # noqa: E402

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
KV_HEADS = (1, 2, 8)
VOCAB = 250  # not divisible by a tensor axis of 4 or 8: padded and masked
# 8 ragged rows: every data axis here (2, 4, 8) splits them (a count that an axis does not
# divide is replicated over it, `mdjax.sharding.spec`: 4 rows on 8x1 would shard nothing)
PROMPTS = [[5, 6, 7, 8, 9, 10], [3, 4, 5], [7, 7, 7, 7], [1, 2], [11, 12, 13, 14, 15], [9],
           [2, 8, 2, 8], [4, 6, 8]]


def tiny_config(num_kv_heads: int, num_layers: int = 2):
  return dataclasses.replace(RANDOM_MODELS["random-llama-tiny"], num_heads=8,
                             num_kv_heads=num_kv_heads, head_dim=8, vocab_size=VOCAB,
                             num_layers=num_layers)


def random_model(num_kv_heads: int, num_layers: int = 2, seed: int = 0) -> mdjax.Model:
  config = tiny_config(num_kv_heads, num_layers)
  return mdjax.Model(config=config, params=mdjax.init_params(config, seed, std=0.2),
                     name=f"tiny-kv{num_kv_heads}")


def requests(model: mdjax.Model, draft: mdjax.Model) -> dict:
  """Every strategy family the issue names: name -> generate's keyword arguments. A
  request has a cache row per prompt (beam's beams and multi_question's questions are
  branches in their prompt's row), 8 or 4: a data axis of 2 or 4 splits every one."""
  return {
      "greedy": dict(prompts=PROMPTS),
      "sample": dict(prompts=PROMPTS, strategy="sample", temperature=0.9, top_k=40, top_p=0.9,
                     min_p=0.02, seed=3),
      "beam": dict(prompts=PROMPTS[:4], strategy="beam", num_beams=3),
      "multi_question": dict(prompts=[[4, 5, 6, 7, 8], [6, 5, 4], [9, 9], [3, 1, 4, 1, 5]],
                             strategy="multi_question",
                             questions=[[[9, 10], [11], [12, 13, 14], [15]], [[16, 17], [18]],
                                        [[19], [20, 21], [22]], [[23, 24]]]),
      "speculative": dict(prompts=PROMPTS, strategy="speculative", draft=draft,
                          num_draft_tokens=3),
      "medusa": dict(prompts=PROMPTS, strategy="medusa",
                     heads=helpers.random_medusa_heads(model, 2)),
  }


def outputs(model, draft, names=None) -> dict:
  """name -> (sequences, beam hypotheses' tokens, their scores) of each request."""
  result = {}
  for name, request in requests(model, draft).items():
    if names is not None and name not in names:
      continue
    request = dict(request)
    out = mdjax.generate(model, request.pop("prompts"), max_new_tokens=10, eos_token_id=[],
                         **request)
    beams = [h for hypotheses in out.beams or [] for h in hypotheses]
    result[name] = (out.sequences, [h["tokens"] for h in beams], [h["score"] for h in beams])
  return result


def assert_same(got: dict, expected: dict):
  """Identical tokens; beam scores (float sums) within 1e-5. A lossless strategy's
  reference is one device's greedy (`REFERENCE`)."""
  for name, (sequences, beam_tokens, beam_scores) in got.items():
    want = expected["greedy" if name in helpers.LOSSLESS else name]
    assert sequences == want[0], name
    assert beam_tokens == want[1], name
    np.testing.assert_allclose(beam_scores, want[2], atol=1e-5, rtol=0)


# The one-device references: greedy and the strategies whose tokens are their own. A
# lossless strategy (speculative, medusa) gives greedy's tokens at temperature 0 on one
# device (test_speculative.py, test_medusa.py, test_layer_loop.py): on a mesh it is held
# to one device's greedy, as test_distributed.py holds every lossless one on two processes.
REFERENCE = ["greedy", "sample", "beam", "multi_question"]


class References(dict):
  """`REFERENCE` name -> one device's `outputs` of it, computed when a check first reads
  it: only the references some mesh check compares with are compiled."""

  def __init__(self, model: mdjax.Model, draft: mdjax.Model):
    super().__init__()
    self.model, self.draft = model, draft

  def __missing__(self, name: str):
    self[name] = outputs(self.model, self.draft, [name])[name]
    return self[name]


@pytest.fixture(scope="module")
def one_device():
  """Per KV-head count: the unsharded model, its draft, logits and `References`."""
  found = {}
  for kv in KV_HEADS:
    model, draft = random_model(kv), random_model(kv, num_layers=1, seed=1)
    found[kv] = (model, draft, mdjax.forward_logits(model, PROMPTS[0]), References(model, draft))
  return found


def split_axes(shape, kv: int) -> frozenset[str]:
  """The axes of the layout mesh (data, tensor_kv, tensor_q) longer than 1 for `kv` KV
  heads on the mesh `shape`: what the rules shard over."""
  mesh = sharding.layout_mesh(jax.make_mesh(shape, ("data", "tensor")), kv)
  return frozenset(axis for axis in sharding.LAYOUT_AXES if mesh.shape[axis] > 1)


# The logits and greedy of one device on every kind of layout mesh that the three KV-head
# counts make on the four meshes: each combination of split axes (test_the_cases_...).
# Seven combinations: on 1x8, 1, 2 and 8 KV heads split tensor_q, both tensor axes and
# tensor_kv; on 2x4, each of these and data; on 8x1, data alone (there a KV-head count
# splits nothing). The other (mesh, count) pairs split the same axes as one of these, in
# other sizes: they shard every weight, the cache and each step alike, a compile more for
# no case. On 4x2, 1 KV head splits data and tensor_q, as on 2x4; 2 and 8 split data and
# tensor_kv, as 8 on 2x4.
CASES = [((1, 8), 1), ((1, 8), 2), ((1, 8), 8), ((2, 4), 1), ((2, 4), 2), ((2, 4), 8),
         ((8, 1), 2)]
# Every strategy family on the one of them that splits every axis: 2x4 with 2 KV heads
# (rows over data 2; the KV heads over tensor_kv 2, the query heads over tensor 4; the 250
# vocabulary rows padded to 252, over tensor 4). A strategy's own steps (sampling, beam
# reordering, branches, drafts, heads) meet the mesh only through its rows, split over
# data, and its vocabulary and heads, split over tensor. Another mesh splits the same
# arrays in other sizes (1x8: the tensor axis alone, 8 ways; 4x2: the rows 4 ways), sizes
# whose sharded steps greedy meets above as every strategy's step does: a second mesh
# would compile each family again for no case. The KV-head count changes only how the
# model's attention reads the cache, the same for every strategy as for greedy (above);
# every registered strategy runs on a 2x4 mesh across two processes too
# (test_distributed.py). So one device's references are greedy for 1 and 8 KV heads,
# every family for 2.
EVERY_STRATEGY = {(2, 4): 2}


def test_the_cases_split_every_combination_of_axes():
  every = {split_axes(shape, kv) for shape in MESHES for kv in KV_HEADS}
  assert len(every) == 7 and {split_axes(*case) for case in CASES} == every
  assert set(EVERY_STRATEGY.items()) <= set(CASES)
  assert all(split_axes(*case) == set(sharding.LAYOUT_AXES) for case in EVERY_STRATEGY.items())


@pytest.mark.parametrize("shape, kv", CASES, ids=[f"{d}x{t}-kv{kv}" for (d, t), kv in CASES])
def test_a_mesh_gives_the_logits_and_tokens_of_one_device(one_device, shape, kv):
  model, draft, logits, expected = one_device[kv]
  mesh = jax.make_mesh(shape, ("data", "tensor"))  # JAX's default axis types: explicit
  sharded, sharded_draft = mdjax.shard(model, mesh), mdjax.shard(draft, mesh)
  np.testing.assert_allclose(mdjax.forward_logits(sharded, PROMPTS[0]), logits, atol=1e-5,
                             rtol=0)
  names = None if EVERY_STRATEGY.get(shape) == kv else ["greedy"]
  assert_same(outputs(sharded, sharded_draft, names), expected)


def test_an_auto_mesh_gives_the_tokens_of_one_device(one_device):
  """The layout mesh has auto axes whatever the user's were: greedy's program on an auto
  2x4 mesh is the explicit one's. (An unsharded draft: the scan check below.)"""
  model, _, _, expected = one_device[2]
  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
  assert_same(outputs(mdjax.shard(model, mesh), None, ["greedy"]), expected)


def assert_spec(x: jax.Array, *parts):
  spec = tuple(x.sharding.spec)
  assert spec + (None,) * (x.ndim - len(spec)) == parts + (None,) * (x.ndim - len(parts))


def test_a_scan_model_and_an_unsharded_draft_on_a_mesh_equal_one_device(one_device):
  """Layers stacked (one more, replicated axis) and scanned over a sharded cache; the
  speculative draft given unsharded, replicated onto the mesh by `generate`. (Beam's
  reordering of the cache is outside the layer loop, the same whatever its layout: the
  unrolled case above.)"""
  model, draft, logits, expected = one_device[2]
  scan = dataclasses.replace(model, params=with_layer_loop(model.params, "scan"))
  sharded = mdjax.shard(scan, jax.make_mesh((2, 4), ("data", "tensor")))
  assert_spec(sharded.params["layers"]["wq"], None, None, ("tensor_kv", "tensor_q"))
  np.testing.assert_allclose(mdjax.forward_logits(sharded, PROMPTS[0]), logits, atol=1e-5,
                             rtol=0)
  assert_same(outputs(sharded, draft, ["greedy", "speculative"]), expected)


def test_weights_and_cache_are_sharded_by_the_rules():
  model = mdjax.shard(random_model(2), jax.make_mesh((2, 4), ("data", "tensor")))
  layer = model.params["layers"][0]
  tensor = ("tensor_kv", "tensor_q")
  assert_spec(layer["wq"], None, tensor)  # 8 query heads over 4
  assert_spec(layer["wk"], None, "tensor_kv")  # 2 KV heads over a sub-axis of 2
  assert_spec(layer["wo"], tensor, None)
  assert_spec(layer["w_down"], tensor, None)
  assert_spec(layer["attn_norm"], None)
  assert model.params["embed"].shape == (252, 64)  # 250 padded to a multiple of 4
  assert_spec(model.params["embed"], tensor, None)
  assert model.layout.mesh.shape == {"data": 2, "tensor_kv": 2, "tensor_q": 2}
  with sharding.active(model.layout):
    cache = jax.jit(lambda: mdjax.KVCache.create(model.config, 4, 16))()
  assert_spec(cache.k, None, "data", None, "tensor_kv", None)
  assert_spec(cache.seg, "data", None)
  assert_spec(cache.length, "data")
  shard_shape = cache.k.sharding.shard_shape(cache.k.shape)
  assert shard_shape == (2, 2, 16, 1, 8)


def test_decode_step_donates_a_sharded_cache(recwarn):
  model = mdjax.load("random-llama-tiny", mesh=jax.make_mesh((2, 4), ("data", "tensor")))
  tokens = np.ones((4, 3), np.int32)
  positions = np.tile(np.arange(3, dtype=np.int32), (4, 1))
  with sharding.active(model.layout):
    cache = mdjax.KVCache.create(model.config, 4, 32)
    logits, _, new_cache = mdjax.decode_step(model.params, cache, tokens, positions,
                                             np.zeros((4, 3), np.int32),
                                             mdjax.Topology.causal(4), config=model.config)
  assert cache.k.is_deleted()  # donated and reused in place
  assert not [w for w in recwarn if "donated" in str(w.message)]
  assert_spec(new_cache.k, None, "data", None, "tensor_kv")
  assert_spec(logits, "data", None, ("tensor_kv", "tensor_q"))  # vocabulary-sharded logits


def _all_gather_shapes(hlo: str) -> set[tuple[int, ...]]:
  """The result shapes of every all-gather in an HLO text."""
  shapes = set()
  for match in re.finditer(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo):
    shapes.add(tuple(int(d) for d in match.group(1).split(",") if d))
  return shapes


@pytest.mark.parametrize("kv", [2, 8])
def test_no_step_gathers_a_weight_or_the_cache(kv):
  model = mdjax.shard(random_model(kv), jax.make_mesh((2, 4), ("data", "tensor")))
  mdjax.clear_compiled()
  out = mdjax.generate(model, PROMPTS, max_new_tokens=10, eos_token_id=[])
  (program,) = mdjax.compiled_programs()
  gathered = _all_gather_shapes(program.as_text())
  assert gathered, "expected some all-gathers of activations; the parser found none"
  weights = {tuple(x.shape) for x in jax.tree.leaves(model.params)}
  weights |= {s[1:] for s in weights if len(s) > 1}  # a stacked layer's one layer
  c = model.config
  rows = len(PROMPTS)
  slots = out.stats["kv_cache_bytes"] // (2 * c.num_layers * rows * kv * c.head_dim * 4)
  cache = {(c.num_layers, rows, slots, kv, 8), (rows, slots, kv, 8), (1, rows, slots, kv, 8)}
  assert not gathered & weights, f"weights all-gathered: {gathered & weights}"
  assert not gathered & cache, f"the cache all-gathered: {gathered & cache}"


def test_a_program_compiled_for_one_mesh_is_not_reused_on_another(one_device):
  model, _, _, expected = one_device[2]
  mdjax.clear_compiled()
  for shape in [(2, 4), (1, 8), (2, 4)]:
    sharded = mdjax.shard(model, jax.make_mesh(shape, ("data", "tensor")))
    out = mdjax.generate(sharded, PROMPTS, max_new_tokens=10, eos_token_id=[])
    assert out.sequences == expected["greedy"][0]
  assert len(mdjax.compiled_programs()) == 2  # one per mesh; the third call reused the first


def _blocks(reads, name):
  return sorted(block for read, block in reads if read == name)


def test_loading_onto_a_mesh_reads_each_shard_of_a_weight_once(tmp_path):
  """(2, 4): each weight is read in the blocks the devices hold, each block once (a
  block replicated over data is not read again), never whole where it is sharded."""
  hf.save_hf(random_model(2), tmp_path / "ckpt")
  with helpers.recorded_reads() as reads:
    loaded = mdjax.load(str(tmp_path / "ckpt"), mesh=jax.make_mesh((2, 4), ("data", "tensor")))
  assert len(reads) == len(set(reads))
  p = "model.layers.0."
  quarters = [(16 * i, 16 * (i + 1)) for i in range(4)]  # 8 heads x 8 over tensor 4
  assert _blocks(reads, p + "self_attn.q_proj.weight") == [(q, (0, 64)) for q in quarters]
  assert _blocks(reads, p + "self_attn.k_proj.weight") == [((0, 8), (0, 64)), ((8, 16), (0, 64))]
  assert _blocks(reads, p + "mlp.down_proj.weight") == [((0, 64), (32 * i, 32 * (i + 1)))
                                                        for i in range(4)]  # columns: F over 4
  # 250 rows padded to 252, 63 per device: the last device reads 61, the rest are zeros
  assert _blocks(reads, "model.embed_tokens.weight") == [((0, 63), (0, 64)), ((63, 126), (0, 64)),
                                                         ((126, 189), (0, 64)),
                                                         ((189, 250), (0, 64))]
  assert _blocks(reads, p + "input_layernorm.weight") == [((0, 64),)]
  assert loaded.params["layers"][0]["wq"].sharding.shard_shape((64, 64)) == (64, 16)


@pytest.mark.parametrize("shape, layer_loop", [((2, 4), "scan"), ((8, 1), "unrolled")])
def test_a_load_onto_a_mesh_holds_the_bytes_of_a_one_device_load(tmp_path, shape, layer_loop):
  """(8, 1): nothing sharded, q|k|v fused: every tensor read whole, once."""
  hf.save_hf(random_model(2), tmp_path / "ckpt")
  one_device = mdjax.load(str(tmp_path / "ckpt"), layer_loop=layer_loop)
  with helpers.recorded_reads() as reads:
    loaded = mdjax.load(str(tmp_path / "ckpt"), mesh=jax.make_mesh(shape, ("data", "tensor")),
                        layer_loop=layer_loop)
  assert len(reads) == len(set(reads))
  if shape == (8, 1):
    assert len(reads) == len({name for name, _ in reads})
  jax.tree.map(np.testing.assert_array_equal,
               sharding.one_device_layout(loaded.params, loaded.config), one_device.params)


def test_a_sharded_model_saves_as_the_one_device_checkpoint(tmp_path):
  model = random_model(2)
  sharded = mdjax.shard(model, jax.make_mesh((1, 8), ("data", "tensor")))
  hf.save_hf(sharded, tmp_path / "ckpt")
  reloaded = mdjax.load(str(tmp_path / "ckpt"))
  jax.tree.map(np.testing.assert_array_equal, reloaded.params, model.params)


def test_a_mesh_without_the_axes_is_a_clear_error():
  with pytest.raises(mdjax.MdjaxError, match="axes"):
    mdjax.shard(random_model(2), jax.make_mesh((8,), ("x",)))


def test_an_int8_load_onto_a_mesh_gives_one_devices_tokens(tmp_path):
  """int8, quantized layer by layer as each process reads its shards, then stacked for
  the scanned loop: the integers lie as their float weights would (a leading layer axis
  more), and greedy gives one device's tokens (int4's groups, unrolled: the next check)."""
  hf.save_hf(random_model(2), tmp_path / "ckpt")
  one_device = mdjax.load(str(tmp_path / "ckpt"), quantize="int8", layer_loop="scan")
  loaded = mdjax.load(str(tmp_path / "ckpt"), mesh=jax.make_mesh((2, 4), ("data", "tensor")),
                      quantize="int8", layer_loop="scan")
  layer, tensor = loaded.params["layers"], ("tensor_kv", "tensor_q")
  assert_spec(layer["wq"].q, None, None, tensor)
  assert_spec(layer["wk"].q, None, None, "tensor_kv")
  assert_spec(layer["w_down"].q, None, tensor, None)
  assert_spec(loaded.params["embed"].q, tensor, None)
  run = lambda model: mdjax.generate(model, PROMPTS, max_new_tokens=10,  # noqa: E731
                                     eos_token_id=[]).sequences
  assert run(loaded) == run(one_device)


def test_a_quantized_model_with_offsets_shards_saves_and_loads_as_one_device(tmp_path):
  """int4 in groups with offsets (`quantize="int4"`, as GGUF's asymmetric blocks hold
  them; the embedding int8): placed on a mesh, its integers, scales and offsets split and
  padded by the float rules (a group axis only where the groups divide the mesh), greedy
  gives one device's tokens; saved from the mesh it is the one-device checkpoint, which
  loads onto a mesh again."""
  model = random_model(2)
  model = dataclasses.replace(model, params=quantize_params(model.params, "int4", 16),
                              quantization="int4 with offsets")
  mesh = jax.make_mesh((2, 4), ("data", "tensor"))
  sharded = mdjax.shard(model, mesh)
  layer, tensor = sharded.params["layers"][0], ("tensor_kv", "tensor_q")
  for field in ("q", "scale", "offset"):
    assert_spec(getattr(layer["wq"], field), None, tensor)
    assert_spec(getattr(layer["w_down"], field), tensor, None)  # 8 groups of 16 rows over 4
  for field in ("q", "scale"):  # int8: a scale per row
    assert_spec(getattr(sharded.params["embed"], field), tensor, None)
  assert sharded.params["embed"].q.shape == (252, 64) and sharded.params["embed"].bits == 8
  run = lambda m: mdjax.generate(m, PROMPTS, max_new_tokens=10,  # noqa: E731
                                 eos_token_id=[]).sequences
  expected = run(model)
  assert run(sharded) == expected
  hf.save_hf(sharded, tmp_path / "ckpt")
  jax.tree.map(np.testing.assert_array_equal, mdjax.load(str(tmp_path / "ckpt")).params,
               model.params)
  with helpers.recorded_reads() as reads:  # by slices: each device's share of a part
    loaded = mdjax.load(str(tmp_path / "ckpt"), mesh=mesh)
  qkv = sorted(block for name, block in reads if name == "layers.0.wqkv.q")  # saved fused
  assert qkv == [((0, 64), (lo, lo + 16)) for lo in range(0, 64, 16)] + [  # q over 4,
      ((0, 64), (lo, lo + 8)) for lo in range(64, 96, 8)], qkv            # k and v over 2
  assert len(reads) == len(set(reads))
  jax.tree.map(np.testing.assert_array_equal,
               sharding.one_device_layout(loaded.params, loaded.config), model.params)
  assert run(loaded) == expected


Q = gguf.GGMLQuantizationType
GGUF_TYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.F16, "attn_v": Q.Q4_0,
              "attn_output": Q.Q4_1, "ffn_gate": Q.Q5_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0,
              "output": Q.Q5_1}  # k in float (its rows permuted too): viewed by slices


def test_a_gguf_files_blocks_lie_on_a_mesh_decoded_shard_by_shard(tmp_path, monkeypatch):
  """quantize="gguf" onto a 2x4 mesh: every region of a file's blocks decoded is one
  device's quarter of its tensor (llama's q/k rows permuted within heads included), each
  once, and the float matrix (k) is read by halves (2 KV heads), never whole; the params
  are a one-device load's, bit for bit, greedy gives its tokens, and `save_hf` of the
  sharded model (float k beside quantized q and v) writes the one-device folder."""
  monkeypatch.setenv("MDJAX_CACHE", str(tmp_path / "cache"))  # its header: not the user's
  c = dataclasses.replace(tiny_config(2), head_dim=16)  # inputs of 128: 4 groups of 32,
  model = mdjax.Model(config=c, params=mdjax.init_params(c, 0, std=0.2), name="tiny")  # split
  config = types.SimpleNamespace(
      num_hidden_layers=c.num_layers, max_position_embeddings=c.max_position_embeddings,
      hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
      num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
      rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
      rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size, bos_token_id=1, eos_token_id=2)
  path = write_gguf(tmp_path / "tiny.gguf", "llama",
                    hf_layout.params_to_hf(c, model.params, np.float32), config, GGUF_TYPES)
  one_device = mdjax.load(str(path), quantize="gguf")
  decoded, decode = [], gguf_native._Region.decode

  def recorded(region, rows, cols):
    decoded.append((region, region.shape, rows, cols))  # the region kept: ids are reused
    return decode(region, rows, cols)

  decodes, read_blocks = [], gguf_native.read_blocks
  monkeypatch.setattr(gguf_native._Region, "decode", recorded)
  monkeypatch.setattr(gguf_native, "read_blocks", lambda *a: decodes.append(a) or read_blocks(*a))
  float_reads, get_slice = [], gguf_reader.Tensors.get_slice
  whole_reads, get = [], gguf_reader.Tensors.get

  def sliced(tensors, name, shape, index):
    float_reads.append((name, shape, tuple(s.indices(n)[:2] for s, n in zip(index, shape))))
    return get_slice(tensors, name, shape, index)

  monkeypatch.setattr(gguf_reader.Tensors, "get_slice", sliced)
  monkeypatch.setattr(gguf_reader.Tensors, "get", lambda t, name, shape: whole_reads.append(
      shape) or get(t, name, shape))
  loaded = mdjax.load(str(path), quantize="gguf", mesh=jax.make_mesh((2, 4), ("data", "tensor")))
  assert all(len(shape) == 1 for shape in whole_reads), whole_reads  # norms only
  halves = {}  # k_proj of each layer -> the blocks of it read
  for name, (rows, cols), blocks in float_reads:
    halves.setdefault((name, rows * cols), set()).add(blocks)
  assert sorted(name for name, _ in halves) == [
      f"model.layers.{i}.self_attn.k_proj.weight" for i in range(c.num_layers)]
  for (_, size), blocks in halves.items():
    assert len(blocks) == 2 and sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in blocks
                                    ) == size, blocks
  regions = {}  # region -> (its size, the blocks of it decoded)
  for region, (rows, cols), (r0, r1), (c0, c1) in decoded:
    regions.setdefault(region, (rows * cols, []))[1].append(((r0, r1), (c0, c1)))
  assert len(regions) == 6 * c.num_layers + 2  # q, v, o, gate, up, down; embed, lm_head
  for size, blocks in regions.values():  # halves (k, v: 2 KV heads) or quarters
    areas = [(r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in set(blocks)]
    assert len(areas) > 1 and sum(areas) == size, (size, blocks)
  assert len(decodes) == sum(len(set(blocks)) for _, blocks in regions.values())  # each once
  jax.tree.map(np.testing.assert_array_equal,
               sharding.one_device_layout(loaded.params, loaded.config), one_device.params)
  run = lambda m: mdjax.generate(m, PROMPTS, max_new_tokens=10,  # noqa: E731
                                 eos_token_id=[]).sequences
  assert run(loaded) == run(one_device)
  hf.save_hf(loaded, tmp_path / "saved")  # the sharded model, its layers' q and v blocks
  jax.tree.map(np.testing.assert_array_equal,  # beside a float k: one device's folder
               mdjax.load(str(tmp_path / "saved")).params, one_device.params)
