"""`Model`: an architecture, its weights and (optionally) its tokenizer."""

from __future__ import annotations

import dataclasses
from typing import Any

from mdjax.models.config import ModelConfig
from mdjax.models.transformer import Params


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
  config: ModelConfig
  params: Params
  tokenizer: Any = None  # a transformers tokenizer, or None
  path: str | None = None  # the directory it was loaded from
  name: str = ""  # what `mdjax.load` was given
  random_weights: bool = False  # seeded random weights, not a trained model
  layout: Any = None  # a `mdjax.sharding.WeightPlacement` when the weights lie on a device mesh
  quantization: str | None = None  # how its matrices are held (`mdjax.models.quantized`)
  # the settings of its checkpoint's generation_config.json that a request takes as its
  # defaults (`mdjax.generation_config`); {} without one
  generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def description(self) -> str:
    label = self.name or self.path or "model"
    if self.random_weights:
      label += " (RANDOM WEIGHTS: untrained, output is noise)"
    if self.quantization:
      label += f", {self.quantization}"
    return f"{label}: {self.config.family}, {self.config.num_params / 1e6:.1f}M params"
