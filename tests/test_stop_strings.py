"""Stop strings (`mdjax.stop_strings`) end a row where transformers' `StopStringCriteria`
does. The oracle is that criterion, called on a row's prompt and generated ids after each
token; `completed` must give, at every generated token, the lowest index of the stop
strings the token completes (-1: none), so the first stop and its string follow."""

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.generation.stopping_criteria import StopStringCriteria

import mdjax
from mdjax.errors import MdjaxError
from mdjax.stop_strings import StopStrings, completed

# Texts are drawn from these, so that the stop strings below occur, split in many ways
PIECES = ["stop", "stopper", "st", "op", "s", "per", "café", "é", "→", "\n", "\n\n", "\n\n\n",
          " ", "end.", "Ans:", "x", " hello", "日本", "🤖", "-->", "a→b", "sto", "pped",
          "<|im_end|>"]
STRING_SETS = [["\n\n"],
               ["stop", "stopper", "é", "→"],  # "stop" a prefix of "stopper": the lower index
               ["stopper", "stop", "Ans:"],
               ["x", " end.", "\n\n", "→\n", "🤖"]]
# (prompt, generated) texts every tokenizer's rows start with: a string at the very start,
# begun in the prompt, wholly in the prompt, inside one token, a prefix of another
FIXED = [("", "stop here"), ("Ans", ": x"), ("caf", "é!"), ("a\n", "\nb"), ("", "stopper"),
         ("stop", " now"), ("", "x"), ("→", "\n\n"), ("a→", "\nb"),
         ("stop", "per"), ("we", " end.")]
PADDING = 64  # ids past the tokenizer's vocabulary, as a model's padded embedding has
NO_TOKEN = 2**40  # past every vocabulary: the criterion's row of no text (a row's start)
completed_jit = jax.jit(completed)


@functools.cache
def criterion(tokenizer, strings: tuple[str, ...]) -> StopStringCriteria:
  return StopStringCriteria(tokenizer, list(strings))


def oracle(tokenizer, strings: list[str], ids: list[int]) -> np.ndarray:
  """At each ids[p]: where the criterion of all the strings fires on ids[:p+1], the lowest
  index of those whose own criterion fires there, else -1. Each string's own criterion
  gets a string of "\\0"s as long as the longest, which never matches, so that its window
  is the same (one call each: each prefix a row, padded on the left with no tokens)."""
  n = len(ids)
  batch = torch.tensor([[NO_TOKEN] * (n - 1 - p) + ids[:p + 1] for p in range(n)])
  every = criterion(tokenizer, tuple(strings))
  fires = every(batch, None).numpy()
  filler = "\0" * every.maximum_token_len  # in units: a NUL is one byte too
  each = np.stack([criterion(tokenizer, (s, filler))(batch, None).numpy() for s in strings])
  assert (each.any(axis=0) == fires).all()
  return np.where(fires, each.argmax(axis=0), -1)


def byte_ids(tokenizer) -> dict[int, int]:
  """Each byte's own token (byte-fallback "<0xE2>" or byte-level "â"), {} without them."""
  vocab = tokenizer.get_vocab()
  for table in ({b: f"<0x{b:02X}>" for b in range(256)}, bytes_to_unicode()):
    if all(token in vocab for token in table.values()):
      return {b: vocab[token] for b, token in table.items()}
  return {}


def rows(tokenizer, seed: int, count: int = 24) -> list[tuple[list[int], list[int]]]:
  """(prompt, generated) pairs: texts of `PIECES` cut at random places, each part
  tokenized alone or byte by byte, a few random ids (some past the vocabulary) mixed in,
  cut into a prompt and at least one generated token."""
  rng, single = random.Random(seed), byte_ids(tokenizer)
  known = len(tokenizer.get_vocab())
  out = [(tokenizer(p, add_special_tokens=False)["input_ids"] if p else [],
          tokenizer(g, add_special_tokens=False)["input_ids"]) for p, g in FIXED]
  for _ in range(count):
    text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 10)))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 5))))
    ids = []
    for part in (text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])):
      if single and rng.random() < 0.25:
        ids += [single[b] for b in part.encode()]
      else:
        ids += tokenizer(part, add_special_tokens=False)["input_ids"]
    for _ in range(rng.choice([0, 0, 1, 2])):
      stray = rng.choice([rng.randrange(known), rng.randrange(known, known + PADDING)])
      ids.insert(rng.randint(0, len(ids)), stray)
    cut = rng.randint(0, len(ids) - 1)
    out.append((ids[:cut], ids[cut:]))
  return out


