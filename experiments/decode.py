"""Decode one prompt with any strategy or pipeline and print the text and a JSON summary.

    python -m experiments.decode --config=configs/greedy.py
    python -m experiments.decode --config=configs/sample.py --config.temperature=0.7 \
        --config.model=path/to/hf_dir --config.prompt="Once upon a time"

Many hosts (the same command on every one; `mdjax.distributed`): `--config.mesh=2,4
--config.distributed=auto` on a TPU pod slice or under SLURM, or, two processes of 4
CPU devices on one machine, `JAX_NUM_CPU_DEVICES=4 ... --config.distributed=localhost:1234,2,I`
for I = 0 and 1. Only process 0 prints and writes `--output_json`.

Output (stdout): the model's description line (it says RANDOM WEIGHTS for a random
model), the generated text (the ids when the model has no tokenizer; a text without the
EOS that ended it), then the JSON summary: model, strategy, prompt_tokens (the prompt's
ids), sequences (EOS included), texts, stats. With `--output_json=PATH` the summary goes
to that file (written atomically) instead, and the terminal shows only where it went.
Config fields: configs/common.py.

Bad input: one `error: ...` line on stderr, no traceback, exit code 1; a bad flag,
config file or config override exits with 2.
"""

from __future__ import annotations

import json

from absl import app, flags, logging
from ml_collections import config_flags

import mdjax
from mdjax import chat, distributed, files, pipelines, strategies
from mdjax.prompts import encode_continuation
from mdjax.strategies import skeleton
from experiments.cli import fail, one_line_errors, start_processes

_CONFIG = config_flags.DEFINE_config_file("config", None, "Decode config, e.g. configs/greedy.py.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None,
                                   "Write the JSON summary to this file instead of stdout.")
flags.mark_flag_as_required("config")

USAGE_ERROR = 2


def _last_line(error: Exception) -> str:
  """The gist of an error whose message may hold a whole traceback (config_flags')."""
  return [line.strip() for line in str(error).splitlines() if line.strip()][-1]


def _key_error_message(error: Exception) -> str:
  """ConfigDict's message for a missing field (wrapped in an AttributeError by getattr)."""
  while error.args and isinstance(error.args[0], Exception):
    error = error.args[0]
  return str(error.args[0]) if error.args else repr(error)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, but a bad flag or config file is one line, not the usage text."""
  try:
    remaining = flags.FLAGS(argv)
    _CONFIG.value.lock()  # a config file that failed to load raises OSError on any access
  except flags.Error as e:
    fail(_last_line(e) if "Traceback" in str(e) else e, USAGE_ERROR)
  except OSError as e:
    fail(f"cannot load the config file: {_last_line(e)}", USAGE_ERROR)
  except (AttributeError, KeyError) as e:  # config_flags, for --config.<field> of no field
    fail(f"unknown config field {_key_error_message(e)}", USAGE_ERROR)
  except Exception as e:  # noqa: BLE001 -- a config file is Python: any error in it is the config's
    fail(f"cannot load the config file: {type(e).__name__}: {e}", USAGE_ERROR)
  if len(remaining) > 1:
    fail(f"unexpected arguments {remaining[1:]!r}", USAGE_ERROR)
  return remaining


def _ids(field: str, text: str) -> list[int]:
  """Comma-separated token ids: "1,2,3" (or "" for none)."""
  try:
    return [int(t) for t in text.split(",")] if text.strip() else []
  except ValueError:
    raise mdjax.MdjaxError(f"{field} must be comma-separated token ids, got {text!r}") from None


def _eos(text: str) -> list[int] | None:
  """The `eos_token_id` field: "" = the model's own (None), "none" = no EOS, else ids."""
  if not text.strip():
    return None
  return [] if text.strip().lower() == "none" else _ids("eos_token_id", text)


def _chat(model: mdjax.Model, config, prompt, options: dict):
  """With `config.chat`: the prompt (and each question) as the model's chat template
  renders them (`mdjax.chat`); else unchanged."""
  if not config.chat:
    return prompt, options
  if not isinstance(prompt, str):
    raise mdjax.MdjaxError("chat=True needs a text prompt, not prompt_ids")
  system = config.system or None
  if "questions" in options:
    context, questions = chat.chat_questions(model, prompt, options["questions"], system,
                                             config.question_separator)
    return context, dict(options, questions=questions)
  return chat.chat_ids(model, prompt, system), options


