"""`speculative`: a small draft model proposes a chain, the target verifies it in one pass.

Each step the draft catches up on the tokens committed since its last pass
(`pending`: one, or two after a fully accepted chain; `drafting.catch_up`), then
proposes up to `max_draft_tokens` tokens, one draft pass each. The target scores
its last emitted token and the whole chain in one pass, and keeps a prefix of the
chain:

* greedy (temperature 0): the chain is the draft's argmax; the target keeps its own
  argmax up to and including the first disagreement, so the output is exactly the
  target's greedy decoding;
* sampling: the chain is sampled from the draft's processed distribution q; the
  speculative sampling rule (`mdjax.sampling.speculative_accept`) keeps each token
  with probability min(1, p/q) and resamples the first rejected one from
  norm(max(0, p - q)), so the output is distributed exactly as target sampling.
  The same processors (temperature, top-k, top-p, min-p) shape p and q.

Both caches roll back the rejected tail; rows accept different lengths::

    target feed   c  d0 d1 d2         target picks  d0 d1 x  .   -> emit d0 d1 x
    target cache  keeps c d0 d1       draft cache keeps pending + d0 d1 (d2 never fed)

How many tokens a row drafts (its `budget`, at most `max_draft_tokens`) is
`drafting.Schedule`'s: `num_draft_tokens` every step, or transformers' heuristic,
cut short by a `confidence_threshold`. The draft loop ends as soon as every row has
stopped; the target's pass runs on the whole `max_draft_tokens + 1` columns, half of
them or one, whichever holds the longest chain of the batch (`widths.decode_chains`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Int

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.strategies import drafting, prompt_layouts
from mdjax.strategies.base import Limits, ModelFn, Prompt
from mdjax.strategies.drafting import Chain, ChainState, DraftModelState
from mdjax.strategies.registry import register


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Speculative(drafting.ChainDrafter):
  """A draft model's chain of up to `max_draft_tokens`, verified in one target pass."""

  name: ClassVar[str] = "speculative"
  layout: ClassVar = prompt_layouts.Plain()

  draft: ModelFn | None = None  # `construct` turns the user's mdjax Model into its ModelFn
  num_draft_tokens: int = 4
  draft_schedule: str = "constant"
  max_draft_tokens: int = 0  # 0: num_draft_tokens (constant) or twice it (heuristic)
  confidence_threshold: float = 0.0
  return_metadata: bool = False  # per-token metadata (`mdjax.strategies.metadata`)

  def __post_init__(self):
    super().__post_init__()
    drafting.check_vocabulary(self.model, self.draft)

  @classmethod
  def construct(cls, target: ModelFn, model, options: dict) -> tuple["Speculative", dict]:
    return drafting.with_draft_model(cls, target, model, options)

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> ChainState:
    return drafting.start_chain(self.model, self.draft, params, prompt, cache, limits, capacity,
                                limits.sampling, self.schedule, self.return_metadata)

  def step(self, params, state: ChainState) -> ChainState:
    keys = drafting.step_keys(state)
    logits, draft_cache = drafting.catch_up(self.draft, params["draft"], state)
    chain = drafting.draft_chain(self.draft, params["draft"], draft_cache, logits, keys, state,
                                 self.schedule, state.limits.sampling)
    verified, accepted = drafting.verify_chain(self.model, params["target"], state, state.cache,
                                               keys, chain, self.schedule, state.limits.sampling)
    return dataclasses.replace(verified, draft=_draft_after(state, chain, accepted,
                                                            verified.last))


def _draft_after(before: ChainState, chain: Chain, accepted: Int[Array, "B"],
                 next_token: Int[Array, "B"]) -> DraftModelState:
  """The draft cache rolled back to pending + the accepted chain; what the draft has
  not seen yet (the next token, and chain[-1] after a full accept) is pending."""
  done, cached = before.buffer.done, before.draft.cache.length
  full = accepted == chain.length  # the draft never saw chain[length - 1]
  last_drafted = jnp.take_along_axis(chain.tokens, jnp.maximum(chain.length - 1, 0)[:, None],
                                     axis=1)[:, 0]
  keep = cached + before.draft.pending_count + jnp.minimum(accepted, chain.length - 1)
  return DraftModelState.behind(cache_ops.rollback(chain.cache, jnp.where(done, cached, keep)),
                                full, last_drafted, next_token)
