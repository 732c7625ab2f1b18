"""Head families are plug-ins (`mdjax.heads.family`): a toy family registered from this
file alone is looked up by name, inits, saves and loads, and trains (a few steps of
`mdjax.train.heads`, export and card included) with nothing else changed."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from configs import heads_tiny_test
from mdjax.heads import FAMILIES, HeadFamily, get_family, init_heads, load_heads, register
from mdjax.heads.objective import Objective, parallel_loss
from mdjax.models.transformer import lm_head
from mdjax.train import heads as heads_lib
from tests.helpers import cycle_model, heads_config, write_cycle_prompts


@dataclasses.dataclass(frozen=True)
class ToyFamily(HeadFamily):
  """K linear heads on the model's hidden state h: head k guesses token t + 1 + k as
  lm_head(h + h @ w[k]); params w [K, D, D], zero at first."""

  name = "toy"
  strategies = ("toy",)

  def init(self, config, model_config, seed, dtype):
    d = config.hidden_size
    return {"w": jnp.zeros((config.num_heads, d, d), dtype)}

  def window(self, num_heads):
    return num_heads + 2

  def describe(self, config):
    return f"{config.num_heads} toy heads"

  def loss(self, objective: Objective, params, batch, base, ks):
    def logits(params, hidden, base):  # [B, T, K, V]
      x = hidden[..., None, :] + jnp.einsum("btd,kde->btke", hidden, params["w"])
      return lm_head(base, x, config=objective.model_config)
    return parallel_loss(logits, objective, params, batch, base, ks)


@pytest.fixture
def toy():
  register(ToyFamily)
  yield FAMILIES["toy"]
  del FAMILIES["toy"]


@pytest.fixture(scope="module")
def base():
  return cycle_model()


def test_a_registered_family_is_looked_up_by_name(toy):
  assert get_family("toy") is toy and toy.strategy == "toy"
  with pytest.raises(mdjax.MdjaxError, match=r"unknown heads family 'hydra'; supported: "
                                             r"medusa, eagle, mtp, eagle3, toy"):
    get_family("hydra")
  with pytest.raises(mdjax.MdjaxError, match=r"only medusa and eagle3 heads have their own unembedding; "
                                             r"toy heads share the model's"):
    heads_config(cycle_model(), "toy", own_unembedding=True)


def test_a_class_that_is_no_family_is_refused():
  with pytest.raises(mdjax.MdjaxError, match=r"'dict' does not subclass HeadFamily"):
    register(dict)


def test_toy_heads_init_save_and_load(toy, base, tmp_path):
  heads = init_heads(heads_config(base, "toy", num_heads=2), base.config, seed=0)
  assert heads.params["w"].shape == (2, base.config.hidden_size, base.config.hidden_size)
  mdjax.save_heads(heads, tmp_path / "toy")
  loaded = mdjax.load_heads(tmp_path / "toy")
  assert loaded.config == heads.config
  assert np.array_equal(loaded.params["w"], heads.params["w"])


def test_toy_heads_train_and_export(toy, base, tmp_path):
  prompts = write_cycle_prompts(tmp_path / "prompts.jsonl", 12)
  config = heads_tiny_test.get_config()
  config.data.prompts = str(prompts)
  config.update(run_dir=str(tmp_path / "run"), family="toy", num_heads=2,
                steps=4, batch_size=8, log_every=1, eval_every=4, checkpoint_every=4)
  run = heads_lib.train(config, model=base, progress=False)
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines()]
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 4 and losses[-1] < losses[0]
  loaded = load_heads(run.export_dir)
  assert loaded.config.family == "toy" and len(loaded.config.top_accuracy) == 2
  assert "2 toy heads" in loaded.card and "strategy='toy'" in loaded.card
  assert not np.array_equal(jax.device_get(loaded.params["w"]), np.zeros_like(loaded.params["w"]))
