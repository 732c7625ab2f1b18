"""The shipped models: they load offline, are the files their cards describe, and
reproduce the held-out numbers recorded when they were exported."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

import mdjax
from mdjax.train import data, lm

SHIPPED = ("code-tiny", "code-tiny-draft")


@pytest.fixture(scope="module", params=SHIPPED)
def shipped(request, monkeypatch_module):
  monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")  # nothing may come from the hub
  return mdjax.load(request.param)


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as patch:
    yield patch


def test_loads_offline_with_its_tokenizer(shipped):
  assert shipped.tokenizer is not None
  assert pathlib.Path(shipped.path).parent.name == "assets"
  text = "def add(a, b):\n    return a + b\n"
  assert shipped.tokenizer.decode(shipped.tokenizer.encode(text)) == text


def test_reproduces_its_recorded_fingerprint(shipped):
  """Loss and accuracy on the recorded held-out sequences match the export's own."""
  fingerprint = json.loads((pathlib.Path(shipped.path) / "fingerprint.json").read_text())
  sequences = np.asarray(fingerprint["sequences"])
  result = lm.evaluate(shipped.params, sequences, shipped.config, batch_size=len(sequences))
  assert result["loss"] == pytest.approx(fingerprint["loss"], abs=1e-3)
  assert result["accuracy"] == pytest.approx(fingerprint["accuracy"], abs=2 / sequences[:, 1:].size)


def test_target_and_draft_are_a_pair():
  target, draft = (mdjax.load(name) for name in SHIPPED)
  assert target.config.vocab_size == draft.config.vocab_size
  assert target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
  assert target.config.num_params >= 8_000_000
  assert target.config.num_params / draft.config.num_params >= 5


def test_the_main_job_prompt_comes_from_a_heldout_file():
  """The default prompt is lines of `secrets.py` (doctest examples left out), a file
  the shipped models never trained on."""
  from configs import common
  config = common.get_base_config("greedy")
  record = json.loads((pathlib.Path(mdjax.load(config.model).path) / "heldout_files.json").read_text())
  assert config.model == "code-tiny" and "secrets.py" in record["heldout"]
  source = iter((data.stdlib_dir() / "secrets.py").read_text().splitlines())
  assert all(line in source for line in config.prompt.splitlines())  # in order


def test_copy_accuracy_by_token_count_scores_each_copied_token_in_its_band(shipped):
  """eval_lm's bands, recomputed position by position: with count = id, the band of a
  scored token is the band of its id, so a band taken one position off would differ."""
  from experiments import eval_lm
  fingerprint = json.loads((pathlib.Path(shipped.path) / "fingerprint.json").read_text())
  sequences = np.asarray(fingerprint["sequences"])[:4]  # [4, T + 1]
  counts = np.arange(shipped.config.vocab_size)
  rows = data.repeat_first_half(sequences)
  half, width = data.first_half(sequences.shape[1]), sequences.shape[1]
  got = eval_lm.copy_accuracy_by_token_count(shipped, rows, half, counts)
  scored = np.arange(half + 1, width)  # positions of the copied tokens a1 .. a(h-1)
  _, predicted = lm.token_losses(shipped.params, rows, shipped.config)
  right = np.asarray(predicted)[:, scored - 1] == rows[:, scored]
  edges = eval_lm.FREQUENCY_BANDS + (shipped.config.vocab_size,)
  expected = {}
  for lo, hi in zip(edges, edges[1:]):
    in_band = (rows[:, scored] >= lo) & (rows[:, scored] < hi)
    if in_band.any():
      expected[lo] = (int(in_band.sum()), pytest.approx(float(right[in_band].mean())))
  assert [(band["tokens"], band["accuracy"]) for band in got.values()] == list(expected.values())
  assert sum(band["tokens"] for band in got.values()) == right.size


def test_accuracy_by_band_puts_each_count_in_the_band_that_starts_at_or_below_it():
  from experiments import eval_lm
  correct = np.array([[True, False, True], [True, True, False]])
  counts = np.array([[0, 15, 16], [64, 5000, 63]])
  got = eval_lm.accuracy_by_band(correct, counts, (0, 16, 64))
  assert got == {"0-15": {"tokens": 2, "accuracy": 0.5}, "16-63": {"tokens": 2, "accuracy": 0.5},
                 ">=64": {"tokens": 2, "accuracy": 1.0}}


def test_copy_task_takes_top_level_functions_or_methods_of_the_lines_asked():
  from experiments import eval_lm
  method = "    def method(self):\n        a = 1\n        b = 2\n        return a + b"
  function = "def function(x):\n    y = x\n    z = y\n    return z"
  short = "def short():\n    return 1"
  text = f"{short}\n\n{function}\n\nclass C:\n{method}\n\n    x = 1\n"
  assert eval_lm.functions_to_copy([text, "def broken(:"], 8) == [function]
  assert eval_lm.functions_to_copy([text], 8, kind="methods") == [method]
  assert eval_lm.functions_to_copy([text, text], 1, kind="methods") == [method]
  assert eval_lm.functions_to_copy([text], 8, lines=(2, 3)) == [short]


