"""A checkpoint's generation_config.json gives a request its defaults as transformers
applies them (`mdjax.generation_config`): mdjax on the folder equals transformers'
`generate` on the same folder with no arguments (it reads the file too); an argument
overrides the file; `out.stats["generation_config"]` lists what came from it; a folder
without the file behaves as before."""

import json

import pytest
import torch
import transformers

import mdjax
from mdjax.generate import _prepare
from tests.helpers import write_tiny_checkpoint

PROMPT = [5, 9, 13, 9, 5, 21, 7, 9, 13]
CONTROLS = dict(repetition_penalty=1.8, no_repeat_ngram_size=2, bad_words_ids=[[40], [9, 13]],
                min_new_tokens=5, max_new_tokens=12, eos_token_id=[191])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("generation_config") / "tiny"
  write_tiny_checkpoint(path)
  return path


def _write(folder, **settings):
  """generation_config.json with `settings` only (transformers' `save_pretrained`; as
  is where it refuses values it would ignore, such as a temperature beside
  do_sample=false, which published files hold and `from_pretrained` reads)."""
  config = transformers.GenerationConfig(**settings)
  try:
    config.save_pretrained(folder)
  except ValueError:
    config.to_json_file(folder / "generation_config.json")


def _theirs(folder, **arguments) -> list[int]:
  """transformers' `generate` on the folder: the file's settings, then `arguments`."""
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
  with torch.no_grad():
    out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT),
                                                                          dtype=torch.long),
                         pad_token_id=0, **arguments)
  return out[0, len(PROMPT):].tolist()


def test_greedy_takes_the_files_controls_as_transformers_does(folder):
  _write(folder, do_sample=False, temperature=0.3, **CONTROLS)  # greedy: no temperature
  out = mdjax.generate(mdjax.load(folder), [PROMPT])
  assert out.sequences[0] == _theirs(folder)
  assert out.stats["generation_config"] == CONTROLS
  # the file's EOS: a token the answer writes after min_new_tokens ends it there
  answer = out.sequences[0]
  end = next(i for i in range(CONTROLS["min_new_tokens"], len(answer))
             if answer[i] not in answer[:i])
  _write(folder, **dict(CONTROLS, eos_token_id=answer[end]))
  model = mdjax.load(folder)
  out = mdjax.generate(model, [PROMPT])
  assert out.sequences[0] == answer[:end + 1] == _theirs(folder)
  streamed = [[], []]
  for pieces in mdjax.stream(model, [PROMPT, PROMPT[:5]]):
    for row, piece in zip(streamed, pieces):
      row.extend(piece)
  assert streamed == mdjax.generate(model, [PROMPT, PROMPT[:5]]).sequences


def test_an_argument_overrides_the_file(folder):
  _write(folder, **CONTROLS)
  out = mdjax.generate(mdjax.load(folder), [PROMPT], max_new_tokens=6, repetition_penalty=1.0,
                       bad_words_ids=None)
  assert out.sequences[0] == _theirs(folder, max_new_tokens=6, repetition_penalty=1.0,
                                     bad_words_ids=None)
  assert out.stats["generation_config"] == dict(no_repeat_ngram_size=2, min_new_tokens=5,
                                                eos_token_id=[191])


def test_sample_takes_the_files_sampling_values(folder):
  # top_k=1: transformers' sampling is then deterministic, so the tokens must agree
  sampling = dict(do_sample=True, temperature=0.7, top_k=1, top_p=0.9, min_p=0.05)
  _write(folder, repetition_penalty=1.8, max_new_tokens=10, **sampling)
  model = mdjax.load(folder)
  out = mdjax.generate(model, [PROMPT], strategy="sample", seed=3)
  assert out.sequences[0] == _theirs(folder)
  del sampling["do_sample"]  # "sample" samples whatever the file's do_sample
  assert out.stats["generation_config"] == dict(sampling, repetition_penalty=1.8,
                                                max_new_tokens=10)
  # without top_k=1 it samples: another seed, other tokens
  free = [mdjax.generate(model, [PROMPT], strategy="sample", top_k=None, seed=s).sequences[0]
          for s in range(4)]
  assert len({tuple(s) for s in free}) > 1


def _from_file(model, strategy, **options):
  """What a request would take from the file (validated, not run)."""
  return _prepare(model, [PROMPT], strategy, None, None, 0, options).from_file


def test_which_strategies_take_the_sampling_values(folder):
  sampling = dict(temperature=0.7, top_p=0.9)
  _write(folder, do_sample=False, repetition_penalty=1.2, **sampling)
  model = mdjax.load(folder)
  assert _from_file(model, "greedy") == dict(repetition_penalty=1.2)  # greedy stays greedy
  assert _from_file(model, "sample") == dict(sampling, repetition_penalty=1.2)
  questions = dict(questions=[[7, 8]])
  assert _from_file(model, "multi_question", **questions) == dict(repetition_penalty=1.2)
  # the caller's sampling value makes it sample: the file's others fill in
  assert _from_file(model, "multi_question", temperature=1.0, **questions) == dict(
      top_p=0.9, repetition_penalty=1.2)
  _write(folder, do_sample=True, **sampling)
  model = mdjax.load(folder)
  assert _from_file(model, "greedy") == {}
  assert _from_file(model, "lookahead") == {}  # no sampling options: skipped
  assert _from_file(model, "multi_question", **questions) == dict(sampling, do_sample=True)
  _write(folder, do_sample=True)
  plan = _prepare(mdjax.load(folder), [PROMPT], "multi_question", None, None, 0, questions)
  assert plan.from_file == dict(do_sample=True) and not plan.decoder.greedy  # temperature 1


def test_a_folder_without_the_file_behaves_as_before(folder):
  (folder / "generation_config.json").unlink(missing_ok=True)
  model = mdjax.load(folder)
  assert model.generation_defaults == {}
  out = mdjax.generate(model, [PROMPT], eos_token_id=[])
  assert "generation_config" not in out.stats
  assert out.sequences == mdjax.generate(model, [PROMPT], max_new_tokens=32,
                                         eos_token_id=[]).sequences
  assert len(out.sequences[0]) == 32


def test_a_bad_file_is_one_checkpoint_error(folder):
  (folder / "generation_config.json").write_text(json.dumps(dict(top_p=3.0)))
  with pytest.raises(mdjax.CheckpointError, match=r"generation_config.json: top_p must be in"):
    mdjax.load(folder)
  (folder / "generation_config.json").write_text("{not json")
  with pytest.raises(mdjax.CheckpointError, match=r"^corrupt .*generation_config.json"):
    mdjax.load(folder)
