"""The decoder layers heads are built of: the model's own layer type, so that heads run
at explicit positions and segments like the model does (EAGLE's layer, MTP's heads)."""

from __future__ import annotations

import dataclasses

from mdjax.models.config import ModelConfig


def decoder_config(model_config: ModelConfig, num_layers: int) -> ModelConfig:
  """The model's layer type, `num_layers` deep, full attention."""
  layer_types = None if model_config.layer_types is None else ("full_attention",) * num_layers
  return dataclasses.replace(model_config, num_layers=num_layers, layer_types=layer_types)
