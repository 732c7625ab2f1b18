"""The heads trainer: targets, the prompt set, the data cache, kill-and-resume, training
that works (Medusa and EAGLE), export, bad input.

Most runs use a synthetic base whose text is fully predictable: a tiny llama whose
layers add nothing and whose lm_head maps each id of a 16-id cycle to the next one, so
it writes 3 4 5 ... 18 3 4 ... and token t + 1 + k is a function of token t. Trained
heads must learn that (an untrained Medusa head repeats the model's next-token guess,
always wrong for k >= 1). The whole file runs in about a minute on two CPU cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from configs import heads_tiny_test
from mdjax.train import data
from mdjax.train.heads import features as head_features
from mdjax.train.head_data import prompts as head_prompts
from mdjax.train.heads import inputs as heads_data
from mdjax.heads import get_family, load_heads, save_heads
from mdjax.heads.eagle import eagle_targets
from mdjax.heads.objective import Objective, ahead, parallel_loss, parallel_targets
from mdjax.models.config import ModelConfig
from mdjax.train import heads as heads_lib
from mdjax.train.heads.batches import Reader
from mdjax.train.heads.card import HELDOUT_FILE
from mdjax.train.heads.objective import evaluate, objective_of, unembedding
from tests.helpers import cycle_model, write_cycle_prompts

REPO = data.pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base():
  return cycle_model()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
  """40 prompts, each a stretch of the cycle, as JSONL."""
  return write_cycle_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", 40)


def tiny_config(run_dir, prompts_file, /, **overrides):
  """The tiny config on `prompts_file`; `overrides` as `ConfigDict.update` takes them (a
  section's fields as a dict: `eagle={"unroll": 2}`)."""
  config = heads_tiny_test.get_config()
  config.data.prompts = str(prompts_file)
  config.update({"run_dir": str(run_dir), **overrides})
  return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base, prompts_file):
  """An uninterrupted tiny Medusa run (3 heads, 40 steps) and its config."""
  config = tiny_config(tmp_path_factory.mktemp("uninterrupted"), prompts_file)
  return heads_lib.train(config, model=base, progress=False), config


def test_medusa_head_k_targets_token_t_plus_1_plus_k():
  k, width = 3, 4
  tokens = 100 * np.arange(2)[:, None] + np.arange(width + k + 1)  # [B, n]: row b, token j
  ok = np.ones(tokens.shape, bool)
  ok[1, 6] = False
  targets, mask = parallel_targets(jnp.asarray(tokens), jnp.asarray(ok), k)
  assert targets.shape == mask.shape == (2, width, k)
  for b in range(2):
    for t in range(width):
      for head in range(1, k + 1):
        assert targets[b, t, head - 1] == tokens[b, t + 1 + head]
        assert mask[b, t, head - 1] == ok[b, t + 1 + head]
  hidden = jnp.arange(width + k, dtype=jnp.float32)[None, :, None]  # [1, W + K, 1]: h[t] = t
  teacher = ahead(hidden, k)[0, :, :, 0]  # head k's law of x[t+1+k] is lm_head(h[t+k])
  assert teacher.tolist() == [[t + head for head in range(1, k + 1)] for t in range(width)]


def test_the_greedy_loss_is_cross_entropy_to_the_models_guesses_of_the_same_tokens():
  """Head k at t: "greedy" trains on greedy[t + k] (the model's guess of x[t + 1 + k]),
  "ce" on x[t + 1 + k]; the two agree where the data's tokens are the guesses."""
  k, width, vocab_size = 2, 5, 11
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab_size, (2, width + k + 1))  # [B, n]
  greedy = rng.integers(0, vocab_size, (2, width + k))  # [B, n - 1]: guess of x[t + 1]
  batch = {"tokens": jnp.asarray(tokens), "ok": jnp.ones(tokens.shape, bool),
           "hidden": jnp.asarray(rng.normal(size=(2, width + k, 4)), jnp.float32),
           "greedy": jnp.asarray(greedy)}
  heads = jnp.asarray(rng.normal(size=(4, k, vocab_size)), jnp.float32)
  head_logits = lambda params, hidden, base: jnp.einsum("btd,dkv->btkv", hidden, params)
  config = ModelConfig(vocab_size=vocab_size, hidden_size=4,
                       intermediate_size=4, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=4)
  loss = lambda name, batch: parallel_loss(head_logits, Objective(
      family="medusa", model_config=config, depth=k, num_layers=1, loss=name, decay=0.8),
      heads, batch, {}, (1,))[0]
  assert not np.isclose(loss("greedy", batch), loss("ce", batch))
  as_tokens = dict(batch, tokens=jnp.concatenate([batch["tokens"][:, :1], batch["greedy"]], 1))
  np.testing.assert_allclose(loss("greedy", batch), loss("ce", as_tokens), rtol=1e-6)


