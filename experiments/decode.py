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

`--stream`: the text is shown as it is written (`mdjax.stream(..., text=True)`), then
decoded again by `generate` for the summary and its timings (which stay those of one
`generate` call; the stream's own programs compile first). The default: when stdout is a
terminal (someone watches; a pipe, CI's log or a test gets the text once, as before), one
process runs the job, and the run can (a strategy that streams, not a pipeline or
skeleton_fill, and a model with a tokenizer). Answers decoded together (multi_question's,
several branches) are shown in order: the first as it grows, each later one as far as it
got when the one before it ended, then growing (`--nostream`: never).

Bad input: one `error: ...` line on stderr, no traceback, exit code 1; a bad flag,
config file or config override exits with 2.
"""

from __future__ import annotations

import json
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

import mdjax
from mdjax import chat, distributed, files, pipelines, strategies
from mdjax.controls import CONTROL_OPTIONS
from mdjax.prompts import encode_continuation
from mdjax.strategies import skeleton
from experiments.cli import fail, one_line_errors, start_processes

_CONFIG = config_flags.DEFINE_config_file("config", None, "Decode config, e.g. configs/greedy.py.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None,
                                   "Write the JSON summary to this file instead of stdout.")
_STREAM = flags.DEFINE_boolean(
    "stream", None, "Show the text as it is written, then decode it again for the summary; "
    "default: when stdout is a terminal and the run can (see the module docstring).")
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


# a control's value in the config that means "off" (configs/common.py)
CONTROLS_OFF = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                    no_repeat_ngram_size=0, min_new_tokens=0, bad_words_ids="", logit_bias="",
                    stop_strings="", logprobs=False, top_logprobs=0)


def _controls(config, names: tuple[str, ...]) -> dict:
  """The controls the config sets (docs/controls.md), as `mdjax.generate` takes them:
  `bad_words_ids` "5;7,8", `logit_bias` "13:2.0,42:-1", `stop_strings` a JSON list or one
  string; a value that means off is left out (a model's generation_config.json may
  then set it)."""
  given = {k: config[k] for k in CONTROL_OPTIONS
           if k in names and k in config and config[k] != CONTROLS_OFF[k]}
  if "bad_words_ids" in given:
    given["bad_words_ids"] = [_ids("bad_words_ids", word) for word in
                              given["bad_words_ids"].split(";")]
  if "logit_bias" in given:
    try:
      pairs = [item.split(":") for item in given["logit_bias"].split(",")]
      given["logit_bias"] = {int(token): float(bias) for token, bias in pairs}
    except ValueError:
      raise mdjax.MdjaxError("logit_bias must be id:bias pairs separated by commas, e.g. "
                             f"'13:2.0,42:-1', got {config.logit_bias!r}") from None
  if "stop_strings" in given and given["stop_strings"].lstrip().startswith("["):
    try:
      given["stop_strings"] = json.loads(given["stop_strings"])
    except json.JSONDecodeError as e:
      raise mdjax.MdjaxError(f"stop_strings is not a JSON list of strings: {e}") from None
  return given


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


def _headers(config, rows: int) -> list[str | None]:
  """The line printed above each answer (None: none)."""
  if config.strategy == "multi_question":
    return [f"--- Q{i + 1}: {q}" for i, q in enumerate(config.questions)]
  return [f"--- branch {i}" for i in range(rows)] if rows > 1 else [None]


def _print_as_written(model: mdjax.Model, config, prompt, common: dict, options: dict) -> None:
  """Prints every answer as `mdjax.stream` writes it, in order, each after its header:
  the first as it grows; once it is done, the next as far as it got, then as it grows."""
  live, texts, headers = 0, None, None
  for pieces in mdjax.stream(model, [prompt], strategy=config.strategy, text=True, **common,
                             **options):
    if texts is None:
      texts, headers = [""] * len(pieces), _headers(config, len(pieces))
      if headers[0] is not None:
        print(headers[0])
    texts = [text + piece for text, piece in zip(texts, pieces)]
    if live < len(pieces):
      print(pieces[live], end="", flush=True)
    while live < len(pieces) and pieces.done[live]:  # the next answer, as far as it got
      print()
      live += 1
      if live < len(pieces):
        if headers[live] is not None:
          print(headers[live])
        print(texts[live], end="", flush=True)


def decode(config, stream: bool | None = False) -> dict:
  """Loads the model, decodes, prints the text; returns the JSON summary. `config.strategy`
  names a strategy (one `mdjax.generate` call) or a pipeline (`mdjax.pipelines.run`).

  `stream`: first show the text as it is written (`_print_as_written`); None: when the
  run can, True: or fail."""
  pipeline = config.strategy in pipelines.PIPELINES
  names = (pipelines if pipeline else strategies).option_names(config.strategy)
  options = {k: config[k] for k in names if k in config and k not in CONTROL_OPTIONS}
  options |= _controls(config, names)
  if "questions" in options:
    options["questions"] = list(options["questions"])
  model = mdjax.load(config.model, dtype=config.dtype or None,
                     mesh=mdjax.sharding.mesh_from_spec(config.mesh),
                     quantize=config.quantize or None, quantize_group=config.quantize_group or None)
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
                seed=config.seed, **({"kv_cache_dtype": config.kv_cache_dtype}
                                     if config.kv_cache_dtype else {}))
  can_stream = (not pipeline and config.strategy != "skeleton_fill"
                and strategies.get(config.strategy).streams and model.tokenizer is not None)
  if stream and not can_stream:
    raise mdjax.MdjaxError(f"--stream: strategy {config.strategy!r} on {config.model!r} cannot "
                           "show its text as it is written (a pipeline, skeleton_fill, beam, or "
                           "a model without a tokenizer); run with --nostream")
  stream = stream is not False and can_stream
  if config.strategy == "multi_question":
    print(config.prompt)
  if stream:
    _print_as_written(model, config, prompt, common, options)
  if pipeline:
    out = pipelines.run(config.strategy, model, [prompt], **common, **options)
  else:
    out = mdjax.generate(model, [prompt], strategy=config.strategy, **common, **options)
  summary = dict(model=config.model, strategy=config.strategy, prompt_tokens=prompt_ids,
                 sequences=out.sequences, texts=out.texts, stats=out.stats)
  for field in ("logprobs", "top_logprobs"):  # with --config.logprobs / top_logprobs
    if getattr(out, field, None) is not None:
      summary[field] = getattr(out, field)
  if config.strategy == "skeleton_fill" and out.texts:  # the source with its bodies filled in
    print(skeleton.assemble(config.prompt, out.texts))
  elif config.strategy == "multi_question":
    if not stream:  # else shown as they were written
      for i, question in enumerate(config.questions):
        answer = out.texts[i] if out.texts else " ".join(map(str, out.sequences[i]))
        print(f"--- Q{i + 1}: {question}\n{answer}")
    if config.compare_sequential:
      questions = [encode_continuation(model, q) for q in options["questions"]]
      summary["one_after_another"] = _one_after_another(model, prompt_ids, questions, common,
                                                        out)
  elif not stream:
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
  stream = _STREAM.value
  if stream is None and not (sys.stdout.isatty() and jax.process_count() == 1):
    stream = False  # by default only where someone watches, and every process agrees
  text = json.dumps(decode(_CONFIG.value, stream=stream))
  if not _OUTPUT_JSON.value:
    print(text)
  elif distributed.is_main_process():
    files.write_text(_OUTPUT_JSON.value, text + "\n")
    print(f"--- summary (JSON): {_OUTPUT_JSON.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
