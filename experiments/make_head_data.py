"""Make the heads' training data: prompts the model grows, its own answers, and the
hidden states heads read, captured while it generates (no second pass).

    python -m experiments.make_head_data --out_dir=runs/head_data            # 1M answer tokens
    python -m experiments.make_head_data --out_dir=runs/head_data --max_minutes=60
    python -m experiments.make_head_data --out_dir=/tmp/hd --max_tokens=20000 --grow_prompts=64

The same command on the same directory resumes (the settings that shape the data must
be the same; budgets and batch may change). The last line printed is a JSON summary:
this run's tokens, tokens/s and padding waste. The directory (`mdjax.train.head_data.dataset`,
read it with `HeadData(out_dir)`)::

    out_dir/
      meta.json          model, aux_layers, hidden_size, sampling, seed, ...
      grown.json         requests the model wrote; dropped, by reason
      prompts.jsonl      {"id", "kind", "split": "train"|"heldout", "text"} per line
      chunks/00000/      written atomically, one every --chunk_tokens tokens
        rows.npy         int32 [R, 5]      item, prompt id, start, length, prompt_length
        tokens.npy       int32 [N]         the rows' tokens end to end, prompt then answer
        hidden.npy       float16 [N, D]    final-norm hidden state per token
        aux.npy          float16 [N, A, D] residual stream after each aux layer
      chunks/00001/ ...

Bad input: one `error: ...` line, exit 1.
"""

from __future__ import annotations

import json

from absl import app, flags

import mdjax
from experiments.cli import check_argv, fail, one_line_errors
from mdjax.train.head_data import prompts as head_prompts
from mdjax.train.head_data.make import DataConfig, make

_OUT_DIR = flags.DEFINE_string("out_dir", None, "The data directory (created, or resumed).")
_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Anything `mdjax.load` takes.")
_LAYER_LOOP = flags.DEFINE_enum("layer_loop", None, ["scan", "unrolled"],
                                "The model's layer loop (default: the platform's).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 1_000_000, "Stop after this many answer tokens "
                                   "(over all runs on the directory).")
_MAX_MINUTES = flags.DEFINE_float("max_minutes", 0, "Stop after this many minutes of this run "
                                  "(0: no limit); rows in flight are dropped (a rerun "
                                  "answers them).")
_PROMPTS = flags.DEFINE_string("prompts_file", None, "Use these prompts (one per line, or "
                               "JSON lines) instead of the built-in and grown ones.")
_GROW = flags.DEFINE_integer("grow_prompts", 4000, "Prompts the model writes (besides the "
                             "built-in ones).")
_HELDOUT = flags.DEFINE_float("heldout_fraction", 0.05, "Prompts held out (by prompt).")
_SAMPLES = flags.DEFINE_integer("samples_per_prompt", 2, "Answers per prompt (the work order "
                                "answers every prompt once before any twice).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.7, "Answer sampling temperature (0: greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 64, "Answers (and grown prompts) sample among the k best.")
_GROW_TEMPERATURE = flags.DEFINE_float("grow_temperature", 1.0, "Temperature of prompt growth.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Answer tokens at most.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", 256, "Longer prompts are left out.")
_AUX = flags.DEFINE_list("aux_layers", [], "Layers (from 0) whose outputs are kept "
                         "(default: EAGLE-3's 1, L//2 - 1, L - 4).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the prompts, the split, the order and sampling.")
_BATCH = flags.DEFINE_integer("batch", 256, "Rows decoded at once (256: ~8 GB of KV cache for "
                              "SmolLM2 at the default lengths).")
_REFILL = flags.DEFINE_integer("refill_rows", 0, "Finished rows refilled at once "
                               "(0: batch // 8).")
_STEPS = flags.DEFINE_integer("steps_per_call", 8, "Decode steps per compiled call.")
_CHUNK = flags.DEFINE_integer("chunk_tokens", 65536, "Tokens per chunk file set.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show progress bars.")
flags.mark_flag_as_required("out_dir")


@one_line_errors
def main(argv):
  check_argv(argv)
  try:
    aux_layers = tuple(int(x) for x in _AUX.value)
  except ValueError:
    fail(f"--aux_layers must be integers, got {_AUX.value!r}")
  config = DataConfig(
      out_dir=_OUT_DIR.value, grow_prompts=_GROW.value, heldout_fraction=_HELDOUT.value,
      samples_per_prompt=_SAMPLES.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
      grow_temperature=_GROW_TEMPERATURE.value, max_new_tokens=_MAX_NEW.value,
      max_prompt_tokens=_MAX_PROMPT.value, aux_layers=aux_layers, seed=_SEED.value,
      max_tokens=_MAX_TOKENS.value, max_minutes=_MAX_MINUTES.value, batch=_BATCH.value,
      refill_rows=_REFILL.value, steps_per_call=_STEPS.value, chunk_tokens=_CHUNK.value,
      progress=_PROGRESS.value)
  loop = {"layer_loop": _LAYER_LOOP.value} if _LAYER_LOOP.value else {}
  prompts = head_prompts.read_prompts(_PROMPTS.value) if _PROMPTS.value else None
  print(json.dumps(make(config, mdjax.load(_MODEL.value, **loop), prompts)))


if __name__ == "__main__":
  app.run(main)
