"""The quality measures of experiments.bench.quantized and experiments.bench.int4_groups,
free of flags so that tests import them: int4's group for a model's shapes, the int4
forms the sweep compares, weight bytes as held and as packed, a passage's perplexity in
sliding windows, greedy agreement with a reference."""

from __future__ import annotations

import pathlib
import re
import statistics
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

import mdjax
from mdjax.models.quantized import (GROUP_REFITS, GROUP_SCALE_DTYPE, INT4_KEEPS_INT8,
                                    is_quantized, map_matrices, map_weight_dicts, quantize)
from mdjax.models.transformer import forward_causal, lm_head

HEAD_ROWS = 8  # positions per piece of the perplexity's head (`_token_nll`)


def input_widths(config: mdjax.ModelConfig) -> tuple[int, int, int]:
  """The input widths of a model's matrices, which an int4 group must divide: the hidden
  size, the attention's output, the MLP's."""
  return config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size


def int4_group(config: mdjax.ModelConfig, wanted: int) -> tuple[int, str]:
  """`wanted` where it divides every matrix's inputs (hidden, the attention's output,
  the MLP's), else the largest power of two below it that does, and why."""
  sizes = input_widths(config)
  group = wanted
  while group > 1 and any(size % group for size in sizes):
    group = 2 ** ((group - 1).bit_length() - 1) if group & (group - 1) else group // 2
  note = "" if group == wanted else (f"{wanted} does not divide the inputs {sizes}; groups "
                                     f"of {group}")
  return group, note


def with_int4(params: dict, group: int, offsets: bool, embedding: str,
              refits: int = GROUP_REFITS) -> dict:
  """`params` with every matrix int4 in groups of `group` (with `offsets` or not, each
  group's grid fit `refits` times), the embedding and an untied head int4 the same way or
  int8."""
  def one(name: str, weight, axis: int):
    if embedding == "int8" and name in INT4_KEEPS_INT8:
      return quantize(weight, 8, axis=axis)
    return quantize(weight, 4, group, axis=axis, offsets=offsets, refits=refits)

  return map_weight_dicts(params, lambda weights: map_matrices(weights, one))


def packed_bytes_per_weight(group: int, offsets: bool) -> float:
  """A packed int4 matrix's bytes per weight: half a byte, and per group a scale (and
  an offset) as held (`GROUP_SCALE_DTYPE`)."""
  return 0.5 + jnp.dtype(GROUP_SCALE_DTYPE).itemsize * (2 if offsets else 1) / group


def weight_bytes(params) -> dict:
  """The bytes of every leaf as held (int4 one value per byte on CPU), and at each
  quantized matrix's bits per value (what int4 takes where it is packed)."""
  held = packed = 0
  for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
    held += leaf.nbytes
    if is_quantized(leaf):
      extra = leaf.scale.nbytes + (0 if leaf.offset is None else leaf.offset.nbytes)
      packed += -(-leaf.q.size * leaf.bits // 8) + extra
    else:
      packed += leaf.nbytes
  return dict(held=int(held), packed=int(packed))


def passage(path: str, commit: str) -> str:
  """The prose of a markdown file (at `commit`, '' for the working tree): code blocks,
  tables and images dropped, whitespace runs as one space."""
  if commit:
    text = subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True).stdout
  else:
    text = pathlib.Path(path).read_text()
  text = re.sub(r"```.*?```", " ", text, flags=re.S)
  kept = [line for line in text.splitlines() if not line.lstrip().startswith(("|", "!["))]
  return re.sub(r"\s+", " ", " ".join(kept)).strip()


def passage_ids(model: mdjax.Model, text: str, limit: int) -> tuple[list[int], int]:
  """The passage's first `limit` token ids (the tokenizer's own special tokens, e.g.
  Gemma's BOS, included) and how many lead (a window starts with them too); random
  ids for a model without a tokenizer (the smoke test)."""
  tokenizer = model.tokenizer
  if tokenizer is None:
    return np.random.default_rng(0).integers(3, model.config.vocab_size, limit).tolist(), 0
  ids = tokenizer(text).input_ids[:limit]
  lead = int(bool(ids) and ids[0] == tokenizer.bos_token_id)
  return ids, lead


def _token_nll(params, tokens, *, config):
  """The NLL of each token after the first: `causal_logits` as its two halves, the
  head over `HEAD_ROWS` positions at a time (a quantized head's per-group int32 sums of
  a whole window, [groups, 2 x rows, vocab], would take gigabytes at Gemma's 262k)."""
  hidden = forward_causal(params, tokens[:, :-1], config=config)[0]  # [T-1, D]
  n, pad = hidden.shape[0], -hidden.shape[0] % HEAD_ROWS
  hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, HEAD_ROWS, hidden.shape[-1])
  targets = jnp.pad(tokens[0, 1:], (0, pad)).reshape(-1, HEAD_ROWS)

  def chunk(part):
    logits = lm_head(params, part[0], config=config)  # [HEAD_ROWS, V] float32
    picked = jnp.take_along_axis(logits, part[1][:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked

  return jax.lax.map(chunk, (hidden, targets)).reshape(-1)[:n]  # [T-1]


nll_program = jax.jit(_token_nll, static_argnames="config")


def perplexity(model: mdjax.Model, ids: list[int], lead: int, window: int, stride: int) -> dict:
  """exp(mean NLL) of every token after the first (after the lead), each scored once
  in the first window that holds it; a window of `window` tokens starts every `stride`
  tokens with the lead tokens before it."""
  head, body = ids[:lead], ids[lead:]
  total, scored, start, done = 0.0, 0, 0, 0 if lead else 1
  while True:
    end = min(start + window - lead, len(body))
    nll = np.asarray(nll_program(model.params, jnp.asarray([head + body[start:end]], jnp.int32),
                          config=model.config))  # nll[j]: the window's token j + 1
    first = max(done, start)  # body index; the window's token lead + k - start
    picked = nll[lead + first - start - 1:lead + end - start - 1]
    total, scored, done = total + float(picked.sum()), scored + len(picked), end
    if end == len(body):
      break
    start += stride
  return dict(perplexity=float(np.exp(total / scored)), mean_nll=total / scored,
              scored_tokens=scored)


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict:
  """Each row's identical prefix against the reference's tokens: the fraction of all
  positions that lie before a row's first divergence, the mean prefix; and the fraction
  of positions equal anywhere (after a divergence, two texts that differ)."""
  prefixes, equal, total = [], 0, 0
  for ref, ours in zip(reference, tokens, strict=True):
    same = [a == b for a, b in zip(ref, ours)]
    prefixes.append(same.index(False) if False in same else len(same))
    equal, total = equal + sum(same), total + len(ref)
  return dict(prefix_fraction=sum(prefixes) / total, mean_prefix=statistics.mean(prefixes),
              prefixes=prefixes, matching_fraction=equal / total)
