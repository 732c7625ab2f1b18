"""A model soup: the weighted average of the weights of models of one shape.

Models continued from one another (one lineage, as the shipped target's stages are)
sit in one basin of the loss, and the average of their weights is often a better model
than any of them (Wortsman et al. 2022, "Model soups"):

    soup = w1 * stage_a + w2 * stage_b + ...      leaf by leaf, w_i > 0, sum w_i = 1

Averaging models trained from different random starts gives noise: their hidden units
are not aligned. Nothing here can check that; evaluate the soup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from mdjax.errors import MdjaxError
from mdjax.models.model import Model


def average(models: Sequence[Model], weights: Sequence[float] | None = None) -> Model:
  """The first model with every weight replaced by the `weights`-average (float32) of all
  models' (None: equal weights). Weights must be positive; they are normalized to sum 1."""
  if len(models) < 2:
    raise MdjaxError(f"a soup needs at least 2 models, got {len(models)}")
  weights = [1.0] * len(models) if weights is None else list(weights)
  if len(weights) != len(models):
    raise MdjaxError(f"{len(weights)} weights for {len(models)} models")
  if min(weights) <= 0:
    raise MdjaxError(f"soup weights must be > 0, got {weights}")
  first = models[0]
  for model in models[1:]:
    if model.config != first.config:
      differ = [f.name for f in dataclasses.fields(first.config)
                if getattr(model.config, f.name) != getattr(first.config, f.name)]
      raise MdjaxError(f"cannot average {model.name or model.path} with "
                       f"{first.name or first.path}: their configs differ in {', '.join(differ)}")
  total = sum(weights)

  def mix(*leaves):
    return sum(w / total * jnp.asarray(leaf, jnp.float32) for w, leaf in zip(weights, leaves))

  params = jax.tree.map(mix, *[model.params for model in models])
  return dataclasses.replace(first, params=params, path=None, name="soup")
