"""What an accelerator can get wrong that a CPU does not: the checks
`experiments/device_check/` runs on a GPU (`pytest -m accelerator`), and the normal
suite runs on the CPU.

A GPU changes the numerics under the same program: float32 matmuls may run as TF32
(10 mantissa bits), reductions take other orders, a batch of another shape picks
another kernel. So, on whatever backend runs the suite, on a tiny random Hugging Face
checkpoint:

* float32: `forward_logits` (every attention) equals transformers' PyTorch logits
  (computed on the CPU) to 1e-4, and greedy equals transformers' greedy;
* float32 and bfloat16: every lossless strategy at temperature 0 gives greedy's
  tokens, and `multi_question` answer j equals greedy on context + question j.

Token comparisons allow a divergence only at a genuine near-tie of the reference: its
top-2 logits (mdjax's own forward of the reference's tokens) within `NEAR_TIE` (1e-5) in
float32, and within `BF16_NEAR_TIE` in bfloat16, where a hidden state keeps 8 mantissa
bits and two batch shapes (a draft tree of 4 tokens vs greedy's 1; N branches vs one row)
round their sums differently; nothing after the divergence is compared.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import mdjax
from mdjax.heads.base import cast_floats
from mdjax.models.config import weight_dtype
from tests.helpers import (LOSSLESS, NEAR_TIE, STRATEGY_PROMPTS, assert_same_greedy,
                           every_strategy, hf_greedy, mdjax_logits, random_model, run_strategy,
                           strategy_heads, torch_logits, write_tiny_checkpoint)

pytestmark = pytest.mark.accelerator

# The logits' scale here is ~3 (random weights, std 1/sqrt(fan_in)): a bfloat16 hidden
# state rounded at 2**-8 relative moves a logit by up to ~0.03 through the head; twice
# that covers two paths rounding in opposite directions.
BF16_NEAR_TIE = 0.0625
TIE = {"float32": NEAR_TIE, "bfloat16": BF16_NEAR_TIE}
DTYPES = tuple(TIE)
IDS = np.random.default_rng(0).integers(3, 192, 24)  # the tiny checkpoint's vocabulary: 192
CONTEXT = list(range(30, 50))
QUESTIONS = [[60, 61, 62], [63], [64, 65]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(directory, torch model) of a tiny random llama (float32)."""
  path = tmp_path_factory.mktemp("accelerator")
  return path, write_tiny_checkpoint(path, "llama", seed=7)


@pytest.fixture(scope="module")
def models(checkpoint):
  """dtype -> the checkpoint loaded by mdjax in that dtype."""
  return {dtype: mdjax.load(str(checkpoint[0]), dtype=dtype) for dtype in DTYPES}


@pytest.fixture(scope="module")
def strategy_options(models):
  """dtype -> every strategy's options, its draft and heads in that dtype."""
  base = models["float32"]
  draft = random_model("llama", 5, vocab_size=base.config.vocab_size, layers=1, std=0.05)
  heads = strategy_heads(base)
  out = {}
  for dtype in DTYPES:
    cast = weight_dtype(dtype)
    out[dtype] = every_strategy(
        dataclasses.replace(draft, params=cast_floats(draft.params, cast)),
        {name: dataclasses.replace(h, params=cast_floats(h.params, cast))
         for name, h in heads.items()})
  return out


def assert_same_tokens(ours: list[int], reference: list[int], model: mdjax.Model, prompt,
                       dtype: str, label=""):
  """Token-equal to `reference` (mdjax's greedy on `prompt`), except for a divergence at
  a near-tie of the reference's top-2 logits (`TIE[dtype]`), after which nothing is
  compared."""
  for i, (a, b) in enumerate(zip(ours, reference)):
    if a != b:
      top2 = np.sort(mdjax.forward_logits(model, list(prompt) + reference[:i])[-1])[-2:]
      gap = float(top2[1] - top2[0])
      assert gap < TIE[dtype], f"{label}: diverged at token {i}: {a} != {b} (top-2 gap {gap:.3g})"
      return
  assert len(ours) == len(reference), label


@pytest.mark.parametrize("attention", ["block_sparse", "dense", "fused"])
def test_float32_logits_match_transformers(models, checkpoint, attention):
  """TF32 matmuls (an accelerator's default for float32) miss this by ~1e-3."""
  got = mdjax_logits(models["float32"], IDS, attention)  # [T, V]
  np.testing.assert_allclose(got, torch_logits(checkpoint[1], IDS), atol=1e-4, rtol=0)


def test_float32_forward_logits_match_transformers(models, checkpoint):
  got = mdjax.forward_logits(models["float32"], IDS.tolist())  # [T, V]
  np.testing.assert_allclose(got, torch_logits(checkpoint[1], IDS), atol=1e-4, rtol=0)


def test_float32_greedy_matches_transformers(models, checkpoint):
  prompts = [IDS[:5].tolist(), IDS.tolist()]
  out = mdjax.generate(models["float32"], prompts, max_new_tokens=NEW_TOKENS, eos_token_id=[])
  for prompt, ours in zip(prompts, out.sequences):
    theirs = hf_greedy(checkpoint[1], prompt, NEW_TOKENS, eos_token_id=None)
    assert_same_greedy(ours, theirs, checkpoint[1], prompt)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", sorted(LOSSLESS))
def test_lossless_strategy_equals_greedy(models, strategy_options, dtype, strategy):
  model, options = models[dtype], strategy_options[dtype]
  greedy = run_strategy(model, "greedy", options["greedy"], NEW_TOKENS)
  ours = run_strategy(model, strategy, options[strategy], NEW_TOKENS)
  prompts = options[strategy][0] or STRATEGY_PROMPTS
  for row, prompt in enumerate(prompts):
    assert_same_tokens(ours.sequences[row], greedy.sequences[row], model, prompt, dtype,
                       f"{strategy} row {row}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_question_equals_sequential(models, dtype):
  model = models[dtype]
  out = mdjax.generate(model, CONTEXT, strategy="multi_question", questions=QUESTIONS,
                       max_new_tokens=NEW_TOKENS, eos_token_id=[])
  for j, question in enumerate(QUESTIONS):
    alone = mdjax.generate(model, CONTEXT + question, max_new_tokens=NEW_TOKENS,
                           eos_token_id=[]).sequences[0]
    assert_same_tokens(out.sequences[j], alone, model, CONTEXT + question, dtype, f"question {j}")
