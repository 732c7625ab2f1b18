"""margins: every phase's output equals its sequential counterpart."""

import numpy as np
import pytest

import mdjax
from mdjax.pipelines import margins
from mdjax.train import data
from tests.helpers import random_model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_margin_notes_see_the_running_prefix_and_the_instruction(family):
  model = random_model(family, seed=6)
  rng = np.random.default_rng(1)
  contexts = [[rng.integers(3, 64, n).tolist() for n in (6, 3, 5)],
              [rng.integers(3, 64, n).tolist() for n in (4, 4)]]
  instruction = [7, 8, 9]
  out = mdjax.generate(model, contexts, strategy="margin_notes", instruction=instruction,
                       max_new_tokens=9, eos_token_id=[])
  expected = [mdjax.generate(model, [sum(chunks[:j + 1], []) + instruction], max_new_tokens=9,
                             eos_token_id=[]).sequences[0]
              for chunks in contexts for j in range(len(chunks))]
  assert out.sequences == expected
  assert out.stats["target_passes"] == 8
  with pytest.raises(ValueError, match="strategy 'margin_notes' needs the option 'instruction'"):
    mdjax.generate(model, contexts, strategy="margin_notes", max_new_tokens=9)


@pytest.fixture(scope="module")
def code_model():
  return mdjax.load("code-tiny")


def test_pipeline_phases_equal_their_sequential_counterparts(code_model):
  model = code_model
  context = data.recorded_heldout_texts(model.path)[0][:1500]
  question = "What does the code return?"
  out = mdjax.pipelines.run("margins", model, context, question=question, chunk_tokens=120,
                            note_tokens=10, classify_tokens=2, keep_pattern=r"(?s).",
                            max_new_tokens=12)
  (steps,) = out.intermediate
  (ids,) = mdjax.encode_prompts(model, [context])
  chunks = margins.chunk_ids(ids, 120)
  assert len(steps["notes"]) == len(chunks) >= 3
  instruction = model.tokenizer.encode(margins.INSTRUCTION, add_special_tokens=False)
  prefix = model.tokenizer.encode(margins.CLASSIFY_PREFIX.format(question=question))
  for j, (note, label) in enumerate(zip(steps["notes"], steps["relevance"])):
    alone = mdjax.generate(model, [sum(chunks[:j + 1], []) + instruction], max_new_tokens=10)
    assert note == alone.texts[0]
    suffix = model.tokenizer.encode(note + margins.CLASSIFY_SUFFIX, add_special_tokens=False)
    assert label == mdjax.generate(model, [prefix + suffix], max_new_tokens=2).texts[0]
  assert all(steps["kept"])  # keep_pattern "(?s)." keeps every non-empty label, "\n" too
  assert out.texts == mdjax.generate(model, steps["answer_prompt"], max_new_tokens=12).texts
  assert out.stats["target_passes"] >= 9 + 1 + 11


@pytest.mark.parametrize("kwargs,match", [
    (dict(), r"needs a non-empty question, got None"),
    (dict(question="q", chunk_tokens=0), r"chunk_tokens must be an integer >= 1, got 0"),
    (dict(question="q", keep_pattern="("), r"keep_pattern '\(' is not a regular expression"),
    (dict(question="q", temperature=1.0), r"unknown option 'temperature' for strategy 'margins'"),
])
def test_bad_options(code_model, kwargs, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.pipelines.run("margins", code_model, "x = 1\n", **kwargs)