def check(tokenizer, strings: list[str], pairs, per_steps=(None,)) -> np.ndarray:
  """`completed` on every generated token, `per_step` new tokens per row a step (None:
  all at once) for each of `per_steps`, equals the oracle's; returns what it found (a
  row per pair)."""
  stops = StopStrings.build(tokenizer, strings, len(tokenizer.get_vocab()) + PADDING)
  lens = np.array([len(g) for _, g in pairs])
  width = lens.max()
  tokens = np.full((len(pairs), width), -1, np.int32)
  for r, (_, generated) in enumerate(pairs):
    tokens[r, :len(generated)] = generated
  tail = stops.prompt_tail([p for p, _ in pairs])
  expected = [oracle(tokenizer, strings, prompt + generated)[len(prompt):].tolist()
              for prompt, generated in pairs]
  for per_step in per_steps:
    per_step = per_step or width
    got = np.full(tokens.shape, -1)
    for first in range(0, width, per_step):
      at = first + np.arange(per_step)
      ends = np.where(at < lens[:, None], at, -1)
      written = np.where(np.arange(width) < first + per_step, tokens, -1)  # none later yet
      found = np.asarray(completed_jit(stops, jnp.asarray(written), jnp.asarray(ends), tail))
      for r, a in zip(*np.nonzero(ends >= 0)):
        got[r, ends[r, a]] = found[r, a]
    for r, (prompt, generated) in enumerate(pairs):
      assert got[r, :len(generated)].tolist() == expected[r], (
          strings, per_step, prompt, generated,
          [tokenizer.decode([t]) for t in prompt + generated])
      assert (got[r, len(generated):] == -1).all()
  return got


def check_sets(tokenizer, sets, seed: int) -> None:
  pairs = rows(tokenizer, seed)
  for strings in sets:
    got = check(tokenizer, strings, pairs, per_steps=(1, 3, None))
    # the cases reach every string (the lowest index of each firing once at least)
    assert set(np.unique(got)) == {-1, *range(len(strings))}, (strings, np.unique(got))


def synthetic(kind: str):
  """A small BPE tokenizer trained on `PIECES`: 'byte_level' (GPT-2's alphabet),
  'byte_fallback' (sentencepiece's "▁" and "<0x..>" byte tokens) or 'chars' (units are
  characters: a Metaspace decoder without byte fallback)."""
  special, alphabet = ["<unk>", "<eos>"], []
  if kind == "byte_level":
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder, alphabet = decoders.ByteLevel(), pre_tokenizers.ByteLevel.alphabet()
  else:
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=kind == "byte_fallback"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    backend.decoder = decoders.Metaspace() if kind == "chars" else decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    special += [f"<0x{b:02X}>" for b in range(256)] * (kind == "byte_fallback")
  trainer = trainers.BpeTrainer(vocab_size=len(special) + 300, special_tokens=special,
                                initial_alphabet=alphabet)
  backend.train_from_iterator([" ".join(PIECES + ["abcdef"])] * 3 + ["".join(PIECES)], trainer)
  return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback", "chars"])
def test_matches_transformers_on_small_tokenizers(kind):
  tokenizer = synthetic(kind)
  assert StopStringCriteria._get_stop_string_matching_mode(tokenizer) == (
      None if kind == "chars" else kind)
  check_sets(tokenizer, STRING_SETS, seed=1)


@pytest.fixture(scope="module")
def smollm2():
  return mdjax.load("smollm2-135m-instruct").tokenizer


@pytest.fixture(scope="module")
def gemma3_270m():
  return mdjax.load("gemma3-270m").tokenizer


@pytest.mark.real_models
def test_matches_transformers_on_smollm2(smollm2):
  """Byte-level BPE: units are bytes ("é" two, "→" three), special tokens their text."""
  check_sets(smollm2, STRING_SETS + [["<|im_end|>", "im_"]], seed=2)


@pytest.mark.real_models
def test_matches_transformers_on_gemma3(gemma3_270m):
  """Sentencepiece "▁" pieces and "<0x..>" byte tokens (the criterion costs seconds to
  build over 262k tokens: one set)."""
  check_sets(gemma3_270m, [["stopper", "stop", "é", "→\n", "\n\n"]], seed=3)


