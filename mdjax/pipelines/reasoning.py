"""`reasoning`: K sampled reasoning branches, self-consistency voting, and a join.

1. branches (`parallel_sample`): `num_branches` samples of up to `branch_tokens`
   tokens from one prompt, sharing its KV.
2. vote: each branch's answer is the first group of `answer_pattern` found in its
   text; the most frequent answer wins (self-consistency; ties: the first seen).
3. join: a greedy continuation that reads every branch at once.
   - `exact`: the joined text (prompt, then `branch_header` + branch for each
     branch, then `join_prompt`) laid out as one sequence and prefilled once.
   - `kv` (experimental): the branches keep their own layout — each a segment
     forked from the prompt at the same positions it was sampled at — and the join
     segment reads all of them (`Topology.joins`), placed `position_gap` positions
     after the longest branch. No branch is re-laid, so their KV could be reused as
     sampled, but the relative positions differ from the exact join. How far its
     logits are from the exact join's is measured on the exact join's own tokens:
     the largest absolute log-probability difference, the mean KL(exact || kv), and
     how often the two argmaxes agree.

The join needs branch texts, so the model needs a tokenizer. `out.sequences` /
`out.texts` hold the exact join's answer (the kv join's with `join="kv"`);
`out.intermediate[i]` holds the branches, their answers, the vote and, for
`join="kv"`, the distance to the exact join.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import distributed
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError, check_count
from mdjax.forward import forward_logits
from mdjax.generate import GenerationOutput, generate
from mdjax.models.model import Model
from mdjax.pipelines.base import Sampled, add_stats, regex
from mdjax.prompts import encode_prompts
from mdjax.step import decode_step
from mdjax.topology import Topology

BRANCH_HEADER = "\n# Attempt {index}:\n"
JOIN_PROMPT = "\n# Combining the attempts above:\n"


def vote(texts: list[str], pattern: re.Pattern) -> tuple[list[str | None], str | None]:
  """Each text's answer (the pattern's first group, or None) and the majority answer."""
  answers = []
  for text in texts:
    match = pattern.search(text)
    answers.append(match.group(1) if match and match.groups() else
                   match.group(0) if match else None)
  counts = collections.Counter(a for a in answers if a is not None)
  return answers, (max(counts, key=counts.get) if counts else None)


def joined_ids(tokenizer, prompt: list[int], branches: list[list[int]], branch_header: str,
               join_prompt: str) -> tuple[list[int], list[list[int]], list[int]]:
  """The exact join's sequence, each branch's tokens with its header, and the join prompt."""
  encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
  pieces = [encode(branch_header.format(index=i + 1)) + b for i, b in enumerate(branches)]
  tail = encode(join_prompt)
  return prompt + sum(pieces, []) + tail, pieces, tail


def kv_join_logits(model, prompt: list[int], pieces: list[list[int]], tail: list[int],
                   position_gap: int) -> tuple[np.ndarray, int]:
  """Logits `[len(tail), V]` at the join's tokens (`tail`, then its continuation is
  decoded by the caller) with the branches laid out as sampled: segment 0 = prompt,
  segment k = branch k forked at the prompt's end, segment K + 1 = the join, seeing
  all of them, starting `position_gap` after the longest branch. Also the join's
  first position."""
  p, k = len(prompt), len(pieces)
  start = p + max(len(x) for x in pieces) + position_gap
  tokens = prompt + sum(pieces, []) + tail
  positions = list(range(p)) + sum((list(range(p, p + len(x))) for x in pieces), []) + list(
      range(start, start + len(tail)))
  segments = [0] * p + sum(([i + 1] * len(x) for i, x in enumerate(pieces)), []) + [k + 1] * len(
      tail)
  join = k + 1
  parent = np.array([[-1] + [0] * (k + 1)], np.int32)
  fork = np.array([[0] + [p] * (k + 1)], np.int32)
  joins = np.zeros((1, k + 2, k + 2), bool)
  joins[0, join, 1:join] = True
  topology = Topology(parent=jnp.asarray(parent), fork=jnp.asarray(fork),
                      joins=jnp.asarray(joins))
  cache = KVCache.for_params(model.config, model.params, 1, len(tokens),
                             model.params["embed"].dtype)
  at = jnp.arange(len(tokens) - len(tail), len(tokens))[None]
  logits, _, _ = decode_step(model.params, cache, jnp.asarray([tokens]),
                             jnp.asarray([positions]), jnp.asarray([segments]), topology,
                             config=model.config, logits_at=at)
  return distributed.to_host(logits)[0], start


def distance(exact: np.ndarray, kv: np.ndarray) -> dict:
  """How far the kv join's log-probabilities are from the exact join's (same tokens)."""
  lp = jax.nn.log_softmax(jnp.asarray(exact, jnp.float32), -1)
  lq = jax.nn.log_softmax(jnp.asarray(kv, jnp.float32), -1)
  kl = (jnp.exp(lp) * (lp - lq)).sum(-1)
  return dict(max_abs_logprob_diff=float(jnp.abs(lp - lq).max()), mean_kl=float(kl.mean()),
              argmax_agreement=float((exact.argmax(-1) == kv.argmax(-1)).mean()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reasoning(Sampled):
  """The three phases for every prompt: see the module docstring. The sampling options
  are the branches' (temperature 1 unless set); the join is greedy."""

  name: ClassVar[str] = "reasoning"
  num_branches: int = 4
  branch_tokens: int = 64
  answer_pattern: str = r"return (\S+)"
  join: str = "exact"
  branch_header: str = BRANCH_HEADER
  join_prompt: str = JOIN_PROMPT
  position_gap: int = 0

  def __post_init__(self):
    check_count("num_branches", self.num_branches, 1)
    check_count("branch_tokens", self.branch_tokens, 1)
    if self.join not in ("exact", "kv"):
      raise MdjaxError(f"join must be 'exact' or 'kv', got {self.join!r}")
    check_count("position_gap", self.position_gap, 0)
    regex("answer_pattern", self.answer_pattern)

  def run(self, model: Model, prompts, *, max_new_tokens: int, eos_token_id,
          seed: int) -> GenerationOutput:
    if model.tokenizer is None:
      raise MdjaxError("strategy 'reasoning' joins branch texts: the model needs a tokenizer")
    k = self.num_branches
    ids = encode_prompts(model, prompts)
    branches = generate(model, ids, strategy="parallel_sample", num_samples=k,
                        max_new_tokens=self.branch_tokens, eos_token_id=eos_token_id,
                        seed=seed, **({"temperature": 1.0} | self.sampling))
    pattern = regex("answer_pattern", self.answer_pattern)
    steps, joined = [], []
    for i, prompt in enumerate(ids):
      texts = branches.texts[i * k:(i + 1) * k]
      answers, majority = vote(texts, pattern)
      sequence, pieces, tail = joined_ids(model.tokenizer, prompt,
                                          branches.sequences[i * k:(i + 1) * k],
                                          self.branch_header, self.join_prompt)
      steps.append(dict(branches=texts, answers=answers, vote=majority, joined_tokens=sequence))
      joined.append((sequence, pieces, tail))
    out = generate(model, [j[0] for j in joined], max_new_tokens=max_new_tokens,
                   eos_token_id=eos_token_id, seed=seed)
    if self.join == "kv":
      out = _kv_join(model, ids, joined, out, self.position_gap, steps)
    add_stats(out, branches)
    out.intermediate = steps
    return out


def _kv_join(model, ids, joined, exact, position_gap: int, steps: list[dict]):
  """The kv join's greedy answers (replacing the exact ones) and its distance to them."""
  sequences = []
  for prompt, (sequence, pieces, tail), answer, step in zip(ids, joined, exact.sequences, steps):
    forced = tail + answer[:-1]  # the join prompt and the exact answer, teacher-forced
    kv, _ = kv_join_logits(model, prompt, pieces, forced, position_gap)
    reference = forward_logits(model, sequence + answer[:-1])[len(sequence) - len(tail):]
    step["kv_join_distance"] = distance(reference, kv)
    greedy = []
    for _ in range(len(answer)):
      logits, _ = kv_join_logits(model, prompt, pieces, tail + greedy, position_gap)
      greedy.append(int(logits[-1].argmax()))
    step["kv_join_answer"] = model.tokenizer.decode(greedy)
    sequences.append(greedy)
  exact.sequences = sequences
  exact.texts = [model.tokenizer.decode(s) for s in sequences]
  return exact
