"""The trainer: data split, tokenizer round trip, overfitting, kill-and-resume, export parity.

Small configs on small folders (the standard library's `json` package), so the whole
file runs in well under a minute and a half on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import mdjax
from configs import lm_tiny_test
from mdjax import losses
from mdjax.checkpoints import hf
from mdjax.models.model import Model
from mdjax.models.random_init import init_params
from mdjax.models.transformer import causal_logits
from mdjax.train import data, distill, export, lm
from mdjax.train import tokenizer as tokenizer_lib
from mdjax.train.config import LMTrainConfig, typed
from tests.helpers import torch_logits

REPO = pathlib.Path(__file__).resolve().parent.parent
SMALL_DATA = data.stdlib_dir() / "json"


def tiny_config(run_dir, **overrides):
  config = lm_tiny_test.get_config()
  config.update(run_dir=str(run_dir), data_dir=str(SMALL_DATA), **overrides)
  return config


@pytest.fixture(scope="module")
def stdlib():
  return data.load_corpus()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """An uninterrupted tiny run (20 steps) and its config."""
  config = tiny_config(tmp_path_factory.mktemp("uninterrupted"))
  return lm.train(config, progress=False), config


def test_split_is_deterministic_disjoint_by_file_and_at_least_5_percent(stdlib):
  again = data.load_corpus()
  assert (again.train, again.heldout) == (stdlib.train, stdlib.heldout)
  names = data.list_files(data.stdlib_dir(), "*.py")
  assert not set(stdlib.train) & set(stdlib.heldout)
  assert sorted(stdlib.train + stdlib.heldout) == names
  assert len(stdlib.heldout) >= 0.05 * len(names)
  assert not any("site-packages" in n for n in names)
  shuffled = list(np.random.default_rng(0).permutation(names))
  assert data.split_files(shuffled, 0.05)[1] == sorted(stdlib.heldout, key=shuffled.index)


def test_tokenizer_round_trips_heldout_files(stdlib, tmp_path):
  tokenizer_lib.save(tokenizer_lib.train_bpe(stdlib.texts("train")[:40], 1024), tmp_path)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert [tokenizer.convert_tokens_to_ids(t) for t in tokenizer_lib.SPECIAL_TOKENS] == [0, 1, 2]
  assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == tokenizer_lib.SPECIAL_TOKENS
  texts = stdlib.texts("heldout")[:8]
  for text in texts:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
  assert tokenizer.decode(tokenizer.encode("naïve → λ\t\n  x", add_special_tokens=False)) == (
      "naïve → λ\t\n  x")


def test_batches_are_a_pure_function_of_the_step():
  sequences = np.arange(10 * 3).reshape(10, 3)
  first, second = data.Batches(sequences, 4, seed=1), data.Batches(sequences, 4, seed=1)
  assert np.array_equal(first.batch(7), second.batch(7))
  assert np.array_equal(first.batch(3), data.Batches(sequences, 4, seed=1).batch(3))
  epoch = np.concatenate([first.batch(s) for s in range(5)])[:10, 0]  # 20 samples = 2 epochs
  assert sorted(epoch) == list(sequences[:, 0])
  assert not np.array_equal(first.batch(0), data.Batches(sequences, 4, seed=2).batch(0))


def test_a_process_builds_only_its_rows_of_a_batch():
  """Each row, whatever its kind (plain, copy, random), is the same built alone."""
  mix = data.RowMix(copy_fraction=0.3, random_copy_fraction=0.3)
  batches = data.Batches(np.arange(40 * 65).reshape(40, 65) % 500 + 10, 8, 3, mix, 500)
  for step in (0, 5):
    assert np.array_equal(batches.batch(step, slice(2, 6)), batches.batch(step)[2:6])


def test_copy_rows_repeat_their_first_half_at_the_requested_rate():
  sequences = np.arange(2000 * 9).reshape(2000, 9) % 1000
  mix = data.RowMix(copy_fraction=0.3)
  plain, copying = data.Batches(sequences, 50, seed=3), data.Batches(sequences, 50, 3, mix)
  batches = [(plain.batch(s), copying.batch(s)) for s in range(40)]
  changed = np.concatenate([(a != b).any(axis=1) for a, b in batches])  # [2000]
  assert 0.25 < changed.mean() < 0.35
  for a, b in batches:
    rows = (a != b).any(axis=1)
    assert np.array_equal(b[rows, :5], a[rows, :5]) and np.array_equal(b[rows, 5:], a[rows, :4])
    assert np.array_equal(b[~rows], a[~rows])
  assert np.array_equal(copying.batch(11), data.Batches(sequences, 50, 3, mix).batch(11))
  with pytest.raises(ValueError, match="copy_fraction must be in"):
    data.Batches(sequences, 4, seed=0, mix=data.RowMix(copy_fraction=1.5))


def test_copy_rows_with_a_minimum_period_repeat_prefixes_of_many_lengths():
  sequences = np.arange(400 * 65).reshape(400, 65)  # every id distinct: periods are exact
  mix = data.RowMix(copy_fraction=1.0, copy_min_period=8)
  copying = data.Batches(sequences, 40, seed=5, mix=mix)
  plain = data.Batches(sequences, 40, seed=5)
  periods = []
  for step in range(10):
    for text, row in zip(plain.batch(step), copying.batch(step)):
      period = next(p for p in range(1, 65) if np.array_equal(row[p:], row[:-p]))
      assert 8 <= period <= 33 and np.array_equal(row[:period], text[:period])
      periods.append(period)
  assert len(set(periods)) > 20  # drawn from 8..33, not one fixed offset
  assert np.array_equal(copying.batch(3), data.Batches(sequences, 40, 5, mix).batch(3))
  with pytest.raises(ValueError, match=r"copy_min_period must be in \[0, 33\]"):
    data.Batches(sequences, 4, seed=0, mix=data.RowMix(copy_fraction=0.5, copy_min_period=34))


def test_copy_rows_shown_twice_show_consecutive_chunks_of_the_row_twice_each():
  sequences = np.arange(400 * 65).reshape(400, 65)  # every id distinct: chunks are exact
  twice = data.Batches(sequences, 40, seed=5,
                       mix=data.RowMix(copy_fraction=1.0, copy_min_period=8, copy_shown_twice=True))
  plain = data.Batches(sequences, 40, seed=5)
  lengths = []
  for step in range(5):
    for text, row in zip(plain.batch(step), twice.batch(step)):
      at, read = 0, 0  # where the next chunk starts in the row and in the text
      while at < 65:
        length = next(n for n in range(8, 34) if at + n >= 65 or row[at + n] == row[at])
        shown = min(length, 65 - at)
        assert np.array_equal(row[at:at + shown], text[read:read + shown])
        repeat = row[at + length:at + 2 * length]  # cut at the row's end
        assert np.array_equal(repeat, row[at:at + len(repeat)])
        lengths.append(length)
        at, read = at + 2 * length, read + length
  assert len(set(lengths)) > 15  # drawn from 8..33 per chunk
  assert data.chunks_shown_twice(np.arange(12), [2, 3]).tolist() == [0, 1, 0, 1, 2, 3, 4, 2, 3, 4, 5, 6]
  first_half = data.Batches(sequences, 8, seed=1,
                            mix=data.RowMix(copy_fraction=1.0, copy_shown_twice=True))
  first_half_rows = data.Batches(sequences, 8, seed=1, mix=data.RowMix(copy_fraction=1.0))
  assert np.array_equal(first_half.batch(2), first_half_rows.batch(2))


def test_random_copy_rows_repeat_a_random_block_beside_the_text_copies():
  sequences = np.arange(2000 * 129).reshape(2000, 129) % 1000
  plain = data.Batches(sequences, 50, seed=3)
  mixed = data.Batches(sequences, 50, seed=3,
                       mix=data.RowMix(copy_fraction=0.2, random_copy_fraction=0.3),
                       vocab_size=5000)
  kinds = []
  for step in range(40):
    a, b = plain.batch(step), mixed.batch(step)
    for text, row in zip(a, b):
      if np.array_equal(text, row):
        kinds.append("plain")
      elif np.array_equal(row[65:], text[:64]):
        kinds.append("copy")
      else:  # a block of 8..64 random ids (>= 3, < 5000) repeated: row[i] == row[i + period]
        period = block_period(row)
        assert row.min() >= data.FIRST_RANDOM_ID and row.max() < 5000 and period <= 64
        kinds.append("random")
  shares = {k: kinds.count(k) / len(kinds) for k in ("plain", "copy", "random")}
  assert 0.15 < shares["copy"] < 0.25 and 0.25 < shares["random"] < 0.35, shares
  again = data.Batches(sequences, 50, seed=3,
                       mix=data.RowMix(copy_fraction=0.2, random_copy_fraction=0.3),
                       vocab_size=5000)
  assert np.array_equal(again.batch(7), mixed.batch(7))
  with pytest.raises(ValueError, match=r"copy_fraction \+ random_copy_fraction must sum to"):
    data.Batches(sequences, 4, seed=0,
                 mix=data.RowMix(copy_fraction=0.6, random_copy_fraction=0.6), vocab_size=9)


def test_rows_are_drawn_as_the_shipped_models_trained_on_them():
  """Pinned digests of the rows of the shipped pair's last stages (code-tiny stage 20,
  code-tiny-draft stage 10) and of random blocks repeated over and over (earlier stages):
  a change to any draw or `data.Stream` changes them, and with them what a seed trains on."""
  sequences = np.tile(np.arange(129), (50, 1))  # rows alike: the permutations do not matter
  mixes = {
      "4b9d348c3c3a2bbe": data.RowMix(copy_fraction=0.5, copy_min_period=16, copy_shown_twice=True,
                                      random_copy_fraction=0.3, random_copy_shown_twice=True,
                                      random_copy_common_share=0.3),
      "73dcedf2e35259fa": data.RowMix(copy_fraction=0.2, copy_min_period=16,
                                      random_copy_fraction=0.3, random_copy_shown_twice=True),
      "fec8dd79420f98a2": data.RowMix(copy_fraction=0.4, random_copy_fraction=0.4,
                                      random_copy_common_share=0.3)}
  for digest, mix in mixes.items():
    batches = data.Batches(sequences, 16, seed=0, mix=mix, vocab_size=8192)
    rows = np.concatenate([batches.batch(step) for step in range(4)]).astype(np.int64)
    assert hashlib.sha256(rows.tobytes()).hexdigest()[:16] == digest, mix


def block_period(row: np.ndarray) -> int:
  """The length (8..64) of the block `row` repeats over and over from its start."""
  return next(p for p in range(8, 65) if np.array_equal(row[p:], row[:-p]))


def repeated_blocks(seed: int, steps: int, **options) -> list[np.ndarray]:
  """Each random row's repeated block (the row is it over and over, 8..64 long), for
  `steps` batches of 50 rows of 129 tokens over 5000 ids."""
  batches = data.Batches(np.zeros((2000, 129), np.int64), 50, seed=seed,
                         mix=data.RowMix(random_copy_fraction=1.0, **options), vocab_size=5000)
  found = []
  for step in range(steps):
    for row in batches.batch(step):
      assert row.min() >= data.FIRST_RANDOM_ID and row.max() < 5000
      found.append(row[:block_period(row)])
  return found


def test_random_rows_with_common_ids_put_a_few_ids_among_rare_ones_at_the_share_asked():
  sequences = np.zeros((2000, 129), np.int64)

  def blocks(common_share: float) -> list[np.ndarray]:
    return repeated_blocks(8, 10, random_copy_common_share=common_share)

  plain, mixed = blocks(0.0), blocks(0.3)
  assert all(np.array_equal(a, b) for a, b in zip(plain, blocks(0.0)))
  changed, recurring = [], []
  for before, after in zip(plain, mixed):
    assert len(before) == len(after)  # the same block, some positions overwritten
    common = after[after != before]
    assert len(set(common.tolist())) <= 8  # by one of the block's 2..8 common ids
    changed.append(common.size / after.size)
    ids, counts = np.unique(after, return_counts=True)
    recurring.append(np.count_nonzero(counts > 1))  # 64 of 4997 ids alone rarely recur
  assert 0.25 < np.mean(changed) < 0.35, np.mean(changed)
  assert np.mean(recurring) > 2 and np.mean([r > 0 for r in recurring]) > 0.9
  assert np.array_equal(blocks(0.3)[77], mixed[77])  # a pure function of (seed, step)
  for bad in (-0.1, 1.0):
    with pytest.raises(ValueError, match=r"random_copy_common_share must be in \[0, 1\)"):
      data.Batches(sequences, 4, seed=0,
                   mix=data.RowMix(random_copy_fraction=0.5, random_copy_common_share=bad),
                   vocab_size=5000)


def test_match_needed_counts_the_ids_a_copy_must_match_to_know_where_to_copy_from():
  ids = {c: i for i, c in enumerate("abcdxy")}

  def needed(text: str, longest: int = 32) -> int:
    return data.match_needed(np.array([ids[c] for c in text.replace(" ", "")]), longest)

  assert needed("abcabd abcab") == 3  # "b" and "a b" occur 3 times before, "c a b" once
  assert needed("abcabd abcabd a") == 2  # "a" 4 times before, "d a" once
  assert needed("xabcd xabc") == 1  # every id of the block is unique
  assert needed("ababab ababa") == 8  # only "b a b a b a b a" occurs once before
  assert needed("ababab ababa", longest=4) == 5  # none up to 4 does
  assert needed("abcd y") == 1  # "y" never occurred: nothing to copy from, nothing to match


def test_random_rows_shown_twice_are_fresh_blocks_each_followed_by_itself():
  sequences = np.zeros((500, 513), np.int64)
  mix = data.RowMix(random_copy_fraction=1.0, random_copy_shown_twice=True)
  batches = data.Batches(sequences, 50, seed=9, mix=mix, vocab_size=5000)
  over_and_over = data.Batches(sequences, 50, seed=9, mix=data.RowMix(random_copy_fraction=1.0),
                               vocab_size=5000)
  blocks_per_row = []
  for step in range(6):
    for row, first in zip(batches.batch(step), over_and_over.batch(step)):
      start, blocks = 0, 0
      while True:
        size = next((n for n in range(8, 65) if start + 2 * n <= len(row) and
                     np.array_equal(row[start + n:start + 2 * n], row[start:start + n])), 0)
        if not size:  # the row's end cut the last pair
          assert len(row) - start < 2 * 64
          break
        if blocks:  # a fresh block: its ids are not the previous block's
          assert not np.array_equal(row[start:start + size], row[start - size:start])
        start, blocks = start + 2 * size, blocks + 1
      blocks_per_row.append(blocks)
      period = block_period(first)
      assert np.array_equal(row[:2 * period], first[:2 * period])  # the same first block
  assert min(blocks_per_row) >= 4 and np.mean(blocks_per_row) > 6  # pairs of 2 x 8..64 ids
  assert np.array_equal(batches.batch(3), data.Batches(sequences, 50, 9, mix, 5000).batch(3))


def test_the_card_names_every_kind_of_copy_row_the_run_trained_on():
  summary = {"steps": 100, "copy_fraction": 0.2, "copy_min_period": 16, "random_copy_fraction": 0.1,
             "init_from": ""}
  lines = export.continuation_line(summary).splitlines()
  assert [line.split(" of the sequences")[0] for line in lines] == ["20%", "10%"]
  assert "16 tokens to half the row long" in lines[0]
  assert "30% of their positions one of the block's 2..8 common ids" in export.continuation_line(
      {**summary, "random_copy_common_share": 0.3}).splitlines()[1]
  assert "10% of the sequences show blocks of random ids twice each" in export.continuation_line(
      {**summary, "random_copy_shown_twice": True})
  assert "20% of the sequences show consecutive chunks of their own twice each, 16 tokens" in (
      export.continuation_line({**summary, "copy_shown_twice": True}))


def test_pack_overlaps_windows_by_one_token():
  packed = data.pack(np.arange(10), 3)
  assert packed.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]


def test_trainer_overfits_one_batch():
  config = lm_tiny_test.get_config()
  config.optim.update(lr=1e-2, warmup_steps=10, weight_decay=0.0)
  config.steps = 300
  config = typed(LMTrainConfig, config)
  cfg = lm.model_config(config, vocab_size=64)
  optimizer = lm.make_optimizer(config)
  params = init_params(cfg, 0)
  state = {"params": params, "opt_state": optimizer.init(params)}
  step = lm.make_train_step(cfg, optimizer)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)
  for _ in range(config.steps):
    state, metrics = step(state, batch)
  assert float(metrics["loss"]) < 0.1


def test_copy_evaluation_scores_exactly_the_repeated_tokens_after_the_first(trained):
  result, config = trained
  sequences = result.data.heldout[:3]  # [3, T + 1]
  got = lm.evaluate_copying(result.params, sequences, result.model_config, batch_size=2)
  rows = data.repeat_first_half(sequences)
  half, width = (sequences.shape[1] + 1) // 2, sequences.shape[1]
  scored = np.arange(half + 1, width)  # positions of a1, a2, ... in the repeated half
  assert np.array_equal(rows[:, scored], sequences[:, scored - half])
  losses, predicted = lm.token_losses(result.params, jnp.asarray(rows), result.model_config)
  correct = np.asarray(predicted) == rows[:, 1:]
  assert got["loss"] == pytest.approx(float(np.asarray(losses)[:, scored - 1].mean()), rel=1e-5)
  assert got["accuracy"] == pytest.approx(float(np.asarray(correct)[:, scored - 1].mean()))
  # greedy_copy: decode greedily after the original and the repeat's first 4 tokens
  copies = rows[:, half + lm.COPY_SHOWN:half + lm.COPY_SHOWN + lm.COPY_RUN]  # the tokens to copy
  expected = [_greedy(result, row[:half + lm.COPY_SHOWN], copies.shape[1]) == copy.tolist()
              for row, copy in zip(rows, copies)]
  assert got["greedy_copy"] == pytest.approx(np.mean(expected))
  evaluations = [json.loads(line) for line in
                 (pathlib.Path(config.run_dir) / "metrics.jsonl").read_text().splitlines()
                 if "heldout_loss" in line]
  assert evaluations and all("heldout_copy_accuracy" in r and "heldout_greedy_copy" in r
                             and "random_copy_accuracy" in r for r in evaluations)


def test_induction_evaluation_scores_the_repeat_of_random_blocks(trained):
  result, _ = trained
  cfg = result.model_config
  got = lm.evaluate_induction(result.params, cfg, batch_size=4, rows=5)
  block = cfg.max_position_embeddings // 2  # 16 < 64 in the tiny config
  ids = np.random.default_rng(0).integers(data.FIRST_RANDOM_ID, cfg.vocab_size, (5, block))
  rows = np.concatenate([ids, ids], axis=1)
  _, predicted = lm.token_losses(result.params, jnp.asarray(rows), cfg)
  correct = np.asarray(predicted) == rows[:, 1:]
  assert got == pytest.approx(float(correct[:, block:].mean()))


def test_induction_rows_over_an_alphabet_draw_each_block_from_that_many_ids(trained):
  cfg = trained[0].model_config
  whole, block = lm.induction_rows(cfg, rows=6)
  small, same_block = lm.induction_rows(cfg, rows=6, alphabet=3)
  assert block == same_block and small.shape == whole.shape == (6, 2 * block)
  for rows in (small, whole):
    assert np.array_equal(rows[:, :block], rows[:, block:])  # each block shown twice
    assert rows.min() >= data.FIRST_RANDOM_ID and rows.max() < cfg.vocab_size
  assert max(len(set(row[:block].tolist())) for row in small) <= 3
  assert len({tuple(sorted(set(row.tolist()))) for row in small}) > 1  # an alphabet per block
  assert np.array_equal(lm.induction_rows(cfg, rows=6, alphabet=3)[0], small)
  mixed, _ = lm.induction_rows(cfg, rows=6, common_share=0.5)
  assert np.array_equal(mixed[:, :block], mixed[:, block:])
  changed = mixed != whole  # the same whole-vocabulary blocks, some positions overwritten
  assert 0.3 < changed.mean() < 0.7
  assert all(len(set(row[at].tolist())) <= 8 for row, at in zip(mixed, changed))
  assert np.mean([len(set(row[:block].tolist())) < block for row in mixed]) > 0.8  # recurring
  phrased, _ = lm.induction_rows(cfg, rows=6, phrase_rate=0.3)
  assert np.array_equal(phrased[:, :block], phrased[:, block:])
  assert np.mean(phrased != whole) > 0.15  # phrases written over the same rows

  def needs_three(rows: np.ndarray) -> float:
    """The share of the repeat's positions where a copy must match 3 or more ids."""
    return np.mean([data.match_needed(row[:t + 1]) >= 3 for row in rows
                    for t in range(block, 2 * block - 1)])

  assert needs_three(phrased) > 2 * needs_three(whole) + 0.05  # after a phrase, a longer match