def test_window_is_transformers_where_tokens_have_no_text():
  """A token of empty text ("##" after WordPiece's decoder) passes a match on, but the
  window stays the longest string's length in tokens (5 here, for "xstop", though "stop"
  is 4): "s", "", "t", "o", "p" stops, "s", "", "", "t", "o", "p" does not, for either. An
  id of no text (past the tokenizer's vocabulary) ends a match."""
  words = ["[UNK]", "abcdef", "a", "##s", "##t", "##o", "##p", "##st", "##op", "##", "##stop",
           "##sto", "##x"]
  backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  backend.pre_tokenizer, backend.decoder = (pre_tokenizers.WhitespaceSplit(),
                                            decoders.WordPiece(cleanup=False))
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
  ids = lambda *tokens: [words.index(t) for t in tokens]
  pairs = [([], ids("##s", "##", "##t", "##o", "##p")), ([], ids("##s", "##", "##", "##t", "##o",
                                                                  "##p")),
           (ids("##st", "##"), ids("##", "##op")), (ids("a", "##x"), ids("##sto", "##", "##p")),
           (ids("##st"), [len(words) + 3, *ids("##op")])]  # a padded embedding's id: no text
  rng = random.Random(4)
  pairs += [([rng.randrange(2, len(words)) for _ in range(rng.randint(0, 4))],
             [rng.randrange(2, len(words)) for _ in range(rng.randint(1, 12))])
            for _ in range(40)]
  got = check(tokenizer, ["xstop", "stop"], pairs, per_steps=(2,))
  assert got[0, :5].tolist() == [-1] * 4 + [1] and got[1, :6].tolist() == [-1] * 6
  assert got[2, :2].tolist() == [-1, 1] and got[3, :3].tolist() == [-1, -1, 0]
  assert got[4, :2].tolist() == [-1, -1]  # where "" would pass "st" on to "op"
  assert (got == 1).sum() > 5


def test_a_string_begun_in_the_prompt_stops_at_the_first_token():
  tokenizer = synthetic("chars")
  stops = StopStrings.build(tokenizer, ["stop"], len(tokenizer))
  ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
  for prompt, generated, fires in [("we st", "op", True), ("we stop", " x", False)]:
    assert (oracle(tokenizer, ["stop"], ids(prompt) + ids(generated))[len(ids(prompt))] == 0
            ) == fires
    tokens = jnp.asarray([ids(generated)])
    first = jnp.zeros((1, 1), jnp.int32)
    tail = stops.prompt_tail([ids(prompt)])
    assert int(completed(stops, tokens, first, tail)[0, 0]) == (0 if fires else -1)
    assert int(completed(stops, tokens, first)[0, 0]) == -1  # without the prompt: missed


def test_bad_input_is_one_line_naming_stop_strings():
  tokenizer = synthetic("chars")
  for strings, tok in [(5, tokenizer), ([], tokenizer), (["a", 3], tokenizer),
                       (b"stop", tokenizer), ("", tokenizer), (["a", ""], tokenizer),
                       (["a"], None)]:
    with pytest.raises(MdjaxError) as e:
      StopStrings.build(tok, strings, 400)
    assert "stop_strings" in str(e.value) and "\n" not in str(e.value), str(e.value)
  assert StopStrings.build(tokenizer, "stop", 400).size.tolist() == [4, 0, 0, 0]  # one str


def test_stop_strings_of_the_same_shapes_compile_once():
  tokenizer = synthetic("chars")
  traces = []

  @jax.jit
  def run(stops, tokens, ends):
    traces.append(1)
    return completed(stops, tokens, ends)

  tokens = jnp.asarray([tokenizer("x stop Ans: x", add_special_tokens=False)["input_ids"]])
  ends = jnp.arange(tokens.shape[1])[None]
  found = {}
  for strings in (["stop", "x"], ["Ans:"], ["é", "→", "op", "s:"]):  # S and L: 4 each
    found[strings[0]] = np.asarray(run(StopStrings.build(tokenizer, strings, 400), tokens, ends))
  assert len(traces) == 1
  assert found["stop"].max() >= 0 and found["Ans:"].max() == 0 and found["é"].max() >= 2
  assert (found["stop"] != found["Ans:"]).any()
  run(StopStrings.build(tokenizer, ["a", "b", "c", "d", "e"], 400), tokens, ends)
  assert len(traces) == 2  # five strings: S = 8
