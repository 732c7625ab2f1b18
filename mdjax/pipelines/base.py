"""What every pipeline shares: its options declared once, as dataclass fields.

A pipeline is a frozen dataclass whose init fields are its options, validated in
`__post_init__`; its `run` makes several `generate` calls through the public API,
like any user would, but imported from the modules that define it (the package
`mdjax` imports the pipelines)::

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MyPipeline(Pipeline):
      name: ClassVar[str] = "my_pipeline"   # what `mdjax.pipelines.run` calls it
      rounds: int = 2                       # an option

      def run(self, model, prompts, *, max_new_tokens, eos_token_id, seed):
        ...                                 # mdjax.generate(...) calls
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from mdjax.errors import MdjaxError
from mdjax.generate import GenerationOutput
from mdjax.models.model import Model
from mdjax.sampling import SAMPLING_OPTIONS

# The stats that add up over a pipeline's `generate` calls.
SUMMED_STATS = ("target_passes", "generated_tokens", "prompt_tokens", "wall_s", "compile_s")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipeline:
  """The base of every pipeline: see the module docstring."""

  name: ClassVar[str]

  @classmethod
  def options(cls) -> tuple[str, ...]:
    """The keyword arguments `mdjax.pipelines.run` accepts for this pipeline."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)

  def run(self, model: Model, prompts, *, max_new_tokens: int, eos_token_id,
          seed: int) -> GenerationOutput:
    """Every phase for every prompt; the arguments mean what they mean in `generate`."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampled(Pipeline):
  """A pipeline that hands the sampling options to its sampling phases."""

  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None
  min_p: float | None = None

  @classmethod
  def options(cls) -> tuple[str, ...]:
    """The pipeline's own options, then the sampling ones (the order errors list them in)."""
    own = tuple(name for name in super().options() if name not in SAMPLING_OPTIONS)
    return own + SAMPLING_OPTIONS

  @property
  def sampling(self) -> dict:
    """The sampling options that were given (None: not given), as `generate` arguments."""
    return {name: getattr(self, name) for name in SAMPLING_OPTIONS
            if getattr(self, name) is not None}


def regex(option: str, pattern: str) -> re.Pattern:
  """`pattern` compiled, or an `MdjaxError` naming `option`."""
  try:
    return re.compile(pattern)
  except re.error as e:
    raise MdjaxError(f"{option} {pattern!r} is not a regular expression: {e}") from None


def add_stats(out: GenerationOutput, *earlier: GenerationOutput) -> None:
  """Adds the passes, tokens and times of the `earlier` phases into `out.stats`."""
  for key in SUMMED_STATS:
    out.stats[key] += sum(phase.stats[key] for phase in earlier)
