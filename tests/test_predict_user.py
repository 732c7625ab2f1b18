"""predict_user: candidates are parallel samples of the user's turn over the
transcript's KV; each reply == greedy after transcript + that candidate alone."""

import pytest

import mdjax

TRANSCRIPT = "# User: how do I read a file?\n# Assistant: use open(path).read()\n"


@pytest.fixture(scope="module")
def model():
  return mdjax.load("code-tiny")


def test_replies_equal_greedy_after_each_candidate(model):
  kwargs = dict(num_candidates=3, candidate_tokens=10, user_prefix="# User:",
                assistant_prefix="# Assistant:", max_new_tokens=8, seed=4)
  out = mdjax.pipelines.run("predict_user", model, TRANSCRIPT, **kwargs)
  (step,) = out.intermediate
  assert len(step["candidates"]) == 3 and len(set(step["candidates"])) > 1
  (transcript,) = mdjax.encode_prompts(model, [TRANSCRIPT])
  for candidate, reply in zip(step["candidates"], step["replies"]):
    turn = model.tokenizer.encode("# User:" + candidate + "\n# Assistant:", add_special_tokens=False)
    assert reply == mdjax.generate(model, [transcript + turn], max_new_tokens=8).texts[0]
  alone = mdjax.pipelines.run("predict_user", model, TRANSCRIPT, reply=False, **kwargs)
  assert alone.texts == step["candidates"]  # the same samples (same seed) without replies


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_candidates=0), r"num_candidates must be an integer >= 1, got 0"),
    (dict(turn_end=""), r"turn_end must be a non-empty string, got ''"),
    (dict(bogus=1), r"unknown option 'bogus' for strategy 'predict_user'"),
])
def test_bad_options(model, kwargs, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.pipelines.run("predict_user", model, TRANSCRIPT, **kwargs)
