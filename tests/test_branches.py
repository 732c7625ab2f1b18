"""MultiDecode branches over one shared cache: each answer == its sequential counterpart."""

import re

import numpy as np
import pytest

import mdjax
from tests.helpers import chi_square_p_value, expected_first_token_law, random_model


@pytest.fixture(scope="module")
def models():
  return [mdjax.load("random-llama-tiny", dtype="float32"), random_model("qwen3", seed=4)]


def sequential(model, context, questions, **kwargs):
  return [mdjax.generate(model, context + q, **kwargs).sequences[0] for q in questions]


@pytest.mark.parametrize("attention", ["block_sparse", "dense", "fused"])
def test_multi_question_answers_equal_greedy_on_context_plus_question(models, attention):
  rng = np.random.default_rng(0)
  for model in models:
    vocab = model.config.vocab_size
    contexts = [rng.integers(3, vocab, n).tolist() for n in (11, 4, 7)]
    questions = [[rng.integers(3, vocab, n).tolist() for n in lengths]
                 for lengths in ((3, 1, 5), (2,), (4, 4))]  # ragged counts and lengths
    out = mdjax.generate(model, contexts, strategy="multi_question", questions=questions,
                         max_new_tokens=14, eos_token_id=[], attention=attention)
    expected = [a for c, qs in zip(contexts, questions)
                for a in sequential(model, c, qs, max_new_tokens=14, eos_token_id=[])]
    assert out.sequences == expected
    assert out.stats["target_passes"] == 13  # all branches advance together


def test_a_prefill_of_several_query_tiles_equals_each_branch_alone(models):
  """Prompts longer than `attention.QUERY_BLOCK` are attended tile by tile, each tile
  skipping the key blocks it cannot see: ragged rows of a 150-token context with 12
  questions (prefill ~300 tokens: three tiles, questions in several key blocks) give
  each answer of greedy on context + question alone."""
  from mdjax.models import attention
  model = models[0]
  rng = np.random.default_rng(1)
  vocab = model.config.vocab_size
  contexts = [rng.integers(3, vocab, n).tolist() for n in (150, 90)]
  questions = [[rng.integers(3, vocab, 8 + i % 5).tolist() for i in range(n)] for n in (12, 5)]
  assert sum(len(q) for q in questions[0]) + 150 > 2 * attention.QUERY_BLOCK
  out = mdjax.generate(model, contexts, strategy="multi_question", questions=questions,
                       max_new_tokens=6, eos_token_id=[])
  expected = [a for c, qs in zip(contexts, questions)
              for a in sequential(model, c, qs, max_new_tokens=6, eos_token_id=[])]
  assert out.sequences == expected


def test_multi_question_branches_stop_at_their_own_eos(models):
  model = models[0]
  context, questions = [5, 6, 7, 8], [[20, 21], [22], [23, 24, 25]]
  free = sequential(model, context, questions, max_new_tokens=16, eos_token_id=[])
  eos = free[1][4]
  out = mdjax.generate(model, context, strategy="multi_question", questions=questions,
                       max_new_tokens=16, eos_token_id=eos)
  assert out.sequences == sequential(model, context, questions, max_new_tokens=16,
                                     eos_token_id=eos)
  assert len(out.sequences[1]) == 5


def test_finished_branches_stop_being_fed_to_the_model(models):
  """Eight questions, most ending at an early EOS: later passes run on fewer columns
  (`feed_widths`), and every answer is still its sequential greedy answer."""
  model = models[0]
  rng = np.random.default_rng(3)
  contexts = [rng.integers(3, 200, 6).tolist() for _ in range(2)]
  questions = [[rng.integers(3, 200, 2).tolist() for _ in range(8)] for _ in contexts]
  free = [sequential(model, c, qs, max_new_tokens=12, eos_token_id=[])
          for c, qs in zip(contexts, questions)]
  eos = [free[0][0][1], free[0][1][2], free[1][0][1]]  # early EOS in a few answers
  eos = list({t for t in eos} | {a[1] for answers in free for a in answers[2:6]})
  out = mdjax.generate(model, contexts, strategy="multi_question", questions=questions,
                       max_new_tokens=12, eos_token_id=eos)
  assert out.sequences == [a for c, qs in zip(contexts, questions)
                           for a in sequential(model, c, qs, max_new_tokens=12, eos_token_id=eos)]
  passes = out.stats["target_passes"]
  assert out.stats["columns_fed"] < passes * 2 * 8, out.stats
  full = mdjax.generate(model, contexts, strategy="multi_question", questions=questions,
                        max_new_tokens=12, eos_token_id=[])
  assert full.stats["columns_fed"] == full.stats["target_passes"] * 2 * 8