def _one_after_another(model: mdjax.Model, prompt_ids: list[int], questions: list[list[int]],
                       common: dict, out) -> dict:
  """Each question answered alone (its own prefill of the context), as a check that
  the shared answers are exactly these and as the timing to beat."""
  alone = [mdjax.generate(model, [prompt_ids + q], **common) for q in questions]
  wall_s = sum(a.stats["wall_s"] for a in alone)
  same = [a.sequences[0] for a in alone] == out.sequences
  print(f"--- shared cache: {out.stats['wall_s']:.2f} s for {len(questions)} answers; one after "
        f"another: {wall_s:.2f} s ({wall_s / out.stats['wall_s']:.2f}x); same answers: {same}")
  return dict(wall_s=wall_s, same_answers=same,
              speedup=wall_s / out.stats["wall_s"])


def decode(config) -> dict:
  """Loads the model, decodes, prints the text; returns the JSON summary. `config.strategy`
  names a strategy (one `mdjax.generate` call) or a pipeline (`mdjax.pipelines.run`)."""
  pipeline = config.strategy in pipelines.PIPELINES
  names = (pipelines if pipeline else strategies).option_names(config.strategy)
  options = {k: config[k] for k in names if k in config}
  if "questions" in options:
    options["questions"] = list(options["questions"])
  model = mdjax.load(config.model, dtype=config.dtype or None,
                     mesh=mdjax.sharding.mesh_from_spec(config.mesh))
  print(model.description)
  if "draft" in options:  # a model name or directory in the config
    options["draft"] = mdjax.load(options["draft"], dtype=config.dtype or None)
    print("draft: " + options["draft"].description)
  if "heads" in options:  # a shipped heads name or a directory in the config
    options["heads"] = mdjax.load_heads(options["heads"])
    print(f"heads: {options['heads'].name} ({options['heads'].config.family}, "
          f"{options['heads'].config.num_heads} head(s))")
  prompt, options = _chat(model, config, config.prompt or _ids("prompt_ids", config.prompt_ids),
                          options)
  (prompt_ids,) = mdjax.encode_prompts(model, [prompt])
  common = dict(max_new_tokens=config.max_new_tokens, eos_token_id=_eos(config.eos_token_id),
                seed=config.seed)
  if pipeline:
    out = pipelines.run(config.strategy, model, [prompt], **common, **options)
  else:
    out = mdjax.generate(model, [prompt], strategy=config.strategy, **common, **options)
  summary = dict(model=config.model, strategy=config.strategy, prompt_tokens=prompt_ids,
                 sequences=out.sequences, texts=out.texts, stats=out.stats)
  if config.strategy == "skeleton_fill" and out.texts:  # the source with its bodies filled in
    print(skeleton.assemble(config.prompt, out.texts))
  elif config.strategy == "multi_question":
    print(config.prompt)
    for i, question in enumerate(config.questions):
      answer = out.texts[i] if out.texts else " ".join(map(str, out.sequences[i]))
      print(f"--- Q{i + 1}: {question}\n{answer}")
    if config.compare_sequential:
      questions = [encode_continuation(model, q) for q in options["questions"]]
      summary["one_after_another"] = _one_after_another(model, prompt_ids, questions, common,
                                                        out)
  else:
    for i, sequence in enumerate(out.sequences):
      if len(out.sequences) > 1:
        print(f"--- branch {i}")
      print(out.texts[i] if out.texts else " ".join(map(str, sequence)))
  return summary


@one_line_errors
def main(argv):
  del argv  # parse_flags rejected any positional argument
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # not JAX's INFO lines: stderr is for errors
  start_processes(_CONFIG.value)
  text = json.dumps(decode(_CONFIG.value))
  if not _OUTPUT_JSON.value:
    print(text)
  elif distributed.is_main_process():
    files.write_text(_OUTPUT_JSON.value, text + "\n")
    print(f"--- summary (JSON): {_OUTPUT_JSON.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
