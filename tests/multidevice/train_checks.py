"""The trainers on a device mesh (`config.mesh`) == on one device, on 8 simulated CPU
devices; orbax checkpoints resume across meshes.

JAX fixes its device count when its backend starts, so these run in a process of
their own (`tests/test_sharding.py` starts pytest on this file; its name keeps the
main run from collecting it). Without 8 devices every check fails at import.

The runs are the tiny test configs, a few steps each, logging every step's loss. An
interrupted run is simulated by copying a finished one and deleting its last checkpoint
(the state of a run killed after its step-3 checkpoint).
"""

import dataclasses
import json
import pathlib
import shutil

import jax

jax.config.update("jax_num_cpu_devices", 8)
if len(jax.devices()) != 8:
  raise RuntimeError(f"the train checks need 8 CPU devices, got {jax.devices()}")

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import pytest  # noqa: E402

import mdjax  # noqa: E402
from configs import heads_tiny_test, lm_tiny_test  # noqa: E402
from mdjax import sharding  # noqa: E402
from mdjax.models.layer_loop import unstack_layers  # noqa: E402
from mdjax.models.model import Model  # noqa: E402
from mdjax.train import data, export, lm, loop  # noqa: E402
from mdjax.train import heads as heads_lib  # noqa: E402
from tests.helpers import cycle_model, write_cycle_prompts  # noqa: E402

LM_STEPS, LM_KEPT = 6, 3  # checkpoints at 3 and 6; a resume starts after step 3
LM_VOCAB = 298  # not a multiple of the tensor axis (4): the mesh pads it to 300
LM_MESH = "2,4"
HEADS_STEPS, HEADS_KEPT = 6, 3
HEADS_VOCAB = 255  # padded to 256 on a tensor axis of 2
HEADS_MESH = "4,2"


def lm_config(run_dir, **overrides):
  config = lm_tiny_test.get_config()
  config.update(run_dir=str(run_dir), data_dir=str(data.stdlib_dir() / "json"),
                vocab_size=LM_VOCAB, steps=LM_STEPS, log_every=1, eval_every=100,
                checkpoint_every=LM_KEPT, keep_checkpoints=2, **overrides)
  config.model.update(num_heads=4, num_kv_heads=2, head_dim=8)  # heads shard over tensor 4
  return config


def losses(run_dir) -> dict[int, float]:
  """step -> train loss, from a run's metrics (logged every step)."""
  lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
  return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def interrupted_copy(run_dir, to) -> pathlib.Path:
  """A copy of a finished run as killed right after its next-to-last checkpoint."""
  shutil.copytree(run_dir, to)
  latest = max(int(p.name) for p in (to / "checkpoints").iterdir() if p.name.isdigit())
  shutil.rmtree(to / "checkpoints" / str(latest))
  return to


def assert_close_losses(got: dict, want: dict, steps):
  assert sorted(got) == sorted(want) == list(range(1, max(steps) + 1))
  np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


def is_sharded(x: jax.Array) -> bool:
  return not x.sharding.is_fully_replicated


@pytest.fixture(scope="module")
def lm_one_device(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("lm") / "one_device"
  return lm.train(lm_config(run_dir), progress=False), run_dir


@pytest.fixture(scope="module")
def lm_mesh(lm_one_device, tmp_path_factory):
  _, one_dir = lm_one_device
  run_dir = tmp_path_factory.mktemp("lm") / "mesh"
  config = lm_config(run_dir, mesh=LM_MESH, tokenizer=str(one_dir / "tokenizer"))
  return lm.train(config, progress=False), run_dir


def test_the_lm_trainer_on_a_mesh_gives_the_losses_of_one_device(lm_one_device, lm_mesh):
  (one, one_dir), (run, mesh_dir) = lm_one_device, lm_mesh
  assert run.model_config.vocab_size == LM_VOCAB  # the tokenizer got the vocabulary asked
  assert_close_losses(losses(mesh_dir), losses(one_dir), range(1, LM_STEPS + 1))
  trained = sharding.one_device_layout(run.params, run.model_config)
  jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, atol=1e-5, rtol=0),
               trained, one.params)
  assert not np.allclose(trained["embed"], lm.initial_params(one.config,
                                                             run.model_config)["embed"])


