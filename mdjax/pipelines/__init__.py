"""Pipelines: programs of several `mdjax.generate` calls, a layer above it.

    out = mdjax.pipelines.run("margins", model, [long_text], question="...")

Each pipeline declares its name and options once, in its dataclass
(`mdjax.pipelines.base.Pipeline`); registering it is one entry in `PIPELINES`.
"""

from __future__ import annotations

from mdjax import errors
from mdjax.errors import MdjaxError
from mdjax.generate import GenerationOutput
from mdjax.models.model import Model
from mdjax.pipelines.base import Pipeline
from mdjax.pipelines.margins import Margins
from mdjax.pipelines.predict_user import PredictUser
from mdjax.pipelines.reasoning import Reasoning

PIPELINES: dict[str, type[Pipeline]] = {cls.name: cls for cls in (Margins, Reasoning, PredictUser)}


def get(name: str) -> type[Pipeline]:
  """The pipeline class registered as `name`."""
  if not isinstance(name, str) or name not in PIPELINES:
    raise MdjaxError(f"unknown pipeline {name!r}; valid pipelines: {', '.join(PIPELINES)}")
  return PIPELINES[name]


def option_names(name: str) -> tuple[str, ...]:
  """The options (keyword arguments of `run`) pipeline `name` takes."""
  return get(name).options()


def run(name: str, model: Model, prompts, *, max_new_tokens: int = 32, eos_token_id=None,
        seed: int = 0, **options) -> GenerationOutput:
  """Runs pipeline `name` on one prompt or a batch; `max_new_tokens`, `eos_token_id`
  and `seed` mean what they mean in `mdjax.generate` (`max_new_tokens` bounds the
  final phase), `options` are the pipeline's."""
  # "strategy": the word these errors have always used
  errors.check_options("strategy", name, options, option_names(name))
  return get(name)(**options).run(model, prompts, max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_token_id, seed=seed)