def test_greedy_copy_needs_every_token_after_the_shown_ones_right():
  half, width = 10, 10 + lm.COPY_SHOWN + lm.COPY_RUN + 5
  correct = np.ones((4, width), bool)
  correct[0, half + lm.COPY_SHOWN - 1] = False  # the first copied token wrong
  correct[1, half + lm.COPY_SHOWN + lm.COPY_RUN - 2] = False  # the last one wrong
  correct[2, half + lm.COPY_SHOWN - 2] = False  # a shown token wrong: not part of the copy
  correct[3, half + lm.COPY_SHOWN + lm.COPY_RUN - 1] = False  # the token after the 32
  assert lm.greedy_copied(correct, half).tolist() == [False, False, True, True]


def _greedy(result, prompt: np.ndarray, steps: int) -> list[int]:
  """`steps` greedy tokens after `prompt` `[P]`: one full forward pass per token over a
  fixed-length buffer (causal, so the unwritten tail does not change earlier logits)."""
  tokens = np.zeros((1, len(prompt) + steps), np.int32)
  tokens[0, :len(prompt)] = prompt
  forward = jax.jit(lambda t: causal_logits(result.params, t, config=result.model_config))
  for position in range(len(prompt), tokens.shape[1]):
    tokens[0, position] = int(jnp.argmax(forward(jnp.asarray(tokens))[0, position - 1]))
  return tokens[0, len(prompt):].tolist()