def test_eagle_reads_token_p_plus_1_and_feature_p_and_predicts_feature_and_token_after():
  n = 7
  batch = {"tokens": jnp.arange(n)[None] + 100, "ok": jnp.ones((1, n), bool),
           "hidden": jnp.arange(n - 1, dtype=jnp.float32)[None, :, None],  # h[p] = p
           "greedy": jnp.arange(n - 1)[None] + 201}  # the model's guess of x[p + 1] = 101 + p
  t = eagle_targets(batch)
  p = np.arange(n - 2)
  assert t["tokens"][0].tolist() == (101 + p).tolist()
  assert t["features"][0, :, 0].tolist() == p.tolist()
  assert t["wanted"][0, :, 0].tolist() == (p + 1).tolist()
  assert t["targets"][0].tolist() == (102 + p).tolist()
  assert t["greedy"][0].tolist() == (202 + p).tolist()


def test_reader_windows_and_masks_follow_the_rows(trained):
  run, config = trained
  features = run.data.train
  reader = Reader(features, get_family("medusa").window(config.num_heads), mask_prompt=True)
  batch = reader.batch(config.seed, 0, 64)
  again = reader.batch(config.seed, 0, 64)
  assert all(np.array_equal(batch[key], again[key]) for key in batch)  # a function of the step
  part = reader.batch(config.seed, 0, 64, slice(16, 48))  # a process's rows of it
  assert all(np.array_equal(part[key], batch[key][16:48]) for key in batch)
  picked = np.random.default_rng([config.seed, 0]).integers(0, len(reader), 64)
  for i, unit in enumerate(picked):
    row, p = reader.rows[unit], reader.starts[unit]
    length, prompt = features.lengths[row], features.prompt_lengths[row]
    for j in range(config.num_heads + 2):
      assert batch["ok"][i, j] == (prompt <= p + j < length)
      if p + j < length:
        assert batch["tokens"][i, j] == features.tokens[row, p + j]
  # the cached greedy guess at t is the model's choice of token t + 1: the cycle's next id
  rows, positions = np.nonzero(np.arange(features.tokens.shape[1]) < features.lengths[:, None] - 1)
  assert np.array_equal(features.greedy[rows, positions], features.tokens[rows, positions + 1])


def test_builtin_prompts_are_distinct_fixed_and_split_by_seed():
  prompts = head_prompts.builtin_prompts()
  assert len(prompts) >= 400 and len(set(prompts)) == len(prompts)
  assert prompts == head_prompts.builtin_prompts()
  train, heldout = head_prompts.split_prompts(prompts, 0.1, seed=0)
  assert len(heldout) == -(-len(prompts) // 10) and not set(train) & set(heldout)
  assert sorted(train + heldout) == sorted(prompts)
  assert head_prompts.split_prompts(prompts, 0.1, seed=0) == (train, heldout)
  assert head_prompts.split_prompts(prompts, 0.1, seed=1)[1] != heldout


def test_prompt_files_read_lines_or_json_values(tmp_path):
  text = tmp_path / "prompts.txt"
  text.write_text("Explain tides.\n\n  \nWrite a haiku.\n")
  assert head_prompts.read_prompts(text) == ["Explain tides.", "Write a haiku."]
  jsonl = tmp_path / "prompts.jsonl"
  jsonl.write_text('"a"\n{"prompt": "b"}\n[5, 6, 7]\n')
  assert head_prompts.read_prompts(jsonl) == ["a", "b", [5, 6, 7]]


def test_trained_medusa_heads_guess_the_cycle_and_export_with_their_card(trained, base, tmp_path):
  run, config = trained
  objective = objective_of(heads_lib.validate(config), get_family("medusa"), base.config)
  reader = Reader(run.data.heldout, get_family("medusa").window(config.num_heads),
                  mask_prompt=True)
  untrained = mdjax.heads.init_heads(run.heads.config, base.config, seed=0).params
  before = evaluate(untrained, reader, objective, unembedding(base), 32)
  assert max(before["heldout_top1"]) < 0.1  # each head repeats the model's next-token guess
  assert min(run.heldout["heldout_top1"]) > 0.9
  assert run.heldout["heldout_accepted_length"] > 3.5
  assert run.step == config.steps and not run.stopped_early

  loaded = mdjax.load_heads(run.export_dir)
  assert loaded.config == run.heads.config
  assert np.allclose(loaded.config.top_accuracy, run.heldout["heldout_topk"])
  assert len(loaded.config.top_accuracy) == 3 and len(loaded.config.top_accuracy[0]) == 10
  for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(run.heads.params)):
    assert np.array_equal(np.asarray(got), np.asarray(want))
  assert f"{run.heldout['heldout_accepted_length']:.3f}" in loaded.card
  assert all(f"{a:.3f}" in loaded.card for a in run.heldout["heldout_top1"])
  assert "mdjax.load_heads" in loaded.card and "cycle-llama-tiny" in loaded.card
  heldout = json.loads((run.export_dir / HELDOUT_FILE).read_text())
  assert len(heldout) == run.data.heldout.rows == 4
  run_dir = data.pathlib.Path(config.run_dir)
  assert (run_dir / "losses.png").stat().st_size > 0
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "heldout_topk" in r] == [20, 40]


