r"""Head families as plug-ins: what one kind of heads is, by the name in `HeadsConfig.family`.

A family is one module that subclasses `HeadFamily` and decorates it with `@register`
(plus its import in `mdjax.heads`); everything else asks the registry (`get`) and
never compares a family's name::

    who asks                      what the family answers
    init_heads                    init(config, model_config, seed, dtype) -> params
    strategies (medusa, eagle)    strategies: which decode it; check(config, params, model);
                                  cache_config(config, model): its own KV cache, if any
    load_heads / export_heads     layouts: the public layouts (`mdjax.heads.formats`) it is
                                  read from and written to
    HeadsConfig                   owns_unembedding: may it carry its own lm_head
    train.heads                   target_layers(config): the target's hidden states it reads;
                                  window(config): tokens per training unit; sequential: one
                                  unrolled head or K parallel ones; loss(objective, ...): its
                                  training objective (`mdjax.heads.objective`); describe(config),
                                  step_label: the model card's words

Where the next kinds of heads plug in (none of them changes this interface):

- EAGLE-3 (`family="eagle3"`): its module registers `strategies=("eagle",)`, its
  `target_layers(config)` (a low, a middle and a high layer, saved in the config) for the
  trainer's feature cache and the strategy's verify pass, its `loss` (the training-time
  test: the head unrolled on its own predictions, `sequential=True`), its own lm_head
  (`owns_unembedding`) and `layouts=("eagle3", "speculators")`.
- A draft vocabulary, for any family: `HeadsConfig.draft_vocab_size` and an int32 `d2t`
  params leaf (saved with the heads by `save_heads` like any other leaf); a family whose
  `init` and `loss` read the unembedding slice it to those ids.
- More public layouts: one `formats.Layout` registered by name, and its name added to
  the family's `layouts`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from mdjax.errors import MdjaxError
from mdjax.heads import vocab

if TYPE_CHECKING:
  import jax
  from jaxtyping import Array, Float, Int

  from mdjax.cache import KVCache
  from mdjax.topology import Topology
  from mdjax.heads.base import Heads, HeadsConfig
  from mdjax.heads.objective import Objective
  from mdjax.models.config import ModelConfig
  from mdjax.models.transformer import Params


@dataclasses.dataclass(frozen=True)
class HeadFamily:
  """One kind of heads. A subclass declares the class variables and implements `init`,
  `describe` and `loss`; the other methods have defaults every family so far shares."""

  name: ClassVar[str]  # HeadsConfig.family
  strategies: ClassVar[tuple[str, ...]]  # the strategies that decode these heads
  layouts: ClassVar[tuple[str, ...]] = ()  # public layouts (`mdjax.heads.formats.LAYOUTS`)
  owns_unembedding: ClassVar[bool] = False  # may heads carry their own lm_head?
  sequential: ClassVar[bool] = False  # one head unrolled `unroll` steps (num_heads 1), or K
  #                                     parallel heads scored side by side
  step_label: ClassVar[str] = "head"  # what the card calls one row of top_accuracy
  draft_vocabulary: ClassVar[bool] = False  # can its heads score a draft vocabulary?

  def init(self, config: HeadsConfig, model_config: ModelConfig, seed: int, dtype) -> Params:
    """Untrained params of heads of `config` on a model of `model_config`."""
    raise NotImplementedError

  def check(self, heads: Heads, model_config: ModelConfig) -> None:
    """Raises `MdjaxError` naming what keeps `heads` from running on `model_config`:
    the config's `check_model`, and a draft vocabulary outside the model's."""
    heads.config.check_model(model_config)
    if "draft_ids" in heads.params:
      vocab.check(np.asarray(heads.params["draft_ids"]), model_config.vocab_size,
                  f"the heads {heads.name or heads.config.base_model!r}")

  def cache_config(self, config: HeadsConfig, model_config: ModelConfig) -> ModelConfig | None:
    """The config of the heads' own KV cache (`KVCache.create`); None: they keep none."""
    return None

  def target_layers(self, config: HeadsConfig) -> tuple[int, ...]:
    """The target layers whose hidden states the heads read; (): the final-norm state."""
    return ()

  def layers_for(self, model_config: ModelConfig) -> tuple[int, ...]:
    """The target layers new heads for a model of `model_config` read (what the trainer
    stores in `HeadsConfig.target_layers`); (): the final-norm state."""
    return ()

  def restrict(self, params: Params, draft_ids: jax.Array, model_params: Params) -> Params:
    """The trainer's initial params of heads that score only `draft_ids`
    (`mdjax.heads.vocab`; every id: the whole vocabulary): their own unembedding, if
    any, over those columns. Default: `params` as `init` made them."""
    return params

  def window(self, num_heads: int) -> int | None:
    """Tokens per training unit around one position; None: whole rows (heads that
    attend to the prefix)."""
    return None

  def draft_step(self, config: HeadsConfig, heads_params: Params, model_params: Params,
                 cache: KVCache, tokens: Int[Array, "B T"], features: Float[Array, "B T F"],
                 positions: Int[Array, "B T"], segments: Int[Array, "B T"], topology: Topology,
                 *, model_config: ModelConfig, attention: str,
                 logits_at: Int[Array, "B R"] | None = None
                 ) -> tuple[Float[Array, "B R V"], Float[Array, "B T D"], KVCache]:
    """One pass of a head that drafts one token at a time (`sequential`; the `eagle`
    strategy's draft pass) over its cache: the logits after the fed tokens (over the
    draft vocabulary when the heads have one), the feature each passes on, the cache."""
    raise MdjaxError(f"{self.name} heads do not draft one token at a time")

  def describe(self, config: HeadsConfig) -> str:
    """The model card's first words: "4 Medusa heads of 1 residual block(s)"."""
    raise NotImplementedError

  def loss(self, objective: Objective, params: Params, batch: dict, base: Params,
           ks: tuple[int, ...]) -> tuple[jax.Array, dict]:
    """(loss, {"hits": [depth, len(ks)] top-k hits, "count": [depth] targets}) of one
    batch (`mdjax.train.heads.Reader`); `base`: the model's embedding and lm_head."""
    raise NotImplementedError

  @property
  def strategy(self) -> str:
    """The strategy the model card shows."""
    return self.strategies[0]


FAMILIES: dict[str, HeadFamily] = {}


def register(cls: type[HeadFamily]) -> type[HeadFamily]:
  """Makes family `cls` known by its `name` (a class decorator)."""
  if not (isinstance(cls, type) and issubclass(cls, HeadFamily)):
    raise MdjaxError(f"{getattr(cls, '__name__', cls)!r} does not subclass HeadFamily")
  for attribute in ("name", "strategies"):
    if not hasattr(cls, attribute):
      raise MdjaxError(f"head family class {cls.__name__} does not declare its {attribute}")
  FAMILIES[cls.name] = cls()
  return cls


def get(name: str) -> HeadFamily:
  """The family registered as `name`."""
  if name not in FAMILIES:
    raise MdjaxError(f"unknown heads family {name!r}; supported: {', '.join(FAMILIES)}")
  return FAMILIES[name]


def decoded_by(strategy: str) -> tuple[str, ...]:
  """The families strategy `strategy` decodes."""
  return tuple(name for name, family in FAMILIES.items() if strategy in family.strategies)


def with_layout(layout: str) -> str:
  """The family public layout `layout` holds."""
  return next(name for name, family in FAMILIES.items() if layout in family.layouts)


def owning_unembeddings() -> tuple[str, ...]:
  """The families whose heads may carry their own lm_head."""
  return tuple(name for name, family in FAMILIES.items() if family.owns_unembedding)

