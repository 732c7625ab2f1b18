"""Choose the BPE vocabulary size from measured loss per byte.

    python -m experiments.bench.compare_vocab --out_dir=/tmp/vocab --steps=300

For each vocabulary size: trains a byte-level BPE on the train split (kept in
`out_dir/tokenizer-<V>`, ready for `--config.tokenizer`), measures bytes per token on
all held-out files, then trains the same small model (configs/lm_draft.py, shortened)
for the same number of steps of the same number of tokens, i.e. equal compute, and
converts its held-out loss into nats per byte (nats per token / bytes per target
token of the evaluated subset), the number comparable across vocabularies. Writes
`comparison.json` and `comparison.md` (a model-card section) into `out_dir`; the last
line printed is the JSON.
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags, logging

from configs import lm_draft
from experiments.cli import one_line_errors
from mdjax.train import data, lm
from mdjax.train import tokenizer as tokenizer_lib

_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where tokenizers, runs and the comparison go.")
_VOCABS = flags.DEFINE_list("vocab_sizes", ["4096", "8192"], "Vocabulary sizes to compare.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per vocabulary.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Tokens per sequence.")
flags.mark_flag_as_required("out_dir")


def compare(out_dir: pathlib.Path) -> dict:
  corpus = data.load_corpus()
  train_texts, heldout_texts = corpus.texts("train"), corpus.texts("heldout")
  rows = []
  for vocab in map(int, _VOCABS.value):
    directory = out_dir / f"tokenizer-{vocab}"
    if not (directory / "tokenizer.json").is_file():
      tokenizer_lib.save(tokenizer_lib.train_bpe(train_texts, vocab), directory)
    fast = tokenizer_lib.load(directory).backend_tokenizer
    config = lm_draft.get_config()
    config.update(run_dir=str(out_dir / f"run-{vocab}"), tokenizer=str(directory),
                  steps=_STEPS.value, batch_size=_BATCH.value, seq_len=_SEQ_LEN.value,
                  eval_every=_STEPS.value, checkpoint_every=_STEPS.value)
    config.optim.warmup_steps = min(config.optim.warmup_steps, _STEPS.value // 10)
    run = lm.train(config)
    result = lm.evaluate(run.params, run.data.heldout, run.model_config, config.batch_size)
    bytes_per_token = tokenizer_lib.bytes_per_token(fast, heldout_texts)
    rows.append({"vocab_size": vocab, "heldout_bytes_per_token": bytes_per_token,
                 "heldout_loss": result["loss"], "heldout_accuracy": result["accuracy"],
                 "heldout_nats_per_byte": result["loss"] / run.data.heldout_bytes_per_token,
                 "model_params": run.model_config.num_params,
                 "tokens_per_run": _STEPS.value * _BATCH.value * _SEQ_LEN.value})
  best = min(rows, key=lambda r: r["heldout_nats_per_byte"])
  summary = {"steps": _STEPS.value, "batch_size": _BATCH.value, "seq_len": _SEQ_LEN.value,
             "model": "configs/lm_draft.py", "rows": rows, "chosen_vocab_size": best["vocab_size"]}
  (out_dir / "comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
  (out_dir / "comparison.md").write_text(markdown(summary))
  return summary


def markdown(summary: dict) -> str:
  intro = (f"Byte-level BPE vocabularies compared at equal compute: the model of "
           f"`{summary['model']}` trained {summary['steps']} steps x {summary['batch_size']} x "
           f"{summary['seq_len']} tokens with each (short, CPU), loss on the fixed held-out "
           f"subset converted to nats per byte. Chosen: {summary['chosen_vocab_size']} "
           "(lowest nats/byte).")
  lines = ["## Vocabulary choice", "", intro, "",
           "| vocab | held-out bytes/token | loss (nats/token) | top-1 accuracy | nats/byte |",
           "|---|---|---|---|---|"]
  for r in summary["rows"]:
    lines.append(f"| {r['vocab_size']} | {r['heldout_bytes_per_token']:.3f} | "
                 f"{r['heldout_loss']:.4f} | {r['heldout_accuracy']:.4f} | "
                 f"{r['heldout_nats_per_byte']:.4f} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  out_dir = pathlib.Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  print(json.dumps(compare(out_dir)))


if __name__ == "__main__":
  app.run(one_line_errors(main))
