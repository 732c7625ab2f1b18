"""A heads run's export: the heads with their held-out accuracies, `heldout_prompts.json`
and the model card (README.md: the target, the data, the training, the held-out
numbers, how to decode with them), written atomically by process 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform

import jax
import numpy as np

from mdjax import distributed
from mdjax.files import atomic_directory
from mdjax.heads import HeadFamily, Heads, HeadsConfig, save_heads
from mdjax.train.config import HeadsDataConfig, HeadsTrainConfig
from mdjax.train.heads.inputs import RunData, heldout_coverage
from mdjax.train.loop import Outcome

HELDOUT_FILE = "heldout_prompts.json"


def model_card(name: str, spec: HeadsConfig, family: HeadFamily, config: HeadsTrainConfig,
               run_data: RunData, heldout: dict, outcome: Outcome,
               draft_ids: np.ndarray | None = None, records: list[dict] = ()) -> str:
  """README.md of an export: target model, data, training, held-out numbers (and their
  curve over training, from the run's metric `records`), usage."""
  kind, label, strategy = family.describe(spec), family.step_label, family.strategy
  table = "\n".join(f"| {i + 1} | " + " | ".join(f"{a:.3f}" for a in (*acc[:5], acc[9])) + " |"
                    for i, acc in enumerate(heldout["heldout_topk"]))
  return f"""# {name}

{kind} for `{spec.base_model}`, trained by self-distillation with `mdjax.train.heads`
(`python -m experiments.train_heads`): the base wrote its own training text, and the
heads learned to guess, from its hidden states, what it writes further ahead.

## Data

{_card_data(config.data, config.heldout_fraction, run_data)}

## Training

{_card_training(config, family.window(spec.num_heads) is None, outcome)}
{_card_vocabulary(spec, run_data, draft_ids)}
## Held-out accuracy

Each {label}'s guesses against the base's greedy choice of the same token, on the
held-out answers ({run_data.heldout.rows} rows), cumulative top-k:

| {label} | top-1 | top-2 | top-3 | top-4 | top-5 | top-10 |
|---|---|---|---|---|---|---|
{table}

Simulated accepted length, 1 + sum_k prod_(i <= k) top-1_i:
**{heldout["heldout_accepted_length"]:.3f}** tokens per base pass. Held-out loss
{heldout["heldout_loss"]:.4f}.
{_card_curve(records, label, config, run_data, family.window(spec.num_heads) is None)}

## Use

```python
import mdjax
model = mdjax.load({spec.base_model!r})
heads = mdjax.load_heads("path/to/{name}")
out = mdjax.generate(model, prompts, strategy={strategy!r}, heads=heads)
```
"""


def _card_curve(records: list[dict], label: str, config: HeadsTrainConfig,
                run_data: RunData, whole_rows: bool) -> str:
  """Held-out top-1 per drafted step (head) at every evaluation of the run, against the
  training tokens seen by then (steps x units per step, a unit a position, or with
  `whole_rows` a row of the training rows' mean answer tokens); step 0: the heads a
  continued run (`init_from`) started from."""
  evaluations = sorted({r["step"]: r for r in records if "heldout_top1" in r}.values(),
                       key=lambda r: r["step"])
  if len(evaluations) < 2:
    return ""
  train = run_data.train
  per_unit = train.answer_tokens / max(train.rows, 1) if whole_rows else 1
  depth = len(evaluations[-1]["heldout_top1"])
  lines = [f"| step | answer tokens seen | " + " | ".join(f"{label} {k + 1}" for k in range(depth))
           + " |", "|---|---|" + "---|" * depth]
  for r in evaluations:
    seen = r["step"] * config.batch_size * per_unit
    lines.append(f"| {r['step']} | {seen:,.0f} | " + " | ".join(
        f"{a:.3f}" for a in r["heldout_top1"]) + " |")
  start = f" (step 0: the heads it continued, `{config.init_from}`)" if config.init_from else ""
  return ("\n## Held-out top-1 during training\n\nAt each evaluation of this run" + start +
          ", each " + label + "'s held-out top-1, against the answer tokens trained on by "
          "then (steps x units per step" + (" x the mean answer tokens of a training row"
                                            if whole_rows else "") +
          "; every token trains every " + label + "):\n\n" + "\n".join(lines) + "\n")


def _card_vocabulary(spec: HeadsConfig, run_data: RunData, draft_ids: np.ndarray | None) -> str:
  """The draft vocabulary's size and held-out coverage, when the heads have one."""
  if draft_ids is None:
    return ""
  coverage = heldout_coverage(run_data, np.asarray(draft_ids))
  return f"""
## Draft vocabulary

The heads score {len(draft_ids)} of the base's {spec.vocab_size} tokens (the most frequent
in the training answers; `draft_ids`, `mdjax.heads.vocab`). They cover
**{coverage:.1%}** of the base's greedy tokens in the held-out answers: a token outside
is never drafted (the base's own verify still writes it, so decoding stays exact).
"""


def _card_data(data: HeadsDataConfig, heldout_fraction: float, run_data: RunData) -> str:
  d, train, held = run_data.description, run_data.train, run_data.heldout
  if data.data_dir:
    lines = [f"- {d['source']}: {d['prompts']} prompts, held out by prompt as the data set "
             f"splits them (`{HELDOUT_FILE}`); the base's own answers and hidden states"]
  elif data.text_file:
    lines = [f"- {d['source']}, cut into rows of {data.text_row_tokens} tokens, a seeded "
             f"{heldout_fraction:.0%} of the rows held out (`{HELDOUT_FILE}`)"]
  else:
    how = f"sampled at temperature {data.temperature}" if data.temperature > 0 else "greedy"
    lines = [f"- prompts: {d['source']} ({d['prompts']} prompts), a seeded "
             f"{heldout_fraction:.0%} held out by prompt (`{HELDOUT_FILE}`)",
             f"- answers written by the base itself: {how}, at most {data.max_new_tokens} new "
             f"tokens, {data.samples_per_prompt} per prompt, chat template: {d['chat']}"]
  lines.append(f"- train: {train.rows} rows, {train.token_count} tokens ({train.answer_tokens} "
               f"answer tokens); held-out: {held.rows} rows, {held.token_count} tokens")
  return "\n".join(lines)


def _card_training(config: HeadsTrainConfig, whole_rows: bool, outcome: Outcome) -> str:
  """The schedule, the objective and where it ran; `whole_rows`: a batch's units."""
  device = jax.devices()[0]
  unit = "rows" if whole_rows else "positions"
  unrolled = f", unrolled {config.eagle.unroll} steps" if config.eagle.unroll > 1 else ""
  stopped = " (stopped by the time budget)" if outcome.stopped_early else ""
  continued = ([f"- continued from the heads `{config.init_from}` (their weights and draft "
                "vocabulary; a fresh optimizer)"] if config.init_from else [])
  return "\n".join(continued + [
      f"- {outcome.step} steps{stopped} of "
      f"{config.batch_size} {unit}; AdamW, lr {config.optim.lr} (warmup "
      f"{config.optim.warmup_steps}, cosine); loss `{config.loss}`, weights "
      f"{config.head_decay}^(k-1){unrolled}",
      f"- {outcome.train_seconds / 60:.1f} minutes on {device.platform} ({device.device_kind}, "
      f"{os.cpu_count()} CPU cores), Python {platform.python_version()}, seed {config.seed}"])


def export(heads: Heads, directory: pathlib.Path, *, family: HeadFamily,
           config: HeadsTrainConfig, run_data: RunData, heldout: dict,
           outcome: Outcome, records: list[dict] = ()) -> Heads:
  """Writes the heads with their held-out accuracies (`HeadsConfig.top_accuracy`), the
  model card (with the held-out curve of the run's metric `records`) and
  `heldout_prompts.json` into `directory`, replaced atomically (process 0 writes; every
  process returns the heads once they are written)."""
  spec = dataclasses.replace(heads.config, top_accuracy=heldout["heldout_topk"])
  card = model_card(directory.name, spec, family, config, run_data, heldout, outcome,
                    heads.params.get("draft_ids"), records)
  heads = Heads(config=spec, params=heads.params, card=card, name=str(directory))
  if distributed.is_main_process():
    with atomic_directory(directory) as staging:
      save_heads(heads, staging, dtype=config.export_dtype)
      (staging / HELDOUT_FILE).write_text(json.dumps(run_data.heldout_prompts, indent=1) + "\n")
  distributed.barrier("heads export")
  return heads
