"""Decoding strategies, by the name `mdjax.generate` knows them."""

from __future__ import annotations

import numpy as np

from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.sampling import SamplingParams
from mdjax.strategies import margins, predict_user, reasoning
from mdjax.strategies.autoregressive import Autoregressive
from mdjax.strategies.beam import Beam
from mdjax.strategies.entropy import EntropyBranching
from mdjax.strategies.lookahead import Lookahead
from mdjax.strategies.lookup import PromptLookup
from mdjax.strategies.self_speculative import SelfSpeculative, draft_config, draft_params
from mdjax.strategies.speculative import Speculative
from mdjax.strategies.speculative_tree import SpeculativeTree

SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p")


def _greedy(config: ModelConfig, options: dict):
  return Autoregressive(config=config, sampling=SamplingParams(temperature=0.0), **options)


def _sample(config: ModelConfig, options: dict):
  return Autoregressive(config=config, sampling=_pop_sampling(options), **options)


def _pop_sampling(options: dict) -> SamplingParams:
  """Takes the sampling options out of `options`: greedy when there are none, else
  sampling (temperature 1 unless set)."""
  sampling = {k: options.pop(k) for k in SAMPLING_OPTIONS if k in options}
  return SamplingParams(**sampling) if sampling else SamplingParams(temperature=0.0)


def _greedy_unless_sampling(config: ModelConfig, options: dict):
  return Autoregressive(config=config, sampling=_pop_sampling(options), **options)


def _prompt_lookup(config: ModelConfig, options: dict):
  if "prompt_lookup_num_tokens" in options:
    options["num_tokens"] = options.pop("prompt_lookup_num_tokens")
  return PromptLookup(config=config, **options)


def _lookahead(config: ModelConfig, options: dict):
  return Lookahead(config=config, **options)


def _jacobi(config: ModelConfig, options: dict):
  """Jacobi decoding: lookahead's 2-gram case without a pool (`mdjax.strategies.lookahead`)."""
  return Lookahead(config=config, ngram=2, guess_set=0, **options)


def _speculative(config: ModelConfig, options: dict, name: str = "speculative",
                 strategy=Speculative):
  draft = options.pop("draft", None)
  if draft is None or not hasattr(draft, "config") or not hasattr(draft, "params"):
    raise MdjaxError(f"strategy {name!r} needs draft=<an mdjax Model>, got {draft!r}")
  return strategy(config=config, draft_config=draft.config, sampling=_pop_sampling(options),
                  **options)


def _speculative_tree(config: ModelConfig, options: dict):
  return _speculative(config, options, "speculative_tree", SpeculativeTree)


def _self_speculative(config: ModelConfig, options: dict):
  layers = options.pop("draft_layers", None)
  if layers is None:
    raise MdjaxError("strategy 'self_speculative' needs draft_layers=<how many of the target's "
                     f"{config.num_layers} layers draft>")
  return SelfSpeculative(config=config, draft_config=draft_config(config, layers),
                         sampling=_pop_sampling(options), **options)


def _beam(config: ModelConfig, options: dict):
  return Beam(config=config, **options)


BUILDERS = {"greedy": (_greedy, ()), "sample": (_sample, SAMPLING_OPTIONS),
            "beam": (_beam, ("num_beams", "length_penalty", "early_stopping")),
            "prompt_lookup": (_prompt_lookup, ("prompt_lookup_num_tokens", "max_ngram_size",
                                               "return_metadata")),
            "lookahead": (_lookahead, ("window", "ngram", "guess_set")),
            "jacobi": (_jacobi, ("window",)),
            "multi_question": (_greedy_unless_sampling, SAMPLING_OPTIONS),
            "parallel_sample": (_sample, SAMPLING_OPTIONS),
            "skeleton_fill": (_greedy_unless_sampling, SAMPLING_OPTIONS),
            "margin_notes": (_greedy_unless_sampling, SAMPLING_OPTIONS),
            "entropy_branching": (lambda config, options: EntropyBranching(config=config, **options),
                                  ("num_branches", "branch_tokens", "branch_entropy",
                                   "branch_varentropy")),
            "speculative": (_speculative, ("draft", "num_draft_tokens", "draft_schedule",
                                           "max_draft_tokens", "confidence_threshold",
                                           "return_metadata", *SAMPLING_OPTIONS)),
            "speculative_tree": (_speculative_tree, ("draft", "tree_depth", "tree_top_k",
                                                     "tree_budget", "return_metadata",
                                                     *SAMPLING_OPTIONS)),
            "self_speculative": (_self_speculative, ("draft_layers", "num_draft_tokens",
                                                     "draft_schedule", "max_draft_tokens",
                                                     "confidence_threshold", "return_metadata",
                                                     *SAMPLING_OPTIONS))}
