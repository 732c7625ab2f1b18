"""`out.texts`: each sequence decoded without the EOS that ended it (a chat model's end
token is not part of its answer), while `out.sequences` keep it (the API contract)."""

import mdjax


def test_texts_leave_out_the_eos_that_ended_a_row_and_only_that():
  model = mdjax.load("code-tiny")
  free = mdjax.generate(model, ["def f(x):"], max_new_tokens=6, eos_token_id=[])
  ids = free.sequences[0]
  eos = ids[2]  # the third token generated: make it the EOS
  stopped = mdjax.generate(model, ["def f(x):"], max_new_tokens=6, eos_token_id=[eos])
  assert stopped.sequences[0] == ids[:ids.index(eos) + 1]  # EOS kept in the ids
  assert stopped.texts[0] == model.tokenizer.decode(ids[:ids.index(eos)])  # not in the text
  assert free.texts[0] == model.tokenizer.decode(ids)  # a row cut by the budget: all of it
