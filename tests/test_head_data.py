"""The heads' data pipeline: hidden states after chosen layers (`aux_layers`) equal a
layer-by-layer reference in both layer loops and through the cached step; the
captured states of a generation equal a teacher-forced `forward_causal` over the same
tokens; a killed data run resumes to the same data; the grown prompts are filtered,
de-duplicated and split by prompt."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax.cache import KVCache
from mdjax.models.layer_loop import take_layers, with_layer_loop
from mdjax.models.transformer import forward_causal, lm_head
from mdjax.sampling import SamplingParams, process_logits, row_keys
from mdjax.step import decode_step
from mdjax.topology import Topology
from mdjax.train.head_data import capture
from mdjax.train.head_data import make as head_data_maker
from mdjax.train.head_data import dataset as head_data
from mdjax.train.head_data import self_instruct
from tests.helpers import GEMMA3_MIXED, chi_square_p_value, random_model

AUX = (0, 2, 3)


def models():
  """A 4-layer llama, and a gemma3 whose period-2 layers scan with a remainder layer."""
  gemma = dict(GEMMA3_MIXED, layer_types=("sliding_attention", "full_attention") * 2)
  return [random_model("llama", 1, layers=4), random_model("gemma3", 2, layers=4, **gemma)]


def residual_after(params, tokens, config, layer: int):
  """The reference: the first `layer + 1` layers alone, with no final norm."""
  first = {k: v for k, v in take_layers(params, layer + 1).items() if k != "final_norm"}
  return forward_causal(first, tokens, config=config)


@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_aux_layers_equal_a_layer_by_layer_reference(loop):
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 11)), jnp.int32)
  for model in models():
    params = with_layer_loop(model.params, loop)
    hidden, aux = forward_causal(params, tokens, config=model.config, aux_layers=AUX)
    assert aux.shape == (2, 11, len(AUX), model.config.hidden_size)
    np.testing.assert_array_equal(hidden, forward_causal(params, tokens, config=model.config))
    for k, layer in enumerate(AUX):
      np.testing.assert_allclose(aux[:, :, k], residual_after(params, tokens, model.config, layer),
                                 rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_decode_step_aux_layers_equal_the_causal_forward(loop):
  model = models()[0]
  params, config = with_layer_loop(model.params, loop), model.config
  tokens = jnp.asarray(np.random.default_rng(1).integers(3, 64, (2, 9)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
  cache = KVCache.create(config, 2, 16)
  prefix = dict(config=config, aux_layers=AUX)
  _, hidden, cache, aux = decode_step(params, cache, tokens[:, :6], positions[:, :6],
                                      jnp.zeros((2, 6), jnp.int32), Topology.causal(2), **prefix)
  _, hidden_2, _, aux_2 = decode_step(params, cache, tokens[:, 6:], positions[:, 6:],
                                      jnp.zeros((2, 3), jnp.int32), Topology.causal(2), **prefix)
  want_hidden, want_aux = forward_causal(params, tokens, config=config, aux_layers=AUX)
  # the cached and the causal attention sum in different orders: float32 rounding apart
  np.testing.assert_allclose(jnp.concatenate([hidden, hidden_2], 1), want_hidden, rtol=1e-4,
                             atol=1e-4)
  np.testing.assert_allclose(jnp.concatenate([aux, aux_2], 1), want_aux, rtol=1e-4, atol=1e-4)
  plain = decode_step(params, KVCache.create(config, 2, 16), tokens, positions,
                      jnp.zeros((2, 9), jnp.int32), Topology.causal(2), config=config)
  assert len(plain) == 3  # no aux asked: the step as before


def test_aux_layer_out_of_range_is_a_clear_error():
  model = models()[0]
  with pytest.raises(mdjax.MdjaxError, match=r"aux_layers \(1, 4\): 4 is not a layer of this "
                     r"4-layer model \(0 to 3\)"):
    forward_causal(model.params, jnp.zeros((1, 3), jnp.int32), config=model.config,
                   aux_layers=(1, 4))


# --- Capture, the data directory and its resume ------------------------------------------

TEXTS = ["hello there, how are you today?", "tell me about the sea and the sky",
         "a short poem about rain", "what is two plus two", "how do birds fly so high",
         "list three fruits", "why is grass green", "name a big city", "write a haiku",
         "what is a prime number", "describe a cat", "how far is the moon"]


@pytest.fixture(scope="module")
def chat_model():
  """A 4-layer random llama with a small byte-level BPE and a chat template."""
  from mdjax.train import tokenizer as tokenizer_lib
  tokenizer = tokenizer_lib.to_transformers(tokenizer_lib.train_bpe(TEXTS * 4, 300))
  tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n"
                             "{% endfor %}<assistant>")
  model = random_model("llama", 3, layers=4, vocab_size=320, eos_token_id=(5,))
  return dataclasses.replace(model, tokenizer=tokenizer, name="random-chat")


def test_captured_states_equal_a_teacher_forced_forward(chat_model):
  config = chat_model.config
  options = capture.CaptureOptions(config=config, aux_layers=AUX, eos=(5,), max_new_tokens=12,
                                   sampling=SamplingParams(temperature=1.0, top_k=50),
                                   steps_per_call=3)
  prompts = [list(range(3, 3 + n)) for n in (5, 9, 3, 14, 7, 4, 11)]
  stats = capture.CaptureStats()
  rows = list(capture.capture(chat_model, enumerate(prompts), options, batch=4, refill_rows=2,
                              max_prompt_tokens=16, seed=0, stats=stats))
  assert sorted(r.item for r in rows) == list(range(len(prompts)))
  assert stats.answer_tokens == sum(r.answer_length for r in rows) > 0
  assert 0 <= stats.padding_waste < 1
  # the teacher-forced forward of every row at once, each padded at its end (causal: the
  # padding changes no earlier position), one program
  width = max(len(row.tokens) for row in rows)
  padded = np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    padded[i, :len(row.tokens)] = row.tokens

  @jax.jit
  def teacher_forced(params, tokens):
    hidden, aux = forward_causal(params, tokens, config=config, aux_layers=AUX)
    return hidden, aux, lm_head(params, hidden, config=config)

  hidden, aux, logits = teacher_forced(chat_model.params, jnp.asarray(padded))
  for i, row in enumerate(rows):
    n = len(row.tokens)
    assert row.tokens[:row.prompt_length].tolist() == prompts[row.item]
    assert 1 <= row.answer_length <= 12
    assert (row.answer_length == 12) or row.tokens[-1] == 5  # EOS only ever last
    assert 5 not in row.tokens[row.prompt_length:-1].tolist()
    np.testing.assert_allclose(row.hidden, hidden[i, :n], rtol=2e-3, atol=2e-3)  # float16 kept
    np.testing.assert_allclose(row.aux, aux[i, :n], rtol=2e-3, atol=2e-3)
    guesses = jnp.argmax(logits[i, :n], -1)  # [n]
    last_prompt = row.prompt_length - 1  # the passes before it compute no logits
    assert (row.greedy[:last_prompt] == -1).all()
    np.testing.assert_array_equal(row.greedy[last_prompt:], guesses[last_prompt:])


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.7, top_k=3),
                                      SamplingParams(temperature=1.3, top_p=0.8),
                                      SamplingParams(temperature=1.0)])
def test_capture_draws_from_the_samplers_law(sampling):
  """pick_tokens' inverse-CDF draw against `process_logits`' law: chi-square, 20k draws."""
  logits = jnp.asarray([[2.0, 1.5, 1.5, 0.3, -1.0, -jnp.inf, 0.9, 0.0]])  # a tie, a -inf
  draws = 20_000
  keys = row_keys(jax.random.key(3), jnp.zeros(draws, jnp.int32), jnp.arange(draws))
  tokens, greedy = jax.jit(lambda k: capture.pick_tokens(
      k, jnp.broadcast_to(logits, (draws, 8)), sampling))(keys)
  assert (greedy == 0).all()
  law = np.asarray(jax.nn.softmax(process_logits(logits, sampling)), np.float64)[0]
  law /= law.sum()
  assert chi_square_p_value(tokens, law) > 1e-3  # and nothing outside the filtered set


def data_config(out, **changes):
  settings = dict(grow_prompts=0, heldout_fraction=0.25, samples_per_prompt=2, max_new_tokens=6,
                  max_prompt_tokens=48, aux_layers=(1, 3), batch=4, refill_rows=2,
                  steps_per_call=2, chunk_tokens=60, max_tokens=10**6, progress=False)
  return head_data_maker.DataConfig(out_dir=str(out), **{**settings, **changes})


def by_item(directory) -> dict:
  data = head_data.HeadData(directory)
  return {row.item: row for row in data.rows()}


def test_a_killed_run_resumes_to_the_same_data(chat_model, tmp_path, monkeypatch):
  whole = head_data_maker.make(data_config(tmp_path / "whole"), chat_model, TEXTS)
  assert whole["rows"] == 2 * len(TEXTS) and whole["chunks"] >= 3
  add, seen = head_data.ChunkWriter.add, []

  def add_then_die(self, row):
    seen.append(row.item)
    if len(seen) == 15:
      raise KeyboardInterrupt  # a kill: the rows buffered and in flight are lost
    add(self, row)

  monkeypatch.setattr(head_data.ChunkWriter, "add", add_then_die)
  with pytest.raises(KeyboardInterrupt):
    head_data_maker.make(data_config(tmp_path / "killed"), chat_model, TEXTS)
  monkeypatch.setattr(head_data.ChunkWriter, "add", add)
  partial = by_item(tmp_path / "killed")
  assert 0 < len(partial) <= 14 < 2 * len(TEXTS)
  resumed = head_data_maker.make(data_config(tmp_path / "killed", batch=3, refill_rows=1),
                              chat_model, TEXTS)  # a new batch size: the same data
  assert resumed["run_answer_tokens"] < whole["run_answer_tokens"]
  want, got = by_item(tmp_path / "whole"), by_item(tmp_path / "killed")
  assert sorted(got) == sorted(want) == list(range(2 * len(TEXTS)))
  for item, row in want.items():
    assert got[item].tokens.tolist() == row.tokens.tolist()
    assert (got[item].prompt, got[item].prompt_length) == (row.prompt, row.prompt_length)
    np.testing.assert_allclose(got[item].hidden, row.hidden, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(got[item].aux, row.aux, rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(got[item].greedy, row.greedy)
  with pytest.raises(mdjax.MdjaxError, match="was made with temperature=0.7, not 0.5"):
    head_data_maker.make(data_config(tmp_path / "whole", temperature=0.5), chat_model, TEXTS)


def test_the_split_is_by_prompt_and_seeded(chat_model, tmp_path):
  head_data_maker.make(data_config(tmp_path / "a", max_tokens=1), chat_model, TEXTS)
  data = head_data.HeadData(tmp_path / "a")
  heldout = {p["id"] for p in data.prompts if p["split"] == "heldout"}
  assert len(heldout) == 3 and [p["text"] for p in data.prompts] == TEXTS
  assert {r.prompt for r in data.rows("heldout")} <= heldout
  assert not {r.prompt for r in data.rows("train")} & heldout
  head_data_maker.make(data_config(tmp_path / "b", max_tokens=1), chat_model, TEXTS)
  assert head_data.HeadData(tmp_path / "b").prompts == data.prompts
  np.testing.assert_array_equal(head_data_maker.work_order(5, 2, 0)[:5],
                                head_data_maker.work_order(5, 2, 0)[5:])  # each prompt, then again


def test_filter_and_dedup():
  keep = self_instruct.keep
  assert keep("How do volcanoes form under the sea?", passage=False) is None
  assert keep("Why?", passage=False) == "length"
  assert keep("Pourquoi le ciel est-il bleu et la mer aussi?", passage=False) == "language"
  assert keep("I'm sorry, but I cannot write that question for you.", passage=False) == "refusal"
  assert keep("go to the shop go to the shop go to the shop", passage=False) == "garbage"
  assert keep("Write only the question about the history of trains.", passage=False) == "garbage"
  assert keep("<|im_start|>user what is the time now", passage=False) == "garbage"
  assert keep("Sure, here is a question about trains and buses", passage=False) == "not a request"
  assert keep("Here is one question a student might ask:", passage=False) == "not a request"
  assert self_instruct.clean('1. Question: "What is a prime number?"\nA prime is...', False) == \
      "What is a prime number?"
  assert self_instruct.clean('The student asks: "Why do magnets attract iron?', False) == \
      "Why do magnets attract iron?"
  deduper = self_instruct.Deduper(threshold=0.7)
  added = [deduper.add(t) for t in [
      "How do I bake bread at home?", "how do I bake   BREAD at home", "How do I bake bread "
      "at home quickly?", "What is the capital of France?", "What is the capital of Spain?"]]
  assert added == [True, False, False, True, True]


def test_asks_cover_every_task_kind():
  kinds = {ask.kind for ask in self_instruct.asks(0)}
  assert {"chat", "qa", "summary", "passage_qa", "translation", "math", "code", "extraction",
          "roleplay", "writing", "reasoning", "stem", "humanities"} <= kinds
  assert self_instruct.asks(0) == self_instruct.asks(0) != self_instruct.asks(1)