def _train_command(run_dir) -> list[str]:
  return [sys.executable, "-m", "experiments.train_lm", "--config=configs/lm_tiny_test.py",
          f"--config.run_dir={run_dir}", f"--config.data_dir={SMALL_DATA}"]


def test_killed_run_resumes_to_bitwise_the_same_params(trained, tmp_path):
  result, config = trained
  run_dir = tmp_path / "killed"
  process = subprocess.Popen(_train_command(run_dir), cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  checkpoints = run_dir / "checkpoints"
  deadline = time.time() + 120
  while not (checkpoints / "10").is_dir():
    assert process.poll() is None and time.time() < deadline, "no checkpoint at step 10"
    time.sleep(0.01)
  os.kill(process.pid, signal.SIGKILL)
  process.wait()
  done = [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
  assert max(done) < config.steps, "the run finished before it was killed"

  resumed = lm.train(tiny_config(run_dir), progress=False)
  for got, want in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(result.params)):
    assert np.array_equal(np.asarray(got), np.asarray(want))
  steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
           if "loss" in r]
  assert steps == sorted(set(steps)) and steps[-1] == config.steps


def test_export_loads_in_mdjax_and_transformers_with_the_same_logits(trained, tmp_path):
  result, config = trained
  summary = export.export(result, result.config, tmp_path / "export")
  model = mdjax.load(tmp_path / "export", dtype="float32")
  assert model.tokenizer is not None and model.tokenizer.eos_token_id == 1
  ids = result.data.heldout[0, :24]
  ours = mdjax.forward_logits(model, ids)
  in_memory = np.asarray(causal_logits(result.params, jnp.asarray(ids)[None],
                                       config=result.model_config)[0])
  torch_model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "export"))
  np.testing.assert_allclose(ours, torch_logits(torch_model.eval(), ids), atol=1e-4)
  np.testing.assert_allclose(ours, in_memory, atol=1e-4)
  again = lm.evaluate(model.params, result.data.heldout, model.config, config.batch_size)
  assert again["accuracy"] == pytest.approx(summary["heldout_accuracy"], abs=1e-6)
  assert json.loads((tmp_path / "export" / "heldout_files.json").read_text())["heldout"] == list(
      result.corpus.heldout)
  fingerprint = json.loads((tmp_path / "export" / "fingerprint.json").read_text())
  recomputed = lm.evaluate(model.params, np.asarray(fingerprint["sequences"]), model.config, 4)
  assert recomputed == pytest.approx({k: fingerprint[k] for k in ("loss", "accuracy")}, abs=1e-6)


