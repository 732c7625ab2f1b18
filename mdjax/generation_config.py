"""A model's own generation defaults: the settings of its checkpoint's
`generation_config.json` that mdjax knows, applied to a request as transformers applies
them: each is the default of a call, and an argument the caller passes wins.

    read(directory)    the file's settings (through transformers' `GenerationConfig`),
                       kept on the `Model` by `mdjax.load` (`Model.generation_defaults`)
    apply(...)         a request's options with those defaults filled in, and which
                       ones came from the file (`out.stats["generation_config"]`)

Which settings apply, and to which strategies:

    max_new_tokens, eos_token_id     to every request (`generate`'s own arguments; the
                                     file's EOS ids are also the model's own, as before)
    repetition_penalty, no_repeat_ngram_size, bad_words_ids, min_new_tokens,
    stop_strings                     to the strategies that honor that control
    temperature, top_k, top_p, min_p to the strategies that take the sampling options,
                                     when the request samples (below); never to "greedy"

transformers samples only when `do_sample` is true. In mdjax a strategy's name or the
caller's values say whether it samples: "sample" and "parallel_sample" sample (as
transformers' `do_sample=True` would; the file's values are how to sample this model,
whatever its `do_sample`), "greedy" never does, and a strategy that decodes greedily
unless a sampling value is set (`multi_question`, the speculative family, ...) samples
when the caller sets one or when the file's `do_sample` is true (then at temperature 1
unless the file sets one; the caller's temperature=0 keeps it greedy). An argument the
caller passes, even None (mdjax's own default: off), replaces the file's, as in
transformers' `generate(bad_words_ids=None)`. transformers' own library
defaults (top_k=50 when sampling, max_length=20) are not the model's and are not applied:
mdjax's stay (no top_k, 32 new tokens). A value that turns a control off
(repetition_penalty 1, no_repeat_ngram_size 0, min_new_tokens 0) is left out, and the
file's min_new_tokens is capped at the request's max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import numbers
import pathlib
from typing import Any

from mdjax.errors import CheckpointError, MdjaxError, check_count, check_real
from mdjax.sampling import SAMPLING_OPTIONS, SamplingParams

FILE = "generation_config.json"
DEFAULT_MAX_NEW_TOKENS = 32  # a request's budget when neither the caller nor the file sets one
# the controls (`mdjax.controls.CONTROL_OPTIONS`) transformers' GenerationConfig has too
# (presence and frequency penalties, logit_bias and log-probabilities it has not)
CONTROLS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_new_tokens",
            "stop_strings")
KNOWN = ("max_new_tokens", "eos_token_id", "do_sample") + CONTROLS + SAMPLING_OPTIONS
OFF = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0}


def read(directory: str | pathlib.Path) -> dict[str, Any]:
  """The settings of `directory`'s generation_config.json that mdjax knows (`KNOWN`),
  those the file sets, as transformers' `GenerationConfig.from_pretrained` reads it;
  {} without the file. A corrupt file or a bad value: a `CheckpointError` naming it."""
  file = pathlib.Path(directory) / FILE
  if not file.is_file():
    return {}
  import transformers  # only checkpoints with the file need it
  verbosity = transformers.logging.get_verbosity()
  # its warnings are about transformers' own use of the file (e.g. a temperature beside
  # do_sample=false, which mdjax's "sample" does use); stderr is for errors
  transformers.logging.set_verbosity_error()
  try:
    config = transformers.GenerationConfig.from_pretrained(str(directory))
  except Exception as e:  # noqa: BLE001 -- transformers raises many types for a bad file
    raise CheckpointError(f"corrupt {file}: {e}") from None
  finally:
    transformers.logging.set_verbosity(verbosity)
  found = {name: getattr(config, name, None) for name in KNOWN}
  found = {name: value for name, value in found.items()
           if value is not None and not (name in OFF and value == OFF[name])}
  try:
    _check(found)
  except MdjaxError as e:
    raise CheckpointError(f"{file}: {e}") from None
  return found


def _check(found: dict[str, Any]) -> None:
  """The values a request cannot check better (sampling values, counts, the penalty)."""
  SamplingParams(**{name: found[name] for name in SAMPLING_OPTIONS if name in found})
  for name in ("max_new_tokens", "min_new_tokens", "no_repeat_ngram_size"):
    if name in found:
      check_count(name, found[name], 0)
  penalty = found.get("repetition_penalty")
  if penalty is not None:
    check_real("repetition_penalty", penalty)
    if penalty <= 0:
      raise MdjaxError(f"repetition_penalty must be > 0 (1 is off), got {penalty!r}")
  if "do_sample" in found and not isinstance(found["do_sample"], bool):
    raise MdjaxError(f"do_sample must be true or false, got {found['do_sample']!r}")


def samples_unless_told(strategy_cls) -> bool:
  """Whether a strategy samples when no sampling value is given ("sample",
  "parallel_sample": temperature 1 unless set)."""
  field = {f.name: f for f in dataclasses.fields(strategy_cls)}.get("temperature")
  return (field is not None and field.init and field.metadata.get("option", True)
          and field.default not in (None, dataclasses.MISSING, 0))


@dataclasses.dataclass(frozen=True)
class Request:
  """A request's arguments with the model's defaults filled in."""

  options: dict[str, Any]
  max_new_tokens: Any
  from_file: dict[str, Any]  # the settings that came from the file, by name


def apply(defaults: dict[str, Any], strategy_cls, options: dict[str, Any], max_new_tokens,
          eos_token_id) -> Request:
  """`options` (the caller's keyword arguments: one given, even as None, is the
  caller's) and `max_new_tokens` (None: not given) with `defaults` (`read`'s) filled in
  for strategy `strategy_cls`, as the module docstring says. `eos_token_id` None takes
  the model's own EOS ids, which `mdjax.load` took from the file: listed as from it."""
  options, from_file = dict(options), {}
  if max_new_tokens is None:
    max_new_tokens = defaults.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if "max_new_tokens" in defaults:
      from_file["max_new_tokens"] = max_new_tokens
  if eos_token_id is None and "eos_token_id" in defaults:
    from_file["eos_token_id"] = defaults["eos_token_id"]
  takes = set(strategy_cls.options())
  for name in CONTROLS:
    if name in defaults and name in takes and name not in options:
      value = defaults[name]
      if name == "min_new_tokens" and isinstance(max_new_tokens, numbers.Integral):
        value = min(value, max_new_tokens)  # the request's budget wins
      options[name] = from_file[name] = value
  sampling = [name for name in SAMPLING_OPTIONS if name in takes]
  told = any(options.get(name) is not None for name in sampling)
  by_file = defaults.get("do_sample") is True and not told
  if sampling and (samples_unless_told(strategy_cls) or told or by_file):
    for name in sampling:
      if name in defaults and name not in options:
        options[name] = from_file[name] = defaults[name]
    if by_file and not samples_unless_told(strategy_cls):
      from_file["do_sample"] = True
      if "temperature" not in options and all(options.get(name) is None for name in sampling):
        options["temperature"] = 1.0  # sampling, as do_sample asks, at mdjax's temperature
  return Request(options=options, max_new_tokens=max_new_tokens, from_file=from_file)
