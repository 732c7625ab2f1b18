"""Model soups (`mdjax.train.soup`, `experiments.soup_lm`): the weighted average of the
weights of models of one shape, written as a model that loads like any other."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

import mdjax
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.model import Model
from mdjax.models.random_init import init_params
from mdjax.train import soup
from helpers import write_tiny_checkpoint

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32)


def test_soup_is_the_weighted_average_of_every_weight():
  a, b = (Model(config=CONFIG, params=init_params(CONFIG, seed)) for seed in (1, 2))
  mixed = soup.average([a, b], [3, 1])  # normalized to 0.75 / 0.25
  for got, x, y in zip(*(jax.tree.leaves(m.params) for m in (mixed, a, b))):
    np.testing.assert_allclose(got, 0.75 * np.asarray(x) + 0.25 * np.asarray(y), rtol=1e-6,
                               atol=1e-7)
  assert jax.tree.structure(mixed.params) == jax.tree.structure(a.params)


@pytest.mark.parametrize("models, weights, message", [
    (1, None, "at least 2 models"),
    (2, [1.0], "1 weights for 2 models"),
    (2, [1.0, 0.0], "must be > 0"),
])
def test_bad_soups_are_refused(models, weights, message):
  model = Model(config=CONFIG, params=init_params(CONFIG))
  with pytest.raises(MdjaxError, match=message):
    soup.average([model] * models, weights)


def test_models_of_different_shapes_are_refused():
  wider = ModelConfig(**{**CONFIG.__dict__, "intermediate_size": 64})
  models = [Model(config=c, params=init_params(c), name=n)
            for c, n in ((CONFIG, "a"), (wider, "b"))]
  with pytest.raises(MdjaxError, match="cannot average b with a: their configs differ in "
                                       "intermediate_size"):
    soup.average(models)


def _checkpoint(path, seed, heldout):
  write_tiny_checkpoint(path, seed=seed)
  (path / "heldout_files.json").write_text(json.dumps({"root": "/x", "heldout": heldout}))
  (path / "training_summary.json").write_text(json.dumps({"tokens_seen_total": 100 * seed}))


def _soup_lm(*args):
  return subprocess.run([sys.executable, "-m", "experiments.soup_lm", *args],
                        capture_output=True, text=True)


def test_soup_lm_writes_a_loadable_soup_with_its_record(tmp_path):
  _checkpoint(tmp_path / "a", 1, ["x.py"])
  _checkpoint(tmp_path / "b", 2, ["x.py"])
  result = _soup_lm(f"--models={tmp_path / 'a'},{tmp_path / 'b'}", "--dtype=float32",
                    f"--out={tmp_path / 'soup'}")
  assert result.returncode == 0, result.stderr
  loaded = [mdjax.load(str(tmp_path / n), dtype="float32") for n in ("soup", "a", "b")]
  for got, x, y in zip(*(jax.tree.leaves(m.params) for m in loaded)):
    np.testing.assert_allclose(got, (np.asarray(x) + np.asarray(y)) / 2, rtol=1e-6, atol=1e-7)
  record = json.loads((tmp_path / "soup" / "training_summary.json").read_text())
  assert [i["weight"] for i in record["averaged_from"]] == [0.5, 0.5]
  assert record["tokens_seen_total"] == 200
  assert json.loads((tmp_path / "soup" / "heldout_files.json").read_text())["heldout"] == ["x.py"]


def test_soup_lm_refuses_models_with_different_heldout_files(tmp_path):
  _checkpoint(tmp_path / "a", 1, ["x.py"])
  _checkpoint(tmp_path / "b", 2, ["y.py"])
  result = _soup_lm(f"--models={tmp_path / 'a'},{tmp_path / 'b'}", f"--out={tmp_path / 'soup'}")
  assert result.returncode != 0 and "different held-out files" in result.stderr
  assert not (tmp_path / "soup").exists()