def test_copy_prompt_asks_for_the_rest_and_long_functions_do_not_fit(shipped):
  from experiments import eval_lm
  function = "def f(x):\n    y = x\n    return y"
  prompt, expected = eval_lm.copy_prompt(shipped, function)
  assert prompt.startswith(function) and prompt.endswith("\ndef f(x):")
  assert shipped.tokenizer.decode(expected) == "\n    y = x\n    return y"
  assert eval_lm.fits_the_context(shipped, function)
  body = "\n".join(f"    v{i} = {i}" for i in range(shipped.config.max_position_embeddings // 8))
  assert not eval_lm.fits_the_context(shipped, f"def g():\n{body}")


def test_embedding_similarity_is_1_for_parallel_and_0_for_orthogonal_embeddings(shipped):
  """Ids 0-2 (band >=1024) get parallel embeddings, ids 3-5 (band 0-15) orthogonal ones,
  the rest (band 16-63) random ones."""
  from experiments import eval_lm
  counts = np.full(shipped.config.vocab_size, 20)
  counts[:3], counts[3:6] = 5000, 0
  embed = np.random.default_rng(0).normal(size=np.shape(shipped.params["embed"]))
  embed[1], embed[2] = 2 * embed[0], 0.5 * embed[0]
  embed[3:6] = np.eye(embed.shape[1])[:3]
  model = dataclasses.replace(shipped, params={**shipped.params, "embed": embed})
  got = eval_lm.embedding_similarity_by_token_count(model, counts)
  assert set(got) == {"0-15", "16-63", ">=1024"}
  assert got[">=1024"] == pytest.approx(1.0) and got["0-15"] == pytest.approx(0.0, abs=1e-12)
  assert abs(got["16-63"]) < 0.05


def test_random_copy_after_repeated_ids_splits_by_how_often_the_block_holds_the_id_before(
    shipped, monkeypatch):
  """A stand-in model right exactly after ids its block holds more than once scores 1
  there and 0 elsewhere, so a split taken one position off would mix them."""
  from experiments import eval_lm

  def right_after_repeated(params, sequences, config, batch_size):
    del params, config, batch_size
    block = sequences.shape[1] // 2
    held = np.array([[np.count_nonzero(row[:block] == i) for i in row[:-1]] for row in sequences])
    return None, np.where(held > 1, sequences[:, 1:], -1)

  monkeypatch.setattr(lm, "token_scores", right_after_repeated)
  got = eval_lm.random_copy_after_repeated_ids(shipped, rows=4)
  assert got == {"after_a_repeated_id": 1.0, "after_a_unique_id": 0.0}


def test_copy_accuracy_by_match_needed_splits_by_the_match_each_position_needs(shipped,
                                                                               monkeypatch):
  """A stand-in model right exactly where a copy must match 3 or more ids scores 1 in
  those bands and 0 in the others, so a split taken one position off would mix them."""
  from experiments import eval_lm

  def right_after_long_matches(params, sequences, config, batch_size):
    del params, config, batch_size
    long = np.array([[data.match_needed(row[:t + 1]) >= 3 for t in range(row.size - 1)]
                     for row in sequences])
    return None, np.where(long, sequences[:, 1:], -1)

  monkeypatch.setattr(lm, "token_scores", right_after_long_matches)
  rows, block = lm.induction_rows(shipped.config, rows=4, common_share=0.3, phrase_rate=0.2)
  got = eval_lm.copy_accuracy_by_match_needed(shipped, rows, block)
  assert {band: got[band]["accuracy"] for band in got} == {
      "1-1": 0.0, "2-2": 0.0, "3-3": 1.0, "4-5": 1.0, **{band: 1.0 for band in ("6-8", ">=9")
                                                         if band in got}}
  assert sum(band["tokens"] for band in got.values()) == 4 * (block - 1)


def test_copy_task_counts_exact_copies_and_classes_each_first_miss(shipped, monkeypatch):
  from experiments import eval_lm
  function = "def f(a, b):\n    x = a\n    y = b\n    return x + y"
  expected = shipped.tokenizer.encode("\n" + function.split("\n", 1)[1])
  newline = 1 + expected[1:].index(expected[0])  # the newline and indent before `y = b`
  copied = expected[:newline + 1]  # then, after a token the function holds three times:
  wrong = {"exact": list(expected),
           "copied_from_elsewhere": copied + [expected[-1]] * 40,  # ` y`, from the function
           "expected_otherwise": copied + shipped.tokenizer.encode(" zebra") * 40}
  for name, tokens in wrong.items():
    monkeypatch.setattr(mdjax, "generate", lambda model, prompt, tokens=tokens, **kwargs:
                        mdjax.GenerationOutput(sequences=[tokens[:len(expected)]], stats={},
                                               texts=[""]))
    got = eval_lm.copy_task(shipped, [function])
    assert (got["exact_copies"], got["misses_after_a_repeated_token"],
            got["misses_writing_a_token_of_the_function"]) == {
                "exact": (1, 0, 0), "copied_from_elsewhere": (0, 1, 1),
                "expected_otherwise": (0, 1, 0)}[name], name
    # the newline and indent occur 3 times: one token of context cannot say which
    right = {"exact": len(expected), "copied_from_elsewhere": len(copied) + 1,  # ` y` is right
             "expected_otherwise": len(copied)}[name]  # tokens before the first miss
    assert got["prefix_copied_by_function"] == [round(right / len(expected), 4)]
    assert len(got["misses_match_needed"]) == (name != "exact")
    assert all(n >= 2 for n in got["misses_match_needed"])
