"""What a step of the target costs on this device, three ways:

- `roofline`: `experiments.bench.device`'s greedy cells on one device, per-token time and
  the HBM roofline fraction at each batch of `--batches`;
- `pass_cost`: the target's pass cost t(n) at each batch of `--pass_batches`, measured as
  `tree_budget="auto"` measures it (`mdjax.strategies.pass_cost.measure`), and
  t(n) / t(1): what a draft tree of n tokens costs beside one greedy step;
- `profile`: one greedy step kernel by kernel under `jax.profiler`
  (`experiments.bench.step_profile`): each kernel's time, bytes and GB/s, and the kernel
  time per step against the wall time per step.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from experiments.bench import device as bench_device
from experiments.bench import step_profile
from experiments.bench.common import random_ids, run_mdjax, timed
from experiments.device_check import Settings
from mdjax.models.attention import default_attention
from mdjax.models.layer_loop import default_layer_loop
from mdjax.strategies import pass_cost
from mdjax.strategies.base import ModelFn


def run_roofline(settings: Settings, placed) -> dict:
  """`bench_device`'s greedy cells at every batch, on its own settings and device info."""
  model = placed(default_layer_loop())
  bench = bench_device.Settings(
      model="", preset=settings.preset, draft="", dtype=settings.dtype,
      layer_loop=default_layer_loop(), batches=settings.batches, meshes=((1, 1),), questions=0,
      prompt_len=settings.prompt_len, new_tokens=settings.new_tokens, repeats=settings.repeats,
      bandwidth_gbps=settings.bandwidth_gbps, bandwidth_mib=settings.bandwidth_mib,
      seed=settings.seed)
  device = bench_device.device_info(bench)
  rng = np.random.default_rng(settings.seed)
  rows = {b: random_ids(rng, model.config.vocab_size, 1, b, settings.prompt_len)
          for b in settings.batches}  # [1, B, L]
  results = timed({b: functools.partial(run_mdjax, model, r, settings.new_tokens, "greedy")
                   for b, r in rows.items()}, settings.repeats, "roofline")
  return dict(device=device, batches={
      str(b): bench_device.greedy_cell(model, results[b], b, bench, device, 1)
      for b in settings.batches})


def run_pass_cost(settings: Settings, placed) -> dict:
  """t(n) per batch, as `auto` measures it, with generate's attention on this device."""
  model = placed(default_layer_loop())
  target = ModelFn(config=model.config, attention=default_attention())
  batches = {}
  for batch in settings.pass_batches:
    seconds = pass_cost.measure(target, model.params, batch, settings.pass_widths,
                                settings.pass_rounds)
    batches[str(batch)] = {str(n): dict(ms=t * 1e3, ratio_to_first=t / seconds[0],
                                        ms_per_token=t * 1e3 / n)
                           for n, t in zip(settings.pass_widths, seconds)}
  return dict(prefix=pass_cost.PREFIX, attention=target.attention, batches=batches)


def run_profile(settings: Settings, placed) -> dict:
  """`step_profile.profile_greedy` at batch 1 over a prompt of `prompt_len` tokens."""
  model = placed(default_layer_loop())
  prompt = random_ids(np.random.default_rng(settings.seed), model.config.vocab_size, 1,
                      settings.prompt_len)
  bandwidth = settings.bandwidth_gbps or (bench_device.datasheet_bandwidth(
      jax.devices()[0].device_kind) or 0.0)
  return step_profile.profile_greedy(model, prompt, settings.profile_new_tokens,
                                     settings.profile_runs, bandwidth)
