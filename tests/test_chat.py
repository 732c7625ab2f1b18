"""Chat prompts (`mdjax.chat`): questions over one passage split into a shared context
and per-question tokens that together are exactly each question's own chat."""

import pytest

import mdjax
from mdjax import chat


@pytest.fixture(scope="module")
def smollm2():
  return mdjax.load("smollm2-135m-instruct")


def test_context_plus_question_is_each_questions_own_chat(smollm2):
  passage, questions = "Read this text:\nThe ferry leaves at 8.", ["When?", "Where to?", "Why?"]
  context, own = chat.chat_questions(smollm2, passage, questions, system="Be brief.",
                                     separator="\n\nQ: ")
  for question, ids in zip(questions, own):
    assert context + ids == chat.chat_ids(smollm2, passage + "\n\nQ: " + question, "Be brief.")
    assert ids  # every question keeps at least one token of its own
  assert smollm2.tokenizer.decode(context).endswith("The ferry leaves at 8.\n\nQ:")
  rendered = smollm2.tokenizer.decode(chat.chat_ids(smollm2, "Hi"))
  assert rendered.startswith("<|im_start|>") and rendered.endswith("<|im_start|>assistant\n")


def test_one_question_keeps_a_token_of_its_own(smollm2):
  context, (own,) = chat.chat_questions(smollm2, "A passage.", ["A question?"])
  assert own and context + own == chat.chat_ids(smollm2, "A passage.\n\nA question?")


def test_a_model_without_a_chat_template_is_a_clear_error():
  with pytest.raises(mdjax.MdjaxError, match=r"chat=True needs a chat template.*'code-tiny'"):
    chat.chat_ids(mdjax.load("code-tiny"), "Hi")
