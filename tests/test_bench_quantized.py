"""experiments.bench.quantized --quick runs end to end (a tiny random llama in float32,
int8 and int4) and writes its JSON and plot; its helpers count what they say, and the
int4 sweep's forms (experiments.bench.int4_groups) are what they name, and the qwix
comparison's contenders (experiments.bench.qwix_products) compute what they say.

No timing is asserted: benchmarks measure, tests check that they can.
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import mdjax
from experiments.bench import quality, qwix_forms
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.models import quantized
from mdjax.models.quantized import INT4_GROUP, quantize

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_bench_quantized_quick(tmp_path):
  subprocess.run([sys.executable, "-m", "experiments.bench.quantized", "--quick",
                  f"--out_dir={tmp_path}"], cwd=REPO, check=True, timeout=600, capture_output=True)
  assert (tmp_path / "bench_quantized.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  results = json.loads((tmp_path / "bench_quantized.json").read_text())

  assert results["command"].startswith("python3 -m experiments.bench.quantized --quick")
  assert results["date"] and results["corpus"]["words"] > 100
  for moment in ("before", "after"):
    assert "load average" in results[moment]["uptime"] and len(results[moment]["load"]) == 3
  assert {"cpu_count", "load_average", "jax", "bandwidth"} <= set(results["machine"])
  (entry,) = results["models"].values()
  assert entry["int4_group"] == quantized.INT4_GROUP and not entry["int4_group_note"]
  schemes = entry["quality"]["schemes"]
  assert list(schemes) == ["float32", "int8", "int4"]
  assert schemes["int4"]["label"] == quantized.scheme_label("int4", None)
  for name, cell in schemes.items():
    assert cell["perplexity"] > 1 and cell["scored_tokens"] == 95  # 96 ids, the first unscored
    assert set(cell["agreement"]) == set(cell["kv_cache_bytes"]) == {"bfloat16", "int8"}
    for agreement in cell["agreement"].values():
      assert 0 <= agreement["prefix_fraction"] <= 1 and 0 <= agreement["mean_prefix"] <= 8
    assert cell["kv_cache_bytes"]["int8"] < cell["kv_cache_bytes"]["bfloat16"]
    assert (cell["weight_ratio"] < 0.35) == (name != "float32")  # int4 held one per byte
    assert cell["heads"] == {}  # no shipped heads for the tiny model
  assert entry["quality"]["heads"] == []
  assert schemes["int4"]["weight_bytes_packed"] < schemes["int8"]["weight_bytes_packed"]
  rows = entry["speed"]["rows"]
  assert [(r["strategy"], r["batch"], r["scheme"]) for r in rows] == [
      ("greedy", 2, s) for s in schemes]
  assert rows[0]["ratio"] == 1 and all(len(r["samples_ms"]) == 1 for r in rows)
  assert entry["speed"]["skipped"] == ["mixed: --nomixed"]


def test_int4_group_falls_back_to_a_divisor():
  config = RANDOM_MODELS["random-llama-tiny"]  # hidden 64, heads 4 x 16, MLP 128
  assert quality.int4_group(config, 64) == (64, "")
  group, note = quality.int4_group(config, 48)
  assert group == 32 and "48 does not divide" in note


def test_weight_bytes_count_held_and_packed_values():
  w = quantize(jnp.ones((128, 8), jnp.float32), 4, 64)  # 1,024 values, bfloat16 scales [2, 8]
  bytes_ = quality.weight_bytes({"w": w, "norm": jnp.ones(8, jnp.float32)})
  assert bytes_ == dict(held=1024 + 32 + 32, packed=512 + 32 + 32)


def test_agreement_counts_prefixes_before_the_first_divergence():
  out = quality.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
  assert out["prefixes"] == [2, 4] and out["mean_prefix"] == 3
  assert out["prefix_fraction"] == 6 / 8 and out["matching_fraction"] == 7 / 8


def test_perplexity_scores_every_token_once(monkeypatch):
  """Windows of 6 every 3 over 11 ids: each id after the first scored exactly once,
  from its own window's position (a fake NLL: the id itself)."""
  def fake(params, tokens, *, config):
    return np.asarray(tokens[0, 1:], np.float64)
  monkeypatch.setattr(quality, "nll_program", fake)
  model = type("M", (), {"params": None, "config": None})
  ids = list(range(1, 12))
  out = quality.perplexity(model, ids, 0, 6, 3)
  assert out["scored_tokens"] == 10 and np.isclose(out["mean_nll"], np.mean(ids[1:]))
  out = quality.perplexity(model, [100] + ids, 1, 6, 5)  # a BOS leads every window
  assert out["scored_tokens"] == 11 and np.isclose(out["mean_nll"], np.mean(ids))


def test_the_int4_sweep_quantizes_each_form_it_names():
  """experiments.bench.int4_groups's forms: every matrix int4 in the group and form named,
  the embedding int4 alike or int8 (one scale per row), its grids fit as many times as
  told (`--refits=0`: the min-max grid, each group's extremes on levels -8 and 7); the
  packed bytes it reports."""
  params = mdjax.load("random-llama-tiny", layer_loop="unrolled").params
  for offsets, embedding in ((False, "int4"), (True, "int8")):
    quantized_params = quality.with_int4(params, 16, offsets, embedding)
    wq = quantized_params["layers"][1]["wqkv"]
    assert (wq.bits, wq.group, wq.offset is not None) == (4, 16, offsets)
    embed = quantized_params["embed"]
    assert embed.bits == (8 if embedding == "int8" else 4)
    assert embed.group == (64 if embedding == "int8" else 16)  # int8: the row's 64 inputs
  min_max = quality.with_int4(params, 16, True, "int8", refits=0)["layers"][1]["wqkv"].q
  levels = np.asarray(min_max).reshape(-1, 16, min_max.shape[-1])  # [groups, 16, F]
  assert (levels.min(1) == -8).all() and (levels.max(1) == 7).all()
  assert quality.packed_bytes_per_weight(32, True) == 0.625  # bfloat16 scales and offsets
  assert quality.packed_bytes_per_weight(64, False) == 0.53125


def test_the_qwix_comparison_computes_each_contenders_product():
  """experiments.bench.qwix_products's contenders on one matrix: each product is its
  weights' value times x (mdjax's within its two-term rounding, qwix's exactly), each
  quantized one within its format's error of the float32 product; qwix's int4 has an
  int4 zero point per group of `INT4_GROUP`, and the bytes shrink as the bits do."""
  w = jax.random.normal(jax.random.key(0), (128, 96))
  x = jax.random.normal(jax.random.key(1), (3, 128))
  exact = x @ w
  found = qwix_forms.contenders(w)
  assert list(found) == ["float32", "mdjax int8", "qwix int8", "qwix w8a8", "mdjax int4",
                         "qwix int4"]
  for name, (weights, product, dequantize) in found.items():
    out = product(x, weights)
    own = qwix_forms.relative(out, x @ dequantize(weights))
    assert own < (1e-2 if name == "qwix w8a8" else 1e-4), name  # w8a8 rounds x to 8 bits
    assert qwix_forms.relative(out, exact) < (0.2 if "int4" in name else 2e-2), name
  zero_point = found["qwix int4"][0].zero_point
  assert zero_point.dtype == jnp.int4 and zero_point.shape == (128 // INT4_GROUP, 96)
  sizes = [qwix_forms.packed_bytes(found[n][0]) for n in ("float32", "qwix int8", "qwix int4")]
  assert sizes[0] > sizes[1] > sizes[2] and qwix_forms.packed_bytes(found["mdjax int4"][0]) < (
      sizes[1])