def test_the_lm_params_lie_on_the_mesh_by_the_rules(lm_mesh):
  run, _ = lm_mesh
  layout = run.layout
  assert layout.mesh.shape == {"data": 2, "tensor_kv": 2, "tensor_q": 2}
  layer = run.params["layers"][0]
  assert {"wq", "wk", "wv", "w_gate", "w_up"} <= set(layer) and "wqkv" not in layer
  for path, x in jax.tree_util.tree_leaves_with_path(run.params):
    want = layout.sharding(path[-1].key, x.shape)
    assert x.sharding.is_equivalent_to(want, x.ndim), (jax.tree_util.keystr(path), x.sharding)
  assert all(is_sharded(layer[name]) for name in ("wq", "wk", "wv", "wo", "w_up", "w_down"))
  assert run.params["embed"].shape == (300, 32) and is_sharded(run.params["embed"])
  assert run.params["lm_head"].shape == (32, 300) and is_sharded(run.params["lm_head"])


def test_padded_vocabulary_rows_stay_zero_through_training(lm_mesh):
  run, _ = lm_mesh
  assert np.all(np.asarray(run.params["embed"])[LM_VOCAB:] == 0)
  assert np.all(np.asarray(run.params["lm_head"])[:, LM_VOCAB:] == 0)
  assert np.any(np.asarray(run.params["lm_head"])[:, :LM_VOCAB] != 0)


def test_the_optimizer_state_follows_the_params_and_checkpoints_hold_one_device_layout(
    lm_mesh):
  run, run_dir = lm_mesh
  config = run.config
  manager = loop.checkpoint_manager(config, run_dir)
  saved = ocp.StandardCheckpointer().metadata(
      run_dir / "checkpoints" / str(LM_STEPS) / "default").item_metadata
  assert "wqkv" in saved["params"]["layers"][0] and "wq" not in saved["params"]["layers"][0]
  assert tuple(saved["params"]["embed"].shape) == (LM_VOCAB, 32)  # the padding is not saved
  step, state = lm.restore_state(config, run.model_config, lm.make_optimizer(config), manager,
                                 run.layout)
  assert step == LM_STEPS
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(got, want), state["params"],
               run.params)
  adam = state["opt_state"][1][0]
  for moments in (adam.mu, adam.nu):
    for (path, m), p in zip(jax.tree_util.tree_leaves_with_path(moments),
                            jax.tree.leaves(run.params)):
      assert m.shape == p.shape and m.sharding.is_equivalent_to(p.sharding, p.ndim), path
    assert np.any(np.asarray(moments["embed"]) != 0)
  assert adam.count.sharding.is_fully_replicated


def test_a_one_device_checkpoint_resumes_on_a_mesh_with_the_same_losses(lm_one_device,
                                                                         tmp_path):
  _, one_dir = lm_one_device
  run_dir = interrupted_copy(one_dir, tmp_path / "resumed")
  resumed = lm.train(lm_config(run_dir, mesh=LM_MESH), progress=False)
  assert resumed.layout is not None and is_sharded(resumed.params["layers"][0]["wq"])
  assert_close_losses(losses(run_dir), losses(one_dir), range(LM_KEPT + 1, LM_STEPS + 1))


def test_a_mesh_checkpoint_resumes_on_one_device_with_the_same_losses(lm_mesh, tmp_path):
  _, mesh_dir = lm_mesh
  run_dir = interrupted_copy(mesh_dir, tmp_path / "resumed")
  resumed = lm.train(lm_config(run_dir), progress=False)
  assert resumed.layout is None and "wqkv" in resumed.params["layers"][0]
  assert_close_losses(losses(run_dir), losses(mesh_dir), range(LM_KEPT + 1, LM_STEPS + 1))


def test_an_interrupted_run_on_a_mesh_resumes_bitwise(lm_mesh, tmp_path):
  run, mesh_dir = lm_mesh
  run_dir = interrupted_copy(mesh_dir, tmp_path / "resumed")
  resumed = lm.train(lm_config(run_dir, mesh=LM_MESH), progress=False)
  assert losses(run_dir) == losses(mesh_dir)
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(got, want), resumed.params,
               run.params)


def test_a_mesh_run_exports_the_one_device_model(lm_mesh, tmp_path):
  run, run_dir = lm_mesh
  summary = export.export(run, run.config, tmp_path / "export")
  exported = mdjax.load(str(tmp_path / "export"))
  assert exported.params["embed"].shape == (LM_VOCAB, 32)
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(got, want),
               unstack_layers(exported.params)["layers"],
               sharding.one_device_layout(run.params, run.model_config)["layers"])
  on_mesh = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "heldout_loss" in r][-1]
  assert summary["heldout_loss"] == pytest.approx(on_mesh["heldout_loss"], rel=1e-5)


@pytest.mark.parametrize("mesh, message", [
    ("2,4,1", "must be 'data,tensor'"), ("2x4", "must be 'data,tensor'"),
    ("0,8", "must be 'data,tensor'"), ("2,2", "needs 4 devices, there are 8"),
    ("8,1", r"batch_size \(4\) must be a multiple of the mesh's data axis \(8")])
