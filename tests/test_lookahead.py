"""lookahead / jacobi: the paper's mask from segments, the n-gram pool, the window's
slide, and exactness vs greedy."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax.strategies import lookahead
from mdjax.strategies.lookahead import NgramPool, feed_layout, slide
from mdjax.topology import visibility_limits, visible
from tests.helpers import random_model


def paper_mask(window: int, ngram_size: int, guess_set: int) -> np.ndarray:
  """The reference implementation's mask, written out: level 0 (c first) is causal;
  level l >= 1, column k sees level 0 up to column k and levels 1..l of column k; a
  candidate sees c and its own earlier tokens."""
  levels, size = ngram_size - 1, (ngram_size - 1) * (window + guess_set)
  mask = np.zeros((size, size), bool)
  at = lambda level, column: level * window + column
  for level in range(levels):
    for k in range(window):
      mask[at(level, k), [at(0, j) for j in range(k + 1)]] = True
      mask[at(level, k), [at(l, k) for l in range(1, level + 1)]] = True
  for g in range(guess_set):
    start = levels * window + g * levels
    for i in range(levels):
      mask[start + i, [0, *range(start, start + i + 1)]] = True
  return mask


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def fed_visibility(window, ngram_size, guess_set, p=5):
  """What the fed tokens see of each other, and of a committed text of p tokens."""
  positions, segments, topology = feed_layout(window, ngram_size, guess_set).place(
      jnp.asarray([p]), jnp.asarray([False]))
  limits = visibility_limits(topology)
  among = visible(limits, segments, positions, segments, positions)[0]
  text = visible(limits, segments, positions, jnp.zeros((1, p), jnp.int32), jnp.arange(p)[None])
  return among, text[0]


def docstring_mask() -> np.ndarray:
  """The "who sees whom" drawing of the module docstring (W = 4, N = 3, G = 2)."""
  drawing = lookahead.__doc__.split("Who sees whom")[1].split("::\n\n")[1].split("\n\n")[0]
  header, *rows = drawing.splitlines()
  columns = [m.start() for m in re.finditer(r"\S+", header)]
  return np.array([[row.ljust(len(header))[c] == "■" for c in columns] for row in rows])


def test_segments_draw_the_docstring_mask():
  among, text = fed_visibility(4, 3, 2)
  drawn = docstring_mask()
  assert drawn.shape == (12, 12) and (among == drawn).all() and text.all()


@pytest.mark.parametrize("window,ngram_size,guess_set",
                         [(3, 4, 2), (5, 2, 3), (1, 5, 1), (6, 2, 0)])
def test_segments_give_the_paper_mask(window, ngram_size, guess_set):
  among, text = fed_visibility(window, ngram_size, guess_set)
  assert (among == paper_mask(window, ngram_size, guess_set)).all() and text.all()


def test_pool_keeps_distinct_ngrams_most_recent_first():
  add, candidates = jax.jit(NgramPool.add), jax.jit(NgramPool.candidates, static_argnums=2)
  pool = NgramPool.empty(1, 12, 3)  # 3 passes of 4 n-grams
  on = jnp.asarray([True])
  pool = add(pool, jnp.asarray([[[1, 2, 3], [1, 4, 5], [1, 2, 3], [2, 3, 4]]]), 0, on)
  found, exists = candidates(pool, jnp.asarray([1]), 3)
  assert exists.tolist() == [[True, True, False]]  # the repeated (1 2 3) is stored once
  assert found[0, :2].tolist() == [[2, 3], [4, 5]]
  pool = add(pool, jnp.asarray([[[1, 2, 3], [9, 9, 9], [1, 6, 7], [1, 4, 5]]]), 1, ~on)
  assert (pool.stamp[0, 4:] == -1).all()  # a done row adds nothing
  pool = add(pool, jnp.asarray([[[1, 2, 3], [9, 9, 9], [1, 6, 7], [9, 9, 9]]]), 2, on)
  found, exists = candidates(pool, jnp.asarray([1]), 3)
  assert exists.tolist() == [[True, True, True]]
  assert sorted(found[0, :2].tolist()) == [[2, 3], [6, 7]] and found[0, 2].tolist() == [4, 5]
  assert pool.stamp[0].tolist() == [-1, 0, -1, 0] + [-1] * 4 + [2, 2, 2, -1]  # 5 distinct, each
  #   where it was last produced: (1 2 3) in pass 2's first column
  _, exists = candidates(pool, jnp.asarray([7]), 2)
  assert not exists.any()


def test_slide_keeps_guesses_at_their_positions():
  # Jacobi (one level): u1 u2 accepted, the next c is z3, then z4 (then z4 repeated)
  c, u1, u2, u3, z3, z4 = 1, 2, 3, 4, 5, 6
  window = jnp.asarray([[[c, u1, u2, u3]]])
  assert slide(window, jnp.asarray([[u1, u2, z3, z4]]), jnp.asarray([2])).tolist() == [
      [[z3, z4, z4, z4]]]
  # two levels, nothing accepted: level 0 takes level 1, level 1 the argmax on top
  window = jnp.asarray([[[0, 1, 2], [3, 4, 5]]])
  assert slide(window, jnp.asarray([[6, 7, 8]]), jnp.asarray([0])).tolist() == [
      [[3, 4, 5], [6, 7, 8]]]


# Every run on the shipped model shares one batch shape (3 rows, prompts of <= 16
# tokens, <= 64 new tokens): one compiled program per strategy for the whole file.
LOOPING, OTHER, MOTIF = [4, 5, 6], [9, 10, 11, 12], [20, 21, 22, 23, 24] * 2 + [7]


@pytest.fixture(scope="module")
def tiny():
  return mdjax.load("random-llama-tiny")


def run(model, prompts, eos=(), **options):
  return mdjax.generate(model, prompts, max_new_tokens=48, eos_token_id=list(eos), **options)


@pytest.mark.parametrize("options", [dict(strategy="lookahead"), dict(strategy="jacobi", window=5)])
def test_equals_greedy_on_a_ragged_batch(tiny, options):
  prompts = [LOOPING, OTHER, MOTIF]
  greedy, out = run(tiny, prompts), run(tiny, prompts, **options)
  assert out.sequences == greedy.sequences
  assert out.stats["target_passes"] <= greedy.stats["target_passes"]  # the slowest row's
  counts = out.stats["accepted_length_counts"]  # row-passes by guesses accepted
  assert out.stats["accepted"] == sum(a * n for a, n in enumerate(counts)) > 0


def test_equals_greedy_on_another_family():
  model = random_model("qwen3", seed=2)  # peaked attention: a wrong mask shows
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 64, n).tolist() for n in (9, 2, 5)]
  out = run(model, prompts, strategy="lookahead", window=3, ngram=3, guess_set=2)
  assert out.sequences == run(model, prompts).sequences


def test_fewer_passes_on_a_looping_model(tiny):
  """Random models fall into loops, which the Jacobi window finds and the pool replays."""
  prompts = [LOOPING] * 3  # target_passes counts the batch's passes: one row's here
  greedy = mdjax.generate(tiny, prompts, max_new_tokens=64, eos_token_id=[])
  assert len(set(greedy.sequences[0][-20:])) < 10, "the test expects the random model to loop"
  lookahead = mdjax.generate(tiny, prompts, strategy="lookahead", max_new_tokens=64,
                             eos_token_id=[])
  jacobi = mdjax.generate(tiny, prompts, strategy="jacobi", window=5, max_new_tokens=64,
                          eos_token_id=[])
  assert lookahead.sequences == jacobi.sequences == greedy.sequences
  assert lookahead.stats["target_passes"] * 2 <= greedy.stats["target_passes"]
  assert lookahead.stats["accepted_from_pool"] > 0
  assert jacobi.stats["target_passes"] < greedy.stats["target_passes"]


def test_eos_inside_an_accepted_block(tiny):
  """EOS = a token of row 1 first seen inside a block lookahead emitted in one pass,
  with tokens after it: the row stops there, mid-block, exactly like greedy."""
  prompts = [LOOPING, OTHER, MOTIF]
  blocks = list(mdjax.stream(tiny, prompts, strategy="lookahead", max_new_tokens=48,
                             eos_token_id=[]))
  seen, eos = [], None
  for block in (chunks[1] for chunks in blocks):
    first = [t for i, t in enumerate(block[:-1]) if t not in seen + block[:i]]
    eos = first[0] if eos is None and first else eos
    seen += block
  assert eos is not None, "the test expects lookahead to accept a block with a new token"
  out, greedy = run(tiny, prompts, eos=[eos], strategy="lookahead"), run(tiny, prompts, eos=[eos])
  assert out.sequences == greedy.sequences and out.sequences[1][-1] == eos


def test_run_that_fills_the_cache_exactly(tiny):
  """Row 0's prompt and budget are whole buckets (16 and 64): a slot leaked per pass
  would overflow its cache and change the output."""
  prompts = [list(range(3, 19)), LOOPING, OTHER]
  greedy = mdjax.generate(tiny, prompts, max_new_tokens=64, eos_token_id=[])
  out = mdjax.generate(tiny, prompts, strategy="lookahead", max_new_tokens=64, eos_token_id=[])
  assert out.sequences == greedy.sequences and len(out.sequences[0]) == 64


@pytest.mark.parametrize("options,match", [
    (dict(window=0), r"window must be an integer >= 1, got 0"),
    (dict(window=2.5), r"window must be an integer >= 1, got 2.5"),
    (dict(ngram=1), r"ngram must be an integer >= 2, got 1"),
    (dict(guess_set=0), r"guess_set must be an integer >= 1, got 0"),
    (dict(guess_set=-1, ngram=2), r"guess_set must be an integer >= 0, got -1"),
    (dict(num_draft_tokens=3), r"unknown option 'num_draft_tokens' for strategy 'lookahead'"),
])
def test_bad_options_name_the_value(tiny, options, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(tiny, [1, 2], strategy="lookahead", **options)


@pytest.mark.parametrize("options,match", [
    (dict(window=0), r"window must be an integer >= 1, got 0"),
    (dict(guess_set=3), r"unknown option 'guess_set' for strategy 'jacobi'"),
])
def test_bad_jacobi_options(tiny, options, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(tiny, [1, 2], strategy="jacobi", **options)
