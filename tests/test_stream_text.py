"""`mdjax.stream(..., text=True)`: each row's new text per pass, a character split over
tokens shown once complete, the pieces of a row joined exactly its `generate` text
(the EOS left out, a stop string's token kept), for one token a pass and for several.

SmolLM2 answers the prompt below in katakana, each character three bytes spelled in
two tokens: a decode after the first of them ends in U+FFFD. It is loaded with the
scanned layer loop, which compiles one layer instead of 30 (the loops give the same
tokens: tests/test_layer_loop.py)."""

import pytest

import mdjax
from mdjax import stream_text

PROMPT = 'Translate "Japan" to Japanese.'  # greedy: 'マストライル (Makimakura) in Japanese.'
NEW_TOKENS = 32
STRATEGIES = {"greedy": {}, "self_speculative": dict(draft_layers=4, num_draft_tokens=2)}


@pytest.fixture(scope="module")
def smollm2():
  return mdjax.load("smollm2-135m-instruct", layer_loop="scan")


@pytest.fixture(scope="module")
def prompts(smollm2):
  ids = mdjax.chat.chat_ids(smollm2, PROMPT)
  return [ids, ids[:-3]]  # the second without "assistant\n": it writes that first


# greedy ends on the EOS; self_speculative, several tokens a pass, on a stop string
@pytest.mark.parametrize("strategy, stop_strings", [("greedy", None),
                                                    ("self_speculative", ["ト"])])
def test_pieces_join_to_generates_texts(smollm2, prompts, strategy, stop_strings):
  options = dict(STRATEGIES[strategy], max_new_tokens=NEW_TOKENS)
  if stop_strings is not None:
    options["stop_strings"] = stop_strings
  out = mdjax.generate(smollm2, prompts, strategy=strategy, **options)
  passes = list(mdjax.stream(smollm2, prompts, strategy=strategy, text=True, **options))
  tokenizer = smollm2.tokenizer
  for row, sequence in enumerate(out.sequences):
    pieces = [pieces[row] for pieces in passes]
    assert "".join(pieces) == out.texts[row]
    assert not any(stream_text.REPLACEMENT in piece for piece in pieces)
    # the answer does split characters: some decode of its tokens so far ends inside one
    assert any(tokenizer.decode(sequence[:n]).endswith(stream_text.REPLACEMENT)
               for n in range(1, len(sequence)))
    if stop_strings is None:
      assert sequence[-1] in smollm2.config.eos_token_id  # ended by the EOS, not shown
    else:
      assert out.stats["stopped_by"][row] == "ト" and out.texts[row].endswith("ト")
  if strategy == "self_speculative":
    assert out.stats["generated_tokens"] > out.stats["target_passes"] + 1  # several a pass


def test_text_needs_a_tokenizer():
  model = mdjax.load("random-llama-tiny")
  with pytest.raises(mdjax.MdjaxError, match=r"^text=True needs a tokenizer"):
    next(mdjax.stream(model, [[1, 2, 3]], max_new_tokens=2, text=True))
  with pytest.raises(mdjax.MdjaxError, match=r"^text must be True or False"):
    next(mdjax.stream(model, [[1, 2, 3]], max_new_tokens=2, text="yes"))


class _CleaningUp:
  """A tokenizer whose decode cleans up tokenization spaces (" ." -> "."), as a
  WordPiece one does: the end of a text changes when the next token comes."""

  clean_up_tokenization_spaces = True

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  def decode(self, ids):
    return self.tokenizer.clean_up_tokenization(self.tokenizer.decode(ids))


@pytest.mark.parametrize("cleaning_up", [False, True])
def test_a_row_shows_only_text_that_stays(smollm2, cleaning_up):
  tokenizer = _CleaningUp(smollm2.tokenizer) if cleaning_up else smollm2.tokenizer
  text = "It ' s 日本 , isn 't it ? Ja  ' s ok ✨ ."
  ids = smollm2.tokenizer.encode(text, add_special_tokens=False) + [2]  # then an EOS
  rows = stream_text.RowTexts(tokenizer, eos=[2], rows=1)
  pieces = [rows.update([ids[:n]], [n == len(ids)])[0] for n in range(1, len(ids) + 1)]
  assert "".join(pieces) == tokenizer.decode(ids[:-1])
  assert not any(stream_text.REPLACEMENT in piece for piece in pieces)
  assert rows.update([ids], [True]) == [""]  # nothing new: nothing shown


def _main_job_config():
  """configs/multi_question.py (the main job) on the shipped code model, at a few tokens."""
  from configs import multi_question
  config = multi_question.get_config()
  config.update(model="code-tiny", chat=False, compare_sequential=False, max_new_tokens=8,
                questions=("def f(x):", "class A:", "import os"))
  return config


def test_the_main_job_prints_the_same_text_streamed(capsys, monkeypatch):
  from experiments import decode
  streamed, stream = [], mdjax.stream
  monkeypatch.setattr(mdjax, "stream", lambda *a, **k: streamed.append(k) or stream(*a, **k))
  summaries = {}
  for streams in (False, True):
    summaries[streams] = decode.decode(_main_job_config(), stream=streams)
    summaries[streams]["printed"] = capsys.readouterr().out
    summaries[streams]["stats"] = None  # timings differ
  assert [k["text"] for k in streamed] == [True]  # only the streamed run streams
  assert summaries[True] == summaries[False]
  assert summaries[True]["printed"].count("--- Q") == 3
