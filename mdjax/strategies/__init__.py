"""Decoding strategies, by the name `mdjax.generate` knows them."""

from __future__ import annotations

from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.sampling import SamplingParams
from mdjax.strategies.autoregressive import Autoregressive
from mdjax.strategies.lookup import PromptLookup

SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p")


def _greedy(config: ModelConfig, options: dict):
  return Autoregressive(config=config, sampling=SamplingParams(temperature=0.0), **options)


def _sample(config: ModelConfig, options: dict):
  sampling = {k: options.pop(k) for k in SAMPLING_OPTIONS if k in options}
  return Autoregressive(config=config, sampling=SamplingParams(**sampling), **options)


def _prompt_lookup(config: ModelConfig, options: dict):
  if "prompt_lookup_num_tokens" in options:
    options["num_tokens"] = options.pop("prompt_lookup_num_tokens")
  return PromptLookup(config=config, **options)


BUILDERS = {"greedy": (_greedy, ()), "sample": (_sample, SAMPLING_OPTIONS),
            "prompt_lookup": (_prompt_lookup, ("prompt_lookup_num_tokens", "max_ngram_size"))}
COMMON_OPTIONS = ("attention",)


def option_names(name: str) -> tuple[str, ...]:
  """The options (keyword arguments of `mdjax.generate`) strategy `name` takes."""
  if not isinstance(name, str) or name not in BUILDERS:
    raise MdjaxError(f"unknown strategy {name!r}; valid strategies: {', '.join(BUILDERS)}")
  return BUILDERS[name][1] + COMMON_OPTIONS


def build(name: str, config: ModelConfig, options: dict):
  """The strategy `name` for `config`, with its options validated."""
  allowed = option_names(name)
  for option in options:
    if option not in allowed:
      raise MdjaxError(f"unknown option {option!r} for strategy {name!r}; "
                       f"valid options: {', '.join(allowed)}")
  if options.get("attention", "block_sparse") not in ("block_sparse", "dense"):
    raise MdjaxError(f"attention must be 'block_sparse' or 'dense', got {options['attention']!r}")
  return BUILDERS[name][0](config, dict(options))