def test_killed_run_resumes_bitwise_without_running_the_model_again(trained, base, prompts_file,
                                                                    tmp_path, monkeypatch):
  run, _ = trained
  config = tiny_config(tmp_path, prompts_file)
  read = Reader.batch

  def killed_at_step_25(self, seed, step, size, rows=slice(None)):
    if step == 24:
      raise KeyboardInterrupt("killed")
    return read(self, seed, step, size, rows)

  monkeypatch.setattr(Reader, "batch", killed_at_step_25)
  with pytest.raises(KeyboardInterrupt):
    heads_lib.train(config, model=base, progress=False)
  monkeypatch.setattr(Reader, "batch", read)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10", "20"]

  budget = heads_lib.train(tiny_config(tmp_path, prompts_file, max_minutes=1e-9), model=base,
                           progress=False)  # resumes at 20, out of time after one step
  assert budget.stopped_early and budget.step == 21 and "stopped by the time budget" in (
      budget.heads.card)

  cache = budget.data.cache_dir
  stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
  calls = []
  monkeypatch.setattr(heads_data, "generate", lambda *a, **k: calls.append("generate"))
  monkeypatch.setattr(head_features, "target_features", lambda *a, **k: calls.append("forward"))
  resumed = heads_lib.train(config, model=base, progress=False)
  assert not calls and {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == stamps
  for got, want in zip(jax.tree.leaves(resumed.heads.params), jax.tree.leaves(run.heads.params)):
    assert np.array_equal(np.asarray(got), np.asarray(want))
  records = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
  steps = [r["step"] for r in records if "loss" in r]
  assert steps == sorted(set(steps)) and steps[-1] == config.steps


def test_a_relative_run_dir_checkpoints(base, prompts_file, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = tiny_config("relative/run", prompts_file, steps=10, eval_every=10)
  heads_lib.train(config, model=base, progress=False)
  assert (tmp_path / "relative" / "run" / "checkpoints" / "10").is_dir()


def test_eagle_head_learns_the_cycle_with_an_unrolled_step(base, prompts_file, tmp_path):
  config = tiny_config(tmp_path, prompts_file, family="eagle", num_heads=1, eagle={"unroll": 2},
                       batch_size=4, steps=30, eval_every=30)
  run = heads_lib.train(config, model=base, progress=False)
  losses = [r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text()
                                   .splitlines()) if "loss" in r]
  assert losses[-1] < 0.5 * losses[0]
  assert len(run.heldout["heldout_top1"]) == 2 and min(run.heldout["heldout_top1"]) > 0.5
  assert mdjax.load_heads(run.export_dir).config.family == "eagle"


def test_eagle3_learns_the_cycle_over_a_draft_vocabulary_and_decodes_it(base, prompts_file,
                                                                         tmp_path):
  """The training-time test on the synthetic base (the answer is determined): each of
  3 unrolled steps learns its shifted target (token p + 2 + j), through the target's
  three layers and a draft vocabulary of the cycle's 16 ids plus 4; the exported heads
  then draft whole chains that the base accepts, its greedy output unchanged. The
  held-out data is scored over 4 steps (`eval_unroll`), one more than trained."""
  config = tiny_config(tmp_path, prompts_file, family="eagle3", num_heads=1,
                       eagle={"unroll": 3, "eval_unroll": 4}, draft_vocab_size=20, loss="ce",
                       batch_size=4, steps=40, eval_every=40)
  run = heads_lib.train(config, model=base, progress=False)
  assert len(run.heldout["heldout_top1"]) == 4 and min(run.heldout["heldout_top1"][:3]) > 0.9
  heads = mdjax.load_heads(run.export_dir)
  assert heads.config.family == "eagle3" and heads.config.draft_vocab_size == 20
  assert set(range(3, 19)) <= set(np.asarray(heads.params["draft_ids"]).tolist())
  assert "Draft vocabulary" in heads.card and "100.0%" in heads.card
  prompt = list(range(5, 9))
  greedy = mdjax.generate(base, [prompt], max_new_tokens=24, eos_token_id=[])
  out = mdjax.generate(base, [prompt], strategy="eagle", heads=heads, tree_depth=3,
                       tree_top_k=1, tree_budget=3, max_new_tokens=24, eos_token_id=[])
  assert out.sequences == greedy.sequences
  assert out.stats["accepted"] / out.stats["target_passes"] > 2.5
  # continued (`init_from`) with a learning rate of 0: the same heads and vocabulary come
  # out; on the target's laws (soft labels, "kl"), whose final-norm states the cache keeps
  again = heads_lib.train(tiny_config(tmp_path / "again", prompts_file, family="eagle3",
                                      num_heads=1, eagle={"unroll": 3}, draft_vocab_size=20,
                                      loss="kl", batch_size=4, steps=2, eval_every=2,
                                      init_from=str(run.export_dir), optim={"lr": 0.0}),
                          model=base, progress=False)
  continued = mdjax.load_heads(again.export_dir)
  jax.tree.map(np.testing.assert_array_equal, continued.params, heads.params)
  assert again.data.train.teacher.shape == (*again.data.train.tokens.shape,
                                            base.config.hidden_size)
  assert min(again.heldout["heldout_top1"]) > 0.9
  # its card's curve starts at the heads it continued (step 0) and ends at its own (lr 0)
  records = {r["step"]: r for r in map(json.loads, (tmp_path / "again" / "metrics.jsonl")
                                       .read_text().splitlines()) if "heldout_top1" in r}
  assert sorted(records) == [0, 2]
  np.testing.assert_allclose(records[0]["heldout_top1"], again.heldout["heldout_top1"])
  assert "Held-out top-1 during training" in continued.card
  assert "| 0 | 0 | " + " | ".join(f"{a:.3f}" for a in records[0]["heldout_top1"]) in continued.card
  with pytest.raises(mdjax.MdjaxError, match=re.escape("num_layers 1 (the run's: 2)")):
    heads_lib.train(tiny_config(tmp_path / "other", prompts_file, family="eagle3", num_heads=1,
                                num_layers=2, draft_vocab_size=20, loss="ce",
                                init_from=str(run.export_dir)), model=base, progress=False)


def test_a_text_file_is_the_data_as_it_is(tmp_path):
  model = mdjax.load("code-tiny")
  text_file = data.stdlib_dir() / "json" / "decoder.py"
  config = heads_tiny_test.get_config()
  config.update(run_dir=str(tmp_path), model="code-tiny", num_heads=2, steps=5, eval_every=5,
                data={"text_file": str(text_file), "text_row_tokens": 64})
  run = heads_lib.train(config, model=model, progress=False)
  tokens = model.tokenizer.encode(text_file.read_text())
  chunks = [tokens[i:i + 64] for i in range(0, len(tokens), 64)]
  rows = [f.tokens[i, :f.lengths[i]].tolist() for f in (run.data.train, run.data.heldout)
          for i in range(f.rows)]
  assert sorted(rows) == sorted(chunks) and len(rows) >= 20
  assert run.data.train.answer_tokens == run.data.train.token_count  # no prompt: all trained on
  assert "cut into rows of 64 tokens" in run.heads.card


@pytest.mark.parametrize("overrides, message", [
    ({"family": "hydra"}, "unknown heads family 'hydra'"),
    ({"family": "mtp", "eagle": {"unroll": 2}},
     "config.eagle.unroll is eagle and eagle3's; mtp needs 1, got 2"),
    ({"loss": "mse"}, "config.loss must be one of ce, kl, greedy, got 'mse'"),
    ({"eagle": {"unroll": 2}}, "config.eagle.unroll is eagle and eagle3's"),
    ({"eagle": {"eval_unroll": 2}}, "config.eagle.eval_unroll is for heads that draft one token "
                                    "at a time; medusa needs 0, got 2"),
    ({"family": "eagle3", "num_heads": 1, "eagle": {"eval_unroll": -1}},
     "config.eagle.eval_unroll must be an integer >= 0, got -1"),
    ({"family": "eagle", "num_heads": 3}, "config.num_heads must be 1"),
    ({"data": {"feature_dtype": "bfloat16"}}, "config.data.feature_dtype must be one of"),
    ({"heldout_fraction": 1.0}, "config.heldout_fraction must be in (0, 1), got 1.0"),
    ({"steps": 0}, "config.steps must be an integer >= 1, got 0"),
    ({"data": {"text_file": "notes.txt"}},
     "config.data.prompts and config.data.text_file are exclusive"),
    ({"run_dir": ""}, "config.run_dir is required"),
    ({"eagle": {"unrol": 2}}, "unknown field config.eagle.unrol in a EagleConfig (did you mean "
                              "config.eagle.unroll?)"),
    ({"unroll": 2}, "unknown field config.unroll in a HeadsTrainConfig"),
])
def test_bad_config_values_are_named(overrides, message, base, prompts_file, tmp_path):
  with pytest.raises(mdjax.MdjaxError, match=re.escape(message)):
    heads_lib.train(tiny_config(tmp_path, prompts_file, **overrides), model=base, progress=False)


@pytest.mark.parametrize("content, message", [
    ("", "holds no prompts"),
    ("\n  \n", "holds no prompts"),
    ("[1, 2]\nnot json\n", "line 2 is not JSON"),
    ('{"text": "a"}\n', 'line 1 must be a non-empty string'),
    ('"a question"\n"another"\n', "has no tokenizer, so the prompts must be token ids"),
    ("[5, 6]\n", "need at least 2 prompts"),
])
def test_bad_prompt_files_are_named(content, message, base, tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text(content)
  with pytest.raises(mdjax.MdjaxError, match=message):
    heads_lib.train(tiny_config(tmp_path / "run", path), model=base, progress=False)


def test_a_missing_prompts_file_is_named(base, tmp_path):
  with pytest.raises(mdjax.MdjaxError, match="no such file: .*missing.txt"):
    heads_lib.train(tiny_config(tmp_path, tmp_path / "missing.txt"), model=base, progress=False)


def test_cli_prints_one_error_line_for_bad_input(tmp_path):
  result = subprocess.run([sys.executable, "-m", "experiments.train_heads",
                           "--config=configs/heads_tiny_test.py", f"--config.run_dir={tmp_path}",
                           "--config.family=hydra"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "error: unknown heads family 'hydra'; supported: medusa, eagle, mtp, eagle3")


def test_export_dtype_halves_the_file_and_loads_back_as_float32(tmp_path):
  """bfloat16 export (what ships): the weights file is about half the float32 one, and
  `load_heads` gives float32 arrays equal to the rounded weights."""
  model = mdjax.load("random-llama-tiny")
  c = model.config
  heads = mdjax.heads.init_heads(mdjax.HeadsConfig(
      family="eagle", base_model="random-llama-tiny", base_family=c.family,
      hidden_size=c.hidden_size, vocab_size=c.vocab_size), c)
  save_heads(heads, tmp_path / "f32")
  save_heads(heads, tmp_path / "bf16", dtype="bfloat16")
  size = lambda d: (tmp_path / d / "heads.safetensors").stat().st_size
  assert size("bf16") < 0.6 * size("f32")
  loaded = load_heads(tmp_path / "bf16")
  assert loaded.params["fc"].dtype == jnp.float32
  np.testing.assert_array_equal(loaded.params["fc"],
                                heads.params["fc"].astype(jnp.bfloat16).astype(jnp.float32))
  with pytest.raises(mdjax.MdjaxError, match="unsupported dtype"):
    load_heads(tmp_path / "bf16", dtype="float16")