def test_export_shards_on_request_and_loads_the_same_weights(trained, tmp_path):
  result, config = trained
  sharded = config.copy_and_resolve_references()
  sharded.export_shard_mb = 0.02  # the tiny model has 0.14 MiB of float32 weights
  export.export(result, lm.validate(sharded), tmp_path / "sharded")
  assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
  assert not (tmp_path / "sharded" / "model.safetensors").exists()
  model = mdjax.load(tmp_path / "sharded", dtype="float32")
  for got, want in zip(jax.tree.leaves(model.params), jax.tree.leaves(result.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  sharded.export_shard_mb = -1.0
  with pytest.raises(ValueError, match="export_shard_mb must be >= 0"):
    lm.validate(sharded)


def test_the_config_is_typed_once_and_a_bad_field_is_named(tmp_path):
  """`lm.validate` (where `lm.train` starts) turns the user's ConfigDict into a frozen
  `LMTrainConfig`, its nested `optim` and `model` into dataclasses too; a field that is
  unknown, missing or of another type is an error naming it."""
  config = tiny_config(tmp_path / "run")
  checked = lm.validate(config)
  assert isinstance(checked, LMTrainConfig) and lm.validate(checked) is checked
  assert (checked.optim.lr, checked.model.hidden_size, checked.seq_len) == (0.01, 32, 32)
  with pytest.raises(dataclasses.FrozenInstanceError):
    checked.steps = 3
  config.update(stpes=3)
  with pytest.raises(mdjax.MdjaxError, match=r"unknown field config\.stpes .*config\.steps\?"):
    lm.validate(config)
  breaks = {"config.optim.lr must be a number, got 'fast'": lambda c: c["optim"].update(lr="fast"),
            "config.steps must be an integer, got 2.5": lambda c: c.update(steps=2.5),
            "config.steps must be an integer, got True": lambda c: c.update(steps=True),
            "LMTrainConfig lacks config.seq_len": lambda c: c.pop("seq_len")}
  for message, broken in breaks.items():
    plain = tiny_config(tmp_path / "run").to_dict()
    broken(plain)
    with pytest.raises(mdjax.MdjaxError, match=re.escape(message)):
      lm.validate(plain)
  plain = tiny_config(tmp_path / "run").to_dict()
  plain["optim"]["lr"] = 1  # an integer is a number
  assert lm.validate(plain).optim.lr == 1.0


def test_validate_rejects_a_bad_row_mix_before_reading_data(tmp_path):
  config = tiny_config(tmp_path / "run", copy_fraction=0.7, random_copy_fraction=0.5)
  with pytest.raises(ValueError, match=r"must sum to <= 1, got 0.7 \+ 0.5"):
    lm.validate(config)


def test_a_copy_period_longer_than_half_a_row_fails_before_any_data_is_read(tmp_path):
  config = tiny_config(tmp_path / "run", copy_fraction=0.5, copy_min_period=18)  # rows of 33
  config.data_dir = str(tmp_path / "absent")  # were it read first, this would fail first
  with pytest.raises(ValueError, match=r"copy_min_period must be in \[0, 17\]"):
    lm.train(config, progress=False)


def test_init_from_continues_an_export_and_counts_all_tokens(trained, tmp_path):
  result, config = trained
  export.export(result, result.config, tmp_path / "first")
  continued = tiny_config(tmp_path / "continued", init_from=str(tmp_path / "first"), steps=5)
  before = lm.initial_params(lm.validate(continued), result.model_config)
  for got, want in zip(jax.tree.leaves(before), jax.tree.leaves(result.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  run = lm.train(continued, progress=False)
  summary = export.export(run, run.config, tmp_path / "second")
  assert summary["tokens_seen_total"] == summary["tokens_seen"] + config.steps * 4 * 32
  assert "Continued from the weights of" in (tmp_path / "second" / "README.md").read_text()
  wider = tiny_config(tmp_path / "wider", init_from=str(tmp_path / "first"))
  wider.model.hidden_size = 64
  wider = lm.validate(wider)
  with pytest.raises(ValueError, match="hidden_size: 32 vs 64"):
    lm.initial_params(wider, lm.model_config(wider, result.model_config.vocab_size))


def test_export_only_before_any_checkpoint_exports_init_from_as_it_is(trained, tmp_path):
  """A soup (or grown model) gets a card, held-out numbers and a fingerprint with no step."""
  result, config = trained
  export.export(result, result.config, tmp_path / "start")
  record = json.loads((tmp_path / "start" / "training_summary.json").read_text())
  record["averaged_from"] = [{"model": "a", "weight": 0.5}, {"model": "b", "weight": 0.5}]
  (tmp_path / "start" / "training_summary.json").write_text(json.dumps(record))
  as_is = tiny_config(tmp_path / "as-is", init_from=str(tmp_path / "start"), copy_fraction=0.3)
  run = lm.train(as_is, progress=False, restore_only=True)
  assert run.step == 0
  for got, want in zip(jax.tree.leaves(run.params), jax.tree.leaves(result.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  summary = export.export(run, run.config, tmp_path / "exported")
  assert summary["tokens_seen_total"] == record["tokens_seen_total"]
  assert summary["heldout_loss"] == pytest.approx(record["heldout_loss"], abs=1e-6)
  card = (tmp_path / "exported" / "README.md").read_text()
  assert "No training step: exported only" in card and "as they are" in card
  assert "the average of the weights of `a` x 0.5, `b` x 0.5" in card
  assert "Continued from" not in card
  assert "copy rows" not in card and "copy_fraction" not in summary  # no step, no row mix
  with pytest.raises(ValueError, match="no checkpoint to export .* and no init_from"):
    lm.train(tiny_config(tmp_path / "empty"), progress=False, restore_only=True)


def test_init_from_a_tied_export_can_continue_untied_with_the_same_logits(tmp_path):
  untied = lm.validate(tiny_config(tmp_path / "untied", init_from=str(tmp_path / "tied")))
  untied_model = lm.model_config(untied, 300)
  tied_model = dataclasses.replace(untied_model, tie_word_embeddings=True)
  tied_params = init_params(tied_model, seed=3)
  hf.save_hf(Model(config=tied_model, params=tied_params), tmp_path / "tied")
  params = lm.initial_params(untied, untied_model)
  assert set(params) == set(tied_params) | {"lm_head"}
  tokens = jnp.arange(1, 17)[None]  # [1, 16]
  np.testing.assert_array_equal(np.asarray(causal_logits(params, tokens, config=untied_model)),
                                np.asarray(causal_logits(tied_params, tokens, config=tied_model)))
  hf.save_hf(Model(config=untied_model, params=params), tmp_path / "untied-export")
  back = lm.validate(tiny_config(tmp_path / "back", init_from=str(tmp_path / "untied-export")))
  with pytest.raises(ValueError, match="tie_word_embeddings: False vs True"):
    lm.initial_params(back, tied_model)  # an untied head cannot be folded back losslessly


def test_kl_to_teacher_is_zero_at_the_teacher_and_matches_a_hand_computation():
  teacher = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))
  student = jnp.log(jnp.array([[[0.25, 0.5, 0.25]]]))
  assert float(losses.kl_to_teacher(teacher, teacher, 1.0)[0, 0]) == pytest.approx(0, abs=1e-7)
  want = 0.5 * np.log(2) + 0.25 * np.log(0.5)  # sum p log(p / q)
  assert float(losses.kl_to_teacher(student, teacher, 1.0)[0, 0]) == pytest.approx(want, rel=1e-5)
  flat = jnp.zeros((1, 1, 3))  # at a high temperature both laws flatten: the KL shrinks
  assert float(losses.kl_to_teacher(flat, teacher, 4.0)[0, 0]) < float(
      losses.kl_to_teacher(flat, teacher, 1.0)[0, 0])


def sharp_random_teacher(run: lm.Run, directory) -> str:
  """A model whose argmax the data cannot teach: random weights, logits scaled x30."""
  params = init_params(run.model_config, 5)
  params["lm_head"] = params["lm_head"] * 30
  hf.save_hf(Model(config=run.model_config, params=params, tokenizer=run.tokenizer,
                   name="teacher"), directory)
  return str(directory)


def test_distilling_pulls_the_student_to_the_teacher_argmax(trained, tmp_path):
  result, config = trained
  teacher = sharp_random_teacher(result, tmp_path / "teacher")
  configs = {weight: tiny_config(  # 0: the data only (no teacher); 1: the teacher only
      tmp_path / f"student-{weight}", seed=1, distill_weight=weight or 0.5,
      tokenizer=str(pathlib.Path(config.run_dir) / "tokenizer"),
      teacher=teacher if weight else "") for weight in (0.0, 1.0)}
  runs = {weight: lm.train(c, progress=False) for weight, c in configs.items()}
  agree = {w: distill.agreement(r.params, r.model_config, runs[1.0].teacher, result.data.heldout, 4)
           for w, r in runs.items()}
  assert agree[0.0] < 0.1 and agree[1.0] > 0.3, agree  # measured: 0.016 and 0.55
  summary = export.export(runs[1.0], runs[1.0].config, tmp_path / "distilled")
  assert summary["heldout_teacher_agreement"] == pytest.approx(agree[1.0], abs=1e-6)
  assert "Distilled from" in (tmp_path / "distilled" / "README.md").read_text()
  records = (tmp_path / "student-1.0" / "metrics.jsonl").read_text()
  assert "heldout_teacher_agreement" in records


def test_a_teacher_with_another_vocabulary_is_refused(trained, tmp_path):
  result, config = trained
  teacher = sharp_random_teacher(result, tmp_path / "teacher")
  student = lm.model_config(result.config, vocab_size=result.model_config.vocab_size + 1)
  with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the student \d+"):
    distill.load_teacher(lm.validate(tiny_config(tmp_path, teacher=teacher)), student)
  with pytest.raises(ValueError, match="distill_weight must be in"):
    distill.load_teacher(lm.validate(tiny_config(tmp_path, teacher=teacher, distill_weight=0.0)),
                         result.model_config)
