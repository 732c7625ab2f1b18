"""The `variants` section: the layer loop and the attention, each way generate can run
them on this device. Compile time and decode ms per token of greedy at batch 1 over a
prompt of each of `--contexts` tokens: the layers scanned vs unrolled (block-sparse
attention), and the attention block_sparse vs fused vs dense (the platform's layer loop),
with whether each variant's tokens equal the first's.
"""

from __future__ import annotations

import functools

import numpy as np

import mdjax
from experiments.bench.common import random_ids, run_mdjax, timed
from experiments.device_check import Settings
from mdjax.models.attention import ATTENTIONS
from mdjax.models.layer_loop import LAYER_LOOPS, default_layer_loop


def variant_cells() -> list[tuple[str, str]]:
  """(layer loop, attention): both loops with block-sparse attention, then the other
  attentions with the platform's loop."""
  loop = default_layer_loop()
  return ([(other, "block_sparse") for other in LAYER_LOOPS]
          + [(loop, attention) for attention in ATTENTIONS if attention != "block_sparse"])


def run_variants(settings: Settings, placed) -> dict:
  """Per context and variant: generate's compile seconds (its first call), decode ms
  per token (paired with the one-token cut), and whether its tokens equal the first
  variant's."""
  rng = np.random.default_rng(settings.seed)
  n, vocab = settings.new_tokens, placed(default_layer_loop()).config.vocab_size
  out = {}  # context -> variant -> cell
  for context in settings.contexts:
    prompt = random_ids(rng, vocab, 1, 1, context - n)  # [1, 1, L]
    cells, first = {}, None
    for loop, attention in variant_cells():
      compile_s = mdjax.generate(placed(loop), prompt[0], max_new_tokens=n, eos_token_id=[],
                                 attention=attention).stats["compile_s"]
      run = functools.partial(run_mdjax, placed(loop), prompt, n, "greedy", attention=attention)
      result = timed({"run": run}, settings.repeats, f"{loop} {attention} {context}")["run"]
      first = result["sequences"] if first is None else first
      cells[f"{loop}/{attention}"] = dict(
          compile_s=compile_s, ms_per_token=result["seconds"] / n * 1e3,
          decode_ms_per_token=result["decode_seconds"] / (n - 1) * 1e3,
          same_tokens_as_first=result["sequences"] == first)
    out[str(context)] = cells
  return dict(contexts=out)
