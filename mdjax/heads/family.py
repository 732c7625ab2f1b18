r"""Head families as plug-ins: what one kind of heads is, by the name in `HeadsConfig.family`.

A family is one module that subclasses `HeadFamily` and decorates it with `@register`
(plus its import in `mdjax.heads`); its params, their initialisation and their forward
are a Flax NNX module of the same file (`mdjax.heads.module`). Everything else asks the
registry (`mdjax.heads.registry.get`) and never compares a family's name::

    who asks                      what the family answers
    init_heads                    init(config, model_config, seed, dtype) -> params
    strategies (medusa, eagle)    strategies: which decode it; check(heads, model_config);
                                  cache_config(config, model_config): its own KV cache, if any;
                                  guesser(...): how parallel heads draft (`Guess`);
                                  first_heads(params, n); draft_step(...): one pass of a
                                  head that drafts one token at a time
    load_heads / export_heads     the public layouts that hold it (`mdjax.heads.formats`,
                                  each `CheckpointFormat` naming its family)
    HeadsConfig                   owns_unembedding: may it carry its own lm_head
    train.heads                   target_layers(config): the target's hidden states it reads;
                                  layers_for(model_config); window(num_heads): tokens per
                                  training unit; sequential: one unrolled head or K parallel
                                  ones; restrict(...); loss(objective, ...): its training
                                  objective (`mdjax.heads.objective`); describe(config),
                                  step_label: the model card's words

A new family costs one module (its NNX module, its `HeadFamily`, and its `Guess` or
`draft_step`), its import in `mdjax.heads`, and, for files other projects publish, one
`mdjax.heads.formats` module registering its `CheckpointFormat`s.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import jax
import numpy as np

from mdjax.errors import MdjaxError
from mdjax.heads import registry, vocab

if TYPE_CHECKING:
  from jaxtyping import Array, Float, Int

  from mdjax.cache import KVCache
  from mdjax.heads.base import Heads, HeadsConfig
  from mdjax.heads.objective import Objective
  from mdjax.models.config import ModelConfig
  from mdjax.models.transformer import Params


SHARED_LEAVES = ("draft_ids", "draft_unembedding")  # params of parallel heads not stacked per head


@dataclasses.dataclass(frozen=True)
class Feed:
  """Where fed tokens sit: their positions and segments (-1: padding) and the rows'
  topology, as `mdjax.decode_step` takes them."""

  positions: Int[Array, "B T"]
  segments: Int[Array, "B T"]
  topology: Topology


class Guess(Protocol):
  """How parallel heads draft (`HeadFamily.guesser`), step after step: `read` is what
  they guess the next tree from (an array or a pytree of the family's), R = B x N rows
  (one per branch), K the heads used. `params`: `{"target": ..., "heads": ...}`."""

  passes: ClassVar[int]  # head passes per step besides the target's

  def start(self, params, hidden: Float[Array, "B P H"], last: Int[Array, "B N"], feed: Feed,
            slots: int, cache_dtype) -> Any:
    """What to read after the prefill: `hidden` the target's states at the prompt's
    tokens (fed as `feed`), `last` each branch's last prompt token; a cache of the
    heads' own gets `slots` slots of `cache_dtype`."""

  def logits(self, params, read) -> Float[Array, "R K V"]:
    """Each head's logits of the token it guesses (over the draft vocabulary, if any)."""

  def advance(self, params, read, hidden: Float[Array, "R D+1 H"], accepted: Int[Array, "R"],
              feed: Feed) -> Any:
    """What to read after a verify that committed, per row, `c` and the first
    `accepted` nodes of its path: `hidden` the target's states there (fed as `feed`,
    `[R, 1 + D]`, segment -1 past the committed ones)."""


@dataclasses.dataclass(frozen=True)
class HeadFamily:
  """One kind of heads. A subclass declares the class variables and implements `init`,
  `describe` and `loss`; the other methods have defaults every family so far shares."""

  name: ClassVar[str]  # HeadsConfig.family
  strategies: ClassVar[tuple[str, ...]]  # the strategies that decode these heads
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

  def restrict(self, params: Params, draft_ids: jax.Array, target_params: Params) -> Params:
    """The trainer's initial params of heads that score only `draft_ids`
    (`mdjax.heads.vocab`; every id: the whole vocabulary): their own unembedding, if
    any, over those columns. Default: `params` as `init` made them."""
    return params

  def window(self, num_heads: int) -> int | None:
    """Tokens per training unit around one position; None: whole rows (heads that
    attend to the prefix)."""
    return None

  def guesser(self, config: HeadsConfig, model_config: ModelConfig, attention: str,
              num_heads: int) -> Guess:
    """How the first `num_heads` parallel heads of `config` draft a tree's tokens (the
    `medusa` strategy's guesses), on a target of `model_config`."""
    raise MdjaxError(f"{self.name} heads do not guess tokens side by side")

  def first_heads(self, params: Params, count: int) -> Params:
    """The params of the first `count` of parallel heads: every leaf is stacked per
    head but a draft vocabulary's (`SHARED_LEAVES`), which every head shares."""
    return {name: value if name in SHARED_LEAVES else jax.tree.map(lambda a: a[:count], value)
            for name, value in params.items()}

  def draft_step(self, config: HeadsConfig, heads_params: Params, target_params: Params,
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

  def loss(self, objective: Objective, params: Params, batch: dict, target: Params,
           ks: tuple[int, ...]) -> tuple[jax.Array, dict]:
    """(loss, {"hits": [depth, len(ks)] top-k hits, "count": [depth] targets}) of one
    batch (`mdjax.train.heads.batches.Reader`); `target`: the frozen target's embedding and
    lm_head (and a draft vocabulary's `draft_ids`, `draft_unembedding`)."""
    raise NotImplementedError

  @property
  def strategy(self) -> str:
    """The strategy the model card shows."""
    return self.strategies[0]


def register(cls: type[HeadFamily]) -> type[HeadFamily]:
  """Makes family `cls` known by its `name` (a class decorator; `mdjax.heads.registry`)."""
  if not (isinstance(cls, type) and issubclass(cls, HeadFamily)):
    raise MdjaxError(f"{getattr(cls, '__name__', cls)!r} does not subclass HeadFamily")
  for attribute in ("name", "strategies"):
    if not hasattr(cls, attribute):
      raise MdjaxError(f"head family class {cls.__name__} does not declare its {attribute}")
  registry.FAMILIES[cls.name] = cls()
  return cls
