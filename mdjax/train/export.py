"""A trained run -> a Hugging Face directory that `mdjax.load` and transformers both read.

    export/
      config.json, generation_config.json, model.safetensors   (`mdjax.checkpoints.hf.save_hf`)
      tokenizer.json, tokenizer_config.json
      heldout_files.json     the files no training token came from (evaluate on these)
      training_summary.json  data, tokens seen, and held-out loss / accuracy measured on
                             the *exported* weights (after any bfloat16 rounding)
      README.md              the model card (+ the markdown file `config.card_notes`)
      fingerprint.json       a few held-out sequences (token ids) with the loss and
                             accuracy the exported weights give on them: a test
                             recomputes them, so a wrong file cannot ship silently

The recorded held-out numbers come from reloading the written files, so a shipped
model can be checked against its own card.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import shlex
import shutil
import sys

import jax
import ml_collections

from mdjax import distributed, sharding
from mdjax.checkpoints import hf
from mdjax.models.model import Model
from mdjax.train import data, distill
from mdjax.train.lm import Run, evaluate, evaluate_heldout


def export(run: Run, config: ml_collections.ConfigDict, directory: str | os.PathLike,
           command: str | None = None) -> dict:
  """Writes `run` into `directory` (replaced atomically); returns the training summary.

  Under `jax.distributed` every process makes this call: process 0 writes the files,
  and every process measures the summary on the weights it reads back from them."""
  directory = pathlib.Path(directory)
  run_dir = pathlib.Path(config.run_dir)
  main = distributed.is_main_process()
  params = sharding.one_device_layout(distributed.to_host(run.params), run.model_config)
  if main:
    model = Model(config=run.model_config, params=params, tokenizer=run.tokenizer,
                  name=directory.name)
    hf.save_hf(model, directory, dtype=config.export_dtype,
               max_shard_bytes=int(config.export_shard_mb * 2**20) or None)
    shutil.copyfile(run_dir / "heldout_files.json", directory / "heldout_files.json")
  distributed.barrier("export")
  exported = hf.load_hf_dir(directory)
  device = jax.devices()[0]
  summary = {
      "command": command or shlex.join([sys.executable, *sys.argv]),
      "trained_on": f"{device.platform}: {device.device_kind}",
      "python": platform.python_version(),
      "data_root": str(run.corpus.root),
      "data_pattern": config.data_pattern,
      "train_files": len(run.corpus.train),
      "heldout_files": len(run.corpus.heldout),
      "train_tokens": run.data.train_tokens,
      "steps": run.step,
      "batch_size": config.batch_size,
      "seq_len": config.seq_len,
      "tokens_seen": run.step * config.batch_size * config.seq_len,
      # the row mix trained on (none when no step was run)
      **(dataclasses.asdict(data.RowMix.from_config(config)) if run.step else {}),
      **continued_from(config.init_from, run.step * config.batch_size * config.seq_len),
      **distilled_from(run.teacher),
      "num_params": run.model_config.num_params,
      "vocab_size": run.model_config.vocab_size,
      "weights_dtype": config.export_dtype,
      "eval_sequences": len(run.data.heldout),
      "heldout_bytes_per_token": run.data.heldout_bytes_per_token,
      **evaluate_heldout(exported.params, exported.config, run.data, config.batch_size,
                         run.teacher),
  }
  fingerprint = measure_fingerprint(
      exported, run.data.heldout[:FINGERPRINT_SEQUENCES, :FINGERPRINT_TOKENS + 1])
  if main:
    (directory / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (directory / "fingerprint.json").write_text(json.dumps(fingerprint) + "\n")
    card = model_card(directory.name, run.model_config, summary)
    if config.card_notes:
      card += "\n" + pathlib.Path(config.card_notes).read_text()
    (directory / "README.md").write_text(card)
  return summary


def recorded_summary(directory: str | os.PathLike) -> dict:
  """The `training_summary.json` an export wrote into `directory`, or {} where there is none."""
  file = pathlib.Path(directory) / "training_summary.json"
  return json.loads(file.read_text()) if file.is_file() else {}


def lineage_tokens(summary: dict) -> int:
  """The tokens a recorded model saw over its whole lineage (0 for an unrecorded one)."""
  return summary.get("tokens_seen_total", summary.get("tokens_seen", 0))


def continued_from(init_from: str, tokens_seen: int) -> dict:
  """`init_from`, the tokens seen over the whole lineage (this run's + its start's), and
  how the start was made when it is a soup or a grown model (`experiments.soup_lm`,
  `experiments.grow_lm`)."""
  earlier = recorded_summary(init_from) if init_from else {}
  made = {key: earlier[key] for key in ("averaged_from", "grown_from") if key in earlier}
  return {"init_from": init_from, "tokens_seen_total": tokens_seen + lineage_tokens(earlier),
          **made}


def distilled_from(teacher: distill.Teacher | None) -> dict:
  """The teacher and the loss mix (its held-out agreement: `lm.evaluate_heldout`)."""
  if teacher is None:
    return {"teacher": ""}
  return {"teacher": teacher.name, "distill_weight": teacher.weight,
          "distill_temperature": teacher.temperature}


FINGERPRINT_SEQUENCES, FINGERPRINT_TOKENS = 4, 128


def measure_fingerprint(model: Model, sequences) -> dict:
  """`fingerprint.json`: `sequences` [N, T + 1] and the loss / accuracy `model` gives on
  them."""
  result = evaluate(model.params, sequences, model.config, batch_size=len(sequences))
  return {"sequences": [[int(t) for t in row] for row in sequences], **result}


def continuation_line(summary: dict) -> str:
  """The card's sentences on copy rows, the run this one continued and its teacher."""
  if not summary["steps"]:
    lines = [f"These are the weights of `{summary['init_from']}` as they are: "
             f"{summary['tokens_seen_total']:,} tokens seen in all."]
  else:
    lines = _row_lines(summary)
    if summary["init_from"]:
      lines.append(f"Continued from the weights of `{summary['init_from']}`: "
                   f"{summary['tokens_seen_total']:,} tokens seen in all.")
  if summary.get("averaged_from"):
    parts = ", ".join(f"`{i['model']}` x {i['weight']:.3g}" for i in summary["averaged_from"])
    lines.append(f"`{summary['init_from']}` is a soup (`experiments.soup_lm`): the average "
                 f"of the weights of {parts}.")
  if summary.get("grown_from"):
    g = summary["grown_from"]
    lines.append(f"`{summary['init_from']}` is `{g['model']}` grown (`experiments.grow_lm`) "
                 f"from {g['num_kv_heads']} KV heads and {g['num_layers']} layers.")
  if summary.get("teacher"):
    lines.append(f"Distilled from `{summary['teacher']}` (loss = {1 - summary['distill_weight']:g} "
                 f"x cross-entropy + {summary['distill_weight']:g} x KL to the teacher at "
                 f"temperature {summary['distill_temperature']:g}); held-out argmax agreement "
                 f"with it: {summary['heldout_teacher_agreement']:.4f}.")
  return "\n".join(lines) + ("\n" if lines else "")


