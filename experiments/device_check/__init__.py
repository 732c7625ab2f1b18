"""The accelerator check (`python3 -m experiments.device_check`; its sections, flags and
outputs: `__main__.py`), split by what it checks:

- `accelerator_tests`: the `tests` section, `pytest -m accelerator` on this device;
- `costs`: what a step costs here, the `roofline`, `pass_cost` and `profile` sections;
- `variants`: the layer loops and attentions, compile time and decode speed;
- `strategies`: the `branches` and `heads` sections, the strategies against greedy;
- `report`: the JSON and the plot written after every section.

This module: what every section is given, the settings and the model.
"""

from __future__ import annotations

import dataclasses

import mdjax
from experiments.bench import device as bench_device
from experiments.bench.common import Tree, random_llama
from mdjax.strategies import pass_cost


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """What to measure (from the flags, or with `QUICK` for the CPU smoke test)."""

  sections: tuple[str, ...]
  preset: str
  dtype: str
  seed: int
  test_workers: int
  test_timeout_s: int
  tests_k: str  # empty: every accelerator test
  batches: tuple[int, ...]  # roofline
  prompt_len: int
  new_tokens: int  # every generation's; >= 2 (decode time is measured against 1)
  repeats: int
  bandwidth_gbps: float  # 0: by device kind
  bandwidth_mib: int
  pass_batches: tuple[int, ...]  # pass cost
  pass_widths: tuple[int, ...]  # mdjax's `pass_cost.WIDTHS`, but in the smoke test
  pass_rounds: int  # mdjax's `pass_cost.ROUNDS`, but in the smoke test
  contexts: tuple[int, ...]  # variants
  questions: int  # branches
  question_len: int
  context_len: int
  head_batches: tuple[int, ...]  # heads
  head_trees: tuple[Tree, ...]  # each cut to what its strategy takes
  head_new_tokens: int
  profile_new_tokens: int  # profile
  profile_runs: int


# The smoke test compiles few programs: greedy's at batch 1 and 2 over 16 tokens serve the
# roofline, the variants' platform default (a context of 24: 16 prompt tokens), the
# branches (12 + 4), the heads' baseline and the profile alike; t(n) at two widths (one
# ratio), one timed round; one accelerator test, the one that compiles least (a forward).
QUICK = dict(preset="tiny", tests_k="float32_forward_logits", test_workers=0, batches=(1, 2),
             prompt_len=16, new_tokens=8, repeats=1, bandwidth_mib=64, pass_batches=(1,),
             pass_widths=(1, 2), pass_rounds=1, contexts=(24,), questions=2, question_len=4,
             context_len=12, head_batches=(2,), head_trees=(Tree(4, 2, 2),), head_new_tokens=8,
             profile_new_tokens=8, profile_runs=1)


def make_model(settings: Settings) -> mdjax.Model:
  """The random llama of the preset, its context long enough for every prompt, layers
  as a list (`bench_device.on_mesh` places it and lays them out)."""
  config = bench_device.PRESETS[settings.preset]
  longest = max(settings.contexts + (pass_cost.PREFIX + pass_cost.WIDTHS[-1],
                                     settings.context_len))
  config = dataclasses.replace(config, max_position_embeddings=max(
      config.max_position_embeddings, 2 * longest))
  return random_llama(config, settings.seed, settings.dtype, f"random-llama-{settings.preset}")
