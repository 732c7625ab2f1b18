"""Multi-token-prediction heads as data: a config and a params pytree.

Heads are small networks over a frozen model's final-norm hidden states
(`mdjax.decode_step` returns them beside the logits) that guess tokens further
ahead than the next one; they share the model's unembedding (`lm_head`), so a
shipped set of heads is a few MB. A set of heads is plain data: a `HeadsConfig`
(static, hashable: strategies hold it as a jit argument) and a params pytree.

    family   params                                       predicts (fed hidden h_t)
    medusa   blocks: w [K, L, D, D], b [K, L, D]           head k: token t + 1 + k
             lm_head [K, D, V]  (own unembeddings only)   (k = 1..K; t + 1 is the model's)
    eagle    fc [2D, D], fc_bias [D], layers (decoder      the feature at t + 1, and the
             layers), final_norm [D] (see `mdjax.heads.   token after it via the lm_head
             eagle`; EAGLE-1 has no first attn_norm and
             no final_norm)
    mtp      layers (L decoder layers per head, leaves    head k: token t + 1 + k, reading
             stacked [K, ...]), final_norm [K, D] (see    h_0 .. h_t through its own
             `mdjax.heads.mtp`)                           attention (k = 1..K)

The registered families (`mdjax.heads.family`, `mdjax.heads.registry`) say what each family's params are,
how it trains and which strategy decodes it; `mdjax.heads.store` saves and loads heads,
`mdjax.heads.formats` reads and writes the public layouts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mdjax.errors import CheckpointError, MdjaxError, check_count
from mdjax.heads import registry
from mdjax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadsConfig:
  """What a set of heads is and which model it was trained on.

  `base_family`, `hidden_size` and `vocab_size` must match the model the heads run on
  (`check_model`); `base_model` names it (informational). `top_accuracy[k][j]` is head
  k's held-out accuracy of its top-(j + 1) guesses: Medusa builds its tree from it.
  `tree` is a calibrated Medusa tree (each node the path of top-k ranks from the root),
  None to build one from `top_accuracy` at run time.
  """

  family: str
  base_model: str
  base_family: str
  hidden_size: int
  vocab_size: int
  num_heads: int = 1  # medusa, mtp: K heads; eagle: 1 (it drafts autoregressively)
  num_layers: int = 1  # medusa: residual blocks per head; eagle: decoder layers; mtp: decoder
  #                      layers per head (1 in Gloeckle et al.)
  own_unembedding: bool = False  # medusa: each head has its own lm_head [D, V]
  top_accuracy: tuple[tuple[float, ...], ...] = ()
  tree: tuple[tuple[int, ...], ...] | None = None
  draft_vocab_size: int = 0  # heads that score only these many target ids (params
  #                            "draft_ids", `mdjax.heads.vocab`); 0: the whole vocabulary
  target_layers: tuple[int, ...] = ()  # the target layers the heads read (eagle3); (): the
  #                                      final-norm hidden state

  def __post_init__(self):
    kind = registry.get(self.family)
    for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
      check_count(f"heads {name}", getattr(self, name), 1)
    if self.own_unembedding and not kind.owns_unembedding:
      raise MdjaxError(f"only {' and '.join(registry.owning_unembeddings())} heads have their own "
                       f"unembedding; {self.family} heads share the model's (own_unembedding "
                       "must be False)")
    object.__setattr__(self, "top_accuracy", tuple(tuple(map(float, row))
                                                   for row in self.top_accuracy))
    if self.tree is not None:
      object.__setattr__(self, "tree", tuple(tuple(map(int, node)) for node in self.tree))
    check_count("heads draft_vocab_size", self.draft_vocab_size, 0)
    object.__setattr__(self, "target_layers", tuple(map(int, self.target_layers)))

  def check_model(self, config: ModelConfig) -> None:
    """Raises `MdjaxError` naming both sides when the heads cannot run on `config`."""
    for name, heads_value, model_value in (
        ("family", self.base_family, config.family),
        ("hidden size", self.hidden_size, config.hidden_size),
        ("vocabulary", self.vocab_size, config.vocab_size)):
      if heads_value != model_value:
        raise MdjaxError(f"the heads were trained on {self.base_model!r} ({name} {heads_value}) "
                         f"and cannot run on this model ({name} {model_value})")
    beyond = [layer for layer in self.target_layers if not 0 <= layer < config.num_layers]
    if beyond:
      raise MdjaxError(f"the heads read target layer {beyond[0]} (target_layers "
                       f"{list(self.target_layers)}), which this {config.num_layers}-layer model "
                       f"does not have: they were trained for another model ({self.base_model!r})")

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: dict) -> "HeadsConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
      raise CheckpointError(f"unknown heads config keys {unknown}; known: {sorted(known)}")
    return cls(**data)


@dataclasses.dataclass(frozen=True)
class Heads:
  """A set of heads: its config, its params pytree (jax arrays), its card text, the
  name it was loaded by and the directory it was read from (None: built in memory)."""

  config: HeadsConfig
  params: dict
  card: str = ""
  name: str = ""
  path: str | None = None

  def check_model(self, config: ModelConfig) -> None:
    """Raises `MdjaxError` naming what keeps the heads from running on `config`: their
    config's `check_model`, and whatever more their family checks (`HeadFamily.check`)."""
    registry.get(self.config.family).check(self, config)


def cast_floats(params, dtype):
  """`params` with every floating array cast to `dtype`."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      params)