def test_shared_cache_holds_the_context_once(models):
  """KV bytes of N questions over one context: the context once, plus one region per
  branch (question + new tokens, rounded to 16), against N copies when batching."""
  model, n, context_len, new = models[0], 8, 100, 16
  context = list(range(3, 3 + context_len))
  questions = [[40 + j, 41 + j] for j in range(n)]
  shared = mdjax.generate(model, context, strategy="multi_question", questions=questions,
                          max_new_tokens=new, eos_token_id=[])
  batched = mdjax.generate(model, [context + q for q in questions], max_new_tokens=new,
                           eos_token_id=[])
  assert shared.sequences == batched.sequences
  c = model.config
  per_slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # float32 K and V
  assert shared.stats["kv_cache_bytes"] == per_slot * (128 + n * (16 + new))
  assert batched.stats["kv_cache_bytes"] == per_slot * n * 256  # bucket(102) + 16, 2 blocks


def test_one_question_list_serves_every_prompt(models):
  model = models[0]
  contexts, questions = [[4, 5, 6], [9, 9]], [[30], [31, 32]]
  out = mdjax.generate(model, contexts, strategy="multi_question", questions=questions,
                       max_new_tokens=6, eos_token_id=[])
  assert out.sequences == [a for c in contexts
                           for a in sequential(model, c, questions, max_new_tokens=6,
                                               eos_token_id=[])]


def test_parallel_samples_are_seeded_and_differ(models):
  model = models[0]
  kwargs = dict(strategy="parallel_sample", num_samples=4, max_new_tokens=10, eos_token_id=[],
                temperature=1.0)
  a = mdjax.generate(model, [[4, 5, 6], [7, 8]], seed=3, **kwargs).sequences
  assert len(a) == 8
  assert a == mdjax.generate(model, [[4, 5, 6], [7, 8]], seed=3, **kwargs).sequences
  assert len({tuple(s) for s in a[:4]}) == 4


def test_parallel_sample_first_tokens_follow_the_sampling_law(models):
  """Chi-square (p > 1e-3) of 2000 samples' first tokens over one shared prompt."""
  model = mdjax.load("random-llama-tiny", seed=2)
  prompt, options = [4, 5, 6, 7], dict(temperature=1.5, top_k=20)
  law = expected_first_token_law(mdjax.forward_logits(model, prompt)[-1], **options)
  out = mdjax.generate(model, prompt, strategy="parallel_sample", num_samples=2000,
                       max_new_tokens=1, eos_token_id=[], seed=5, **options)
  assert chi_square_p_value([s[0] for s in out.sequences], law) > 1e-3


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="parallel_sample", num_samples=0), r"num_samples must be an integer >= 1, got 0"),
    (dict(strategy="parallel_sample"), r"needs the option 'num_samples'"),
    (dict(strategy="multi_question"), r"needs the option 'questions'"),
    (dict(strategy="multi_question", questions=[]), r"at least one question"),
    (dict(strategy="multi_question", questions=[[5], []]), r"question 1 of prompt 0: .*empty"),
    (dict(strategy="multi_question", questions=[[5], [300]]), r"question 1 .* token id 300"),
    (dict(strategy="multi_question", questions=[[5] * 600]), r"max_position_embeddings=512"),
])
def test_bad_branch_options(models, kwargs, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(models[0], [1, 2, 3], **kwargs)


def test_the_decode_loop_writes_the_cache_in_place(models):
  """XLA:CPU copies the KV cache inside `lax.switch`/`lax.cond` branches; the pass
  that picks its width (N = 8: widths 8, 4, 2) must not run inside one
  (`strategies.widths.switch_in_place`). Counts, in the compiled program, the copies
  of a whole K or V cache outside its entry computation (the loop's body)."""
  model = models[0]
  mdjax.clear_compiled()
  out = mdjax.generate(model, [[5, 6, 7, 8]], "multi_question", max_new_tokens=8, eos_token_id=[],
                       questions=[[[9 + j, 10 + j] for j in range(8)]])
  assert len(out.sequences) == 8
  (program,) = mdjax.compiled_programs()
  c = model.config
  cache = re.compile(rf"= f32\[{c.num_layers},1,\d+,{c.num_kv_heads},{c.head_dim}\]\S* copy\(")
  computation, copies = None, []
  for line in program.as_text().splitlines():
    if line and not line.startswith(" "):
      computation = line.split(" ")[0]
    elif cache.search(line) and computation != "ENTRY":
      copies.append(line.strip())
  assert not copies, copies
