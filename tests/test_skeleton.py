"""skeleton_fill: every stub's body == greedy after the source up to its docstring."""

import ast

import numpy as np
import pytest

import mdjax
from mdjax.strategies import skeleton
from tests.helpers import random_model

SKELETON = '''import os


def token_bytes(nbytes=None):
    """Return a random byte string containing *nbytes* bytes."""


class Pool:
    def __init__(self, size):
        """Keep size workers."""

    def size(self):
        return self._size

    async def close(self):
        """Stop every worker."""
'''


def test_stubs_are_found_and_bodies_put_back():
  assert [c[-12:] for c in skeleton.chunks(SKELETON)] == [' *nbytes* bytes."""'[-12:],
                                                          'size workers."""'[-12:],
                                                          'ery worker."""'[-12:]]
  filled = skeleton.assemble(SKELETON, ["\n    return os.urandom(nbytes)\n\n\nclass X:",
                                        "\n        self._size = size\n    def other(self):",
                                        "\n        await self._stop()\n"])
  tree = ast.parse(filled)
  assert "class X" not in filled and "def other" not in filled
  assert [type(n).__name__ for n in tree.body] == ["Import", "FunctionDef", "ClassDef"]
  assert "self._size = size\n\n    def size(self):" in filled


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bodies_equal_sequential_greedy_on_token_chunks(family):
  model = random_model(family, seed=3)
  rng = np.random.default_rng(0)
  skeletons = [[rng.integers(3, 64, n).tolist() for n in (5, 1, 7)],
               [rng.integers(3, 64, n).tolist() for n in (2, 4)]]
  out = mdjax.generate(model, skeletons, strategy="skeleton_fill", max_new_tokens=12,
                       eos_token_id=[])
  expected = [mdjax.generate(model, [sum(chunks[:j + 1], [])], max_new_tokens=12,
                             eos_token_id=[]).sequences[0]
              for chunks in skeletons for j in range(len(chunks))]
  assert out.sequences == expected
  assert out.stats["target_passes"] == 11  # all five bodies advance together


def test_shipped_code_model_fills_a_source_in_parallel():
  model = mdjax.load("code-tiny")
  out = mdjax.generate(model, SKELETON, strategy="skeleton_fill", max_new_tokens=16)
  chunks = skeleton.chunks(SKELETON)
  for j, body in enumerate(out.sequences):
    prefix = model.tokenizer.encode(chunks[0]) + sum(
        (model.tokenizer.encode(c, add_special_tokens=False) for c in chunks[1:j + 1]), [])
    assert body == mdjax.generate(model, [prefix], max_new_tokens=16).sequences[0]
  assert skeleton.assemble(SKELETON, out.texts).startswith("import os\n")


@pytest.mark.parametrize("prompt,match", [
    ("def f(:\n", r"not valid Python"),
    ("x = 1\n", r"no function whose body is only a docstring"),
])
def test_bad_skeletons(prompt, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(mdjax.load("code-tiny"), prompt, strategy="skeleton_fill")