# Strategies whose branches come from one required option (popped before `build`).
BRANCH_OPTIONS = {"multi_question": "questions", "parallel_sample": "num_samples",
                  "margin_notes": "instruction", "prompt_lookup": "questions"}
OPTIONAL_BRANCHES = ("prompt_lookup",)  # without the option: one plain branch per prompt
# Strategies whose prompt is a chain of chunks with a branch after each chunk
# (`base.layout_chains`); their branch option, if any, is text every branch appends.
CHAIN_LAYOUTS = ("skeleton_fill", "margin_notes")
COMMON_OPTIONS = ("attention",)


# Strategies that chain several `generate` calls, and their options.
PIPELINES = {"margins": margins, "reasoning": reasoning,  # modules: OPTIONS, run
             "predict_user": predict_user}


def option_names(name: str) -> tuple[str, ...]:
  """The options (keyword arguments of `mdjax.generate`) strategy `name` takes."""
  if not isinstance(name, str) or name not in BUILDERS | PIPELINES:
    raise MdjaxError(f"unknown strategy {name!r}; valid strategies: "
                     f"{', '.join(BUILDERS | PIPELINES)}")
  if name in PIPELINES:
    return PIPELINES[name].OPTIONS
  branch_option = (BRANCH_OPTIONS[name],) if name in BRANCH_OPTIONS else ()
  return BUILDERS[name][1] + branch_option + COMMON_OPTIONS


def check_options(name: str, options: dict) -> None:
  """Rejects an option strategy `name` does not take (or its branch option, which
  must have been taken out of `options`)."""
  allowed = option_names(name)
  for option in options:
    if option not in allowed or option == BRANCH_OPTIONS.get(name):
      raise MdjaxError(f"unknown option {option!r} for strategy {name!r}; "
                       f"valid options: {', '.join(allowed)}")


def build(name: str, config: ModelConfig, options: dict):
  """The strategy `name` for `config`, with its options validated; its branch
  option (see `branches`) must have been taken out of `options`."""
  check_options(name, options)
  if options.get("attention", "block_sparse") not in ("block_sparse", "dense"):
    raise MdjaxError(f"attention must be 'block_sparse' or 'dense', got {options['attention']!r}")
  return BUILDERS[name][0](config, dict(options))


def branches(name: str, value, num_prompts: int, encode) -> list[list[list[int]]] | None:
  """Per prompt, the token lists its branches append after it (None: one plain branch).

  multi_question (and prompt_lookup, optionally): `questions` is one list of questions
  for every prompt or one such list per prompt (a question is text or token ids;
  `encode(list) -> ids`).
  parallel_sample: `num_samples` empty branches per prompt, sampled independently.
  """
  if name not in BRANCH_OPTIONS:
    return None
  option = BRANCH_OPTIONS[name]
  if value is None and name in OPTIONAL_BRANCHES:
    return None
  if value is None:
    raise MdjaxError(f"strategy {name!r} needs the option {option!r}")
  if name == "parallel_sample":
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise MdjaxError(f"num_samples must be an integer >= 1, got {value!r}")
    return [[[] for _ in range(value)] for _ in range(num_prompts)]
  per_prompt = (isinstance(value, (list, tuple)) and value and  # not a question as ids
                all(isinstance(q, (list, tuple)) and q and not isinstance(q[0], (int, np.integer))
                    for q in value))
  lists = list(value) if per_prompt else [value] * num_prompts
  if len(lists) != num_prompts:
    raise MdjaxError(f"questions has {len(lists)} lists for {num_prompts} prompts")
  result = []
  for i, questions in enumerate(lists):
    if not isinstance(questions, (list, tuple)) or not questions:
      raise MdjaxError(f"prompt {i} needs at least one question, got {questions!r}")
    result.append([_question(encode, q, i, j) for j, q in enumerate(questions)])
  return result


def _question(encode, question, prompt: int, index: int) -> list[int]:
  try:
    (ids,) = encode([question])
  except MdjaxError as e:
    raise MdjaxError(f"question {index} of prompt {prompt}: {e}") from None
  return ids


def run_params(name: str, params, options: dict):
  """The params pytree strategy `name` runs on: the model's, or target and draft's."""
  if name in ("speculative", "speculative_tree"):
    return {"target": params, "draft": options["draft"].params}
  if name == "self_speculative":
    return {"target": params, "draft": draft_params(params, options["draft_layers"])}
  return params
