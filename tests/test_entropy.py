"""entropy_branching == a plain-Python reference built from greedy decoding of each
branch alone (forward_logits + greedy generate), several families and thresholds."""

import numpy as np
import pytest

import mdjax
from mdjax.strategies.entropy import entropy_varentropy
from tests.helpers import random_model


def _log_softmax(logits):
  z = logits.astype(np.float64) - logits.max()
  return z - np.log(np.exp(z).sum())


def reference(model, prompt, max_new, k, m, entropy_threshold, varentropy_threshold):
  """Greedy, but where entropy and varentropy exceed the thresholds: each of the top-k
  tokens continued greedily alone to m tokens, the best summed log-probability kept."""
  out = []
  while len(out) < max_new:
    logits = mdjax.forward_logits(model, prompt + out)[-1]
    entropy, varentropy = map(float, entropy_varentropy(logits))
    if k > 1 and m > 1 and entropy > entropy_threshold and varentropy > varentropy_threshold:
      logp = _log_softmax(logits)
      candidates = []
      for t in np.argsort(-logits, kind="stable")[:k]:
        rest = mdjax.generate(model, [prompt + out + [int(t)]], max_new_tokens=m - 1,
                              eos_token_id=[]).sequences[0]
        branch = [int(t)] + rest
        later = mdjax.forward_logits(model, prompt + out + branch)[len(prompt + out):-1]
        score = logp[t] + sum(_log_softmax(row)[tok] for row, tok in zip(later, rest))
        candidates.append((score, branch))
      out += max(candidates, key=lambda c: c[0])[1]  # the first best on a tie, like argmax
    else:
      out.append(int(np.argmax(logits)))
  return out[:max_new]


@pytest.mark.parametrize("family,k,m", [("llama", 3, 3), ("qwen3", 2, 4), ("llama", 4, 2)])
def test_matches_the_reference(family, k, m):
  model = random_model(family, seed=5)
  prompts = [[5, 6, 7, 8], [9, 10]]
  entropies = [float(entropy_varentropy(mdjax.forward_logits(model, p)[-1])[0]) for p in prompts]
  threshold = float(np.mean(entropies)) - 0.05  # some steps fork, some do not
  out = mdjax.generate(model, prompts, strategy="entropy_branching", num_branches=k,
                       branch_tokens=m, branch_entropy=threshold, max_new_tokens=14,
                       eos_token_id=[])
  assert 0 < out.stats["forks"]
  for prompt, got in zip(prompts, out.sequences):
    assert got == reference(model, prompt, 14, k, m, threshold, 0.0)


def test_never_forking_is_greedy():
  model = random_model("llama", seed=5)
  out = mdjax.generate(model, [[5, 6, 7]], strategy="entropy_branching", branch_entropy=100.0,
                       max_new_tokens=20, eos_token_id=[])
  assert out.stats["forks"] == 0
  assert out.sequences == mdjax.generate(model, [[5, 6, 7]], max_new_tokens=20,
                                         eos_token_id=[]).sequences


def test_always_forking_fills_the_cache_without_leaking_slots():
  """Forks at every chance for 64 tokens: compaction must reclaim every dead slot."""
  model = random_model("qwen3", seed=2)
  prompt = list(range(3, 19))
  out = mdjax.generate(model, [prompt], strategy="entropy_branching", num_branches=3,
                       branch_tokens=3, branch_entropy=0.0, max_new_tokens=64, eos_token_id=[])
  assert out.stats["forks"] >= 20
  assert out.sequences[0] == reference(model, prompt, 64, 3, 3, 0.0, 0.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_branches=0), r"num_branches must be an integer >= 1, got 0"),
    (dict(branch_tokens=0), r"branch_tokens must be an integer >= 1, got 0"),
    (dict(branch_entropy=-1.0), r"branch_entropy must be a finite number >= 0, got -1.0"),
    (dict(branch_varentropy=float("nan")), r"branch_varentropy must be a finite number >= 0"),
])
def test_bad_options(kwargs, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(random_model("llama"), [1, 2], strategy="entropy_branching", **kwargs)