def _row_lines(summary: dict) -> list[str]:
  """A sentence per kind of copy row the run trained on."""
  lines = []
  if summary.get("copy_fraction"):
    lengths = (f"{summary['copy_min_period']} tokens to half the row long"
               if summary.get("copy_min_period") else "half the row long")
    if summary.get("copy_shown_twice"):
      repeated = f"show consecutive chunks of their own twice each, {lengths}"
    elif summary.get("copy_min_period"):
      repeated = f"repeat a prefix of their own over and over, {lengths}"
    else:
      repeated = "repeat their first half"
    lines.append(f"{summary['copy_fraction']:.0%} of the sequences {repeated} "
                 "(copy rows, see `mdjax.train.data`).")
  if summary.get("random_copy_fraction"):
    details = (f", {summary['random_copy_common_share']:.0%} of their positions one of the "
               "block's 2..8 common ids" if summary.get("random_copy_common_share") else "")
    repeated = ("show blocks of random ids twice each" if summary.get("random_copy_shown_twice")
                else "repeat a block of random ids")
    lines.append(f"{summary['random_copy_fraction']:.0%} of the sequences {repeated}"
                 f"{details} (random copy rows, see `mdjax.train.data`).")
  return lines


def _steps_line(summary: dict) -> str:
  s = summary
  if not s["steps"]:
    return f"No training step: exported only (`--config.export_only=True`), on {s['trained_on']}."
  return (f"{s['steps']} steps x {s['batch_size']} sequences x {s['seq_len']} tokens = "
          f"{s['tokens_seen']:,}\ntokens seen, AdamW with warmup + cosine decay, trained on "
          f"{s['trained_on']}.")


def model_card(name: str, config, summary: dict) -> str:
  """The README of an exported model: what it is, how it was made, how well it does."""
  c = config
  s = summary
  return f"""# {name}

A {c.num_params / 1e6:.2f}M-parameter llama (hidden {c.hidden_size}, {c.num_layers} layers,
{c.num_heads} heads of {c.head_dim} with {c.num_kv_heads} KV heads, MLP {c.intermediate_size},
{"tied" if c.tie_word_embeddings else "untied"} embeddings, context {c.max_position_embeddings})
trained by mdjax's own trainer (`mdjax.train.lm`). Weights: {s["weights_dtype"]} safetensors.

    import mdjax
    model = mdjax.load("{name}")

## Data

The `{s["data_pattern"]}` files under `{s["data_root"]}` (Python {s["python"]}), split by file:
{s["train_files"]} training files ({s["train_tokens"]:,} tokens), {s["heldout_files"]} held-out
files listed in `heldout_files.json`. Byte-level BPE tokenizer, vocabulary {c.vocab_size}
(`<bos>` 0, `<eos>` 1 after every file, `<pad>` 2).

## Training

    {s["command"]}

{_steps_line(s)}
{continuation_line(s)}
## Held-out results (measured on these exported weights)

| held-out sequences | loss (nats/token) | top-1 next-token accuracy | bytes/token | nats/byte |
|---|---|---|---|---|
| {s["eval_sequences"]} x {s["seq_len"]} tokens | {s["heldout_loss"]:.4f} | {s["heldout_accuracy"]:.4f} | {s["heldout_bytes_per_token"]:.3f} | {s["heldout_nats_per_byte"]:.4f} |

Copying: the same sequences with their first half repeated, scored on the repeated half
(`mdjax.train.lm.evaluate_copying`): loss {s["heldout_copy_loss"]:.4f}, top-1 accuracy
{s["heldout_copy_accuracy"]:.4f} (a model that copies scores ~0 and ~1); given 4 tokens of
the repeat, greedy decoding copies the next 32 exactly in {s["heldout_greedy_copy"]:.0%} of
the sequences. On blocks of 64 random ids shown twice, the top-1 accuracy on the repeat
is {s["random_copy_accuracy"]:.4f} (`mdjax.train.lm.evaluate_induction`: only an induction
mechanism scores above chance).
"""
