"""Head families as Flax NNX modules whose state is exactly their params pytree.

A family's module (`MedusaHeads`, `EagleHead`, `Eagle3Head`, `MtpHeads`) holds its
params, builds untrained ones (`init`) and runs them (`__call__`). Its state is the
plain pytree that heads files, optax, orbax and the jitted decode programs use, key for
key::

    pure params (a Heads' params)        the module's state (`nnx.split` / `nnx.state`)
    {"blocks": {"w": [K, L, D, D], ...}  MedusaHeads(...).blocks: nnx.Dict of nnx.Param
    {"layers": [{...}, ...], ...}        .layers: nnx.List of nnx.Dict
    draft_ids int32 [V_d]                an `nnx.Variable` (data, not trained)

`hold` builds a module's state from the pytree (a family's `__init__` takes it, so a
jitted function builds the module from its pytree argument and calls it) and
`params_of` gives the pytree back: the two are inverse.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mdjax.models.transformer import Params


def variables(tree):
  """`tree` (dicts, lists, arrays) as NNX containers: floating arrays are `nnx.Param`
  (trained), other arrays plain `nnx.Variable`s (a draft vocabulary's ids)."""
  if isinstance(tree, dict):
    return nnx.Dict({name: variables(value) for name, value in tree.items()})
  if isinstance(tree, (list, tuple)):
    return nnx.List([variables(value) for value in tree])
  return nnx.Param(tree) if jnp.issubdtype(jnp.result_type(tree), jnp.floating) else (
      nnx.Variable(tree))


def hold(module: nnx.Module, params: Params) -> None:
  """Makes each top-level entry of `params` an attribute of `module` (`variables`)."""
  for name, value in params.items():
    setattr(module, name, variables(value))


def params_of(module: nnx.Module) -> Params:
  """The module's state as the pure params pytree `hold` took (lists as lists)."""
  return _listed(nnx.to_pure_dict(nnx.state(module)))


def _listed(tree):
  """`nnx.to_pure_dict`'s integer-keyed dicts (from `nnx.List`) back as lists."""
  if not isinstance(tree, dict):
    return tree
  if tree and all(isinstance(key, int) for key in tree):
    return [_listed(tree[i]) for i in range(len(tree))]
  return {name: _listed(value) for name, value in tree.items()}