def test_bad_mesh_settings_are_clear_errors_before_any_data_is_read(tmp_path, mesh, message):
  with pytest.raises(mdjax.MdjaxError, match=message):
    lm.train(lm_config(tmp_path / "lm", mesh=mesh, batch_size=4), progress=False)
  assert not (tmp_path / "lm").exists()
  with pytest.raises(mdjax.MdjaxError, match=message):
    heads_lib.train(heads_config(tmp_path / "heads", tmp_path / "none.jsonl", mesh=mesh,
                                 batch_size=4), model=cycle_model(), progress=False)
  assert not (tmp_path / "heads").exists()


# --- The heads trainer -------------------------------------------------------------------


def heads_config(run_dir, prompts, **overrides):
  config = heads_tiny_test.get_config()
  config.data.prompts = str(prompts)
  config.update({"run_dir": str(run_dir), "steps": HEADS_STEPS,
                 "log_every": 1, "eval_every": 100, "checkpoint_every": HEADS_KEPT,
                 **overrides})
  return config


@pytest.fixture(scope="module")
def base() -> Model:
  """The predictable cycle model (`tests.helpers`) cut to a vocabulary the mesh pads."""
  model = cycle_model()
  p = model.params
  return dataclasses.replace(
      model, config=dataclasses.replace(model.config, vocab_size=HEADS_VOCAB),
      params={**p, "embed": p["embed"][:HEADS_VOCAB], "lm_head": p["lm_head"][:, :HEADS_VOCAB]})


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
  return write_cycle_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", 24)


@pytest.fixture(scope="module")
def heads_one_device(base, prompts, tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("heads") / "one_device"
  return heads_lib.train(heads_config(run_dir, prompts), model=base, progress=False), run_dir


def test_the_heads_trainer_on_a_mesh_gives_the_losses_of_one_device(base, prompts,
                                                                    heads_one_device, tmp_path,
                                                                    monkeypatch):
  one, one_dir = heads_one_device
  seen = []  # every step's arguments
  real_step = heads_lib.run.make_train_step

  def spy(*args, **kwargs):
    step = real_step(*args, **kwargs)
    return lambda *step_args: seen.append(step_args) or step(*step_args)

  monkeypatch.setattr(heads_lib.run, "make_train_step", spy)  # where `train` looks it up
  run = heads_lib.train(heads_config(tmp_path, prompts, mesh=HEADS_MESH), model=base,
                        progress=False)
  state, batch, unembedding = seen[-1]  # the heads replicated, the model sharded
  assert len(seen) == HEADS_STEPS
  assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8
             for x in jax.tree.leaves(state))
  assert all(tuple(x.sharding.spec)[:1] == ("data",) for x in jax.tree.leaves(batch))
  assert unembedding["embed"].shape == (256, 64) and is_sharded(unembedding["embed"])
  assert is_sharded(unembedding["lm_head"])
  assert run.data.cache_dir.name == one.data.cache_dir.name  # the same model, data and key
  for name in ("tokens", "lengths", "greedy"):
    np.testing.assert_array_equal(getattr(run.data.train, name), getattr(one.data.train, name))
  np.testing.assert_allclose(run.data.train.hidden, one.data.train.hidden, atol=1e-5)
  assert_close_losses(losses(tmp_path), losses(one_dir), range(1, HEADS_STEPS + 1))
  jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, atol=1e-5, rtol=0),
               run.heads.params, one.heads.params)


def test_a_one_device_heads_checkpoint_resumes_on_a_mesh(heads_one_device, base, prompts,
                                                         tmp_path):
  one, one_dir = heads_one_device
  run_dir = interrupted_copy(one_dir, tmp_path / "resumed")
  resumed = heads_lib.train(heads_config(run_dir, prompts, mesh=HEADS_MESH), model=base,
                            progress=False)
  assert_close_losses(losses(run_dir), losses(one_dir), range(HEADS_KEPT + 1, HEADS_STEPS + 1))
  jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, atol=1e-5, rtol=0),
               resumed.heads.params, one.heads.params)


def test_a_model_already_on_another_mesh_is_a_clear_error(base, prompts, tmp_path):
  model = mdjax.shard(base, jax.make_mesh((2, 4), ("data", "tensor")))
  with pytest.raises(mdjax.MdjaxError, match="lies on a mesh"):
    heads_lib.train(heads_config(tmp_path, prompts, mesh=HEADS_MESH), model=model,
                    progress=False)
