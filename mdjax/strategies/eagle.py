r"""`eagle`: an EAGLE head (`mdjax.heads.eagle`, or EAGLE-3's, `mdjax.heads.eagle3`)
drafts a token tree (EAGLE-2), the target verifies every node in one pass, the
accepted path is compacted. The head is its family's (`HeadFamily.draft_step`, over
the cache of its `cache_config`); this strategy names no family.

Options: `heads` (an `mdjax.Heads` of a family it decodes, required), `tree_depth` D,
`tree_top_k` K, `tree_budget` M (default "auto": chosen with D and K by what a pass
costs here and the heads' `top_accuracy` per step, `mdjax.strategies.tree_choice`),
the sampling options and `return_metadata`: the trees of `speculative_tree` (its
`TreeDrafter` drafts, keeps, verifies and commits them), drafted by the head instead
of a draft model.

The head reads, with each token x_t, a feature f_t: the target's final-norm hidden
state at t - 1 (h_{t-1}) for committed text, its own predicted feature (f̂) for the
tokens it drafts. It runs over its own one-layer KV cache, which holds the committed
text only, each token fed with the target's feature. Prefill: the prompt's tokens
with the target's prefill hidden states shifted by one (zeros at position 0); the
target's first token x is pending, with the hidden state of the last prompt token.

Drafting, with `c` the last emitted token (at `next_pos`) and `<c` the token before it::

    catch-up   pending ... c   features ... h_<c        -> f̂_c   level 1: a b
    pass 2     a b  (segments 1 2)  features f̂_c f̂_c    -> f̂_a f̂_b   level 2: d e | f f'
    pass 3     d e  (segments 3 4, under a)  f̂_a f̂_a   -> level 3: g g' | h h'
    kept       the best M by cumulative log-probability    (`speculative_tree`)

Level 1 comes from the catch-up pass's logits at `c`; a node's feature is the one
its parent's pass predicted (f̂_a for both children of a). After the verify (say `a`
then `d` accepted, `x` the target's token after `d`), the head drops every node it
was fed (rollback to its caught-up length) and catches up next step on the newly
committed tokens, each with the target's hidden state at the token before it
(`trees.Verified.hidden` at `c` and along the path)::

    target cache  ... c  a  d          hidden  h_c  h_a  h_d
    head cache    ... c                (c was fed in this step's catch-up, with h_<c)
    pending       a  d  x              features  h_c  h_a  h_d     count 1 + accepted

Greedy: exactly the target's greedy tokens, whatever the head; sampling follows the
target's law by the tree rule (`mdjax.sampling.tree_accept`: the children are
deterministic top-k). Statistics as `speculative_tree`: `draft_passes` = D per
step (the catch-up and D - 1 tree levels).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from mdjax import cache as cache_ops
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError
from mdjax.heads import Heads, HeadsConfig, get_family
from mdjax.heads.registry import decoded_by
from mdjax.strategies import drafting, prompt_layouts, tree_choice
from mdjax.strategies.base import Limits, ModelFn, Prompt, prefill_with_hidden
from mdjax.strategies.drafting import DraftState
from mdjax.strategies.registry import register
from mdjax.strategies.speculative_tree import DraftPass, TreeDrafter
from mdjax.strategies.trees import Verified


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadState:
  """The EAGLE head's own cache and the committed tokens it has not been fed
  (D = tree_depth, H = the hidden size).

    cache          KVCache [B]         the head's (its family's `cache_config`): the prompt,
                                       then every emitted token before the pending ones
    pending        int32[B, 1 + D]     its first `pending_count` tokens are those not
                                       fed yet: the accepted nodes, then the last
                                       emitted token (the target's)
    features       float[B, 1 + D, H]  each pending token's feature: the target's
                                       hidden state at the token before it
    pending_count  int32[B]            1 + the nodes accepted last step (1 after prefill)
  """

  cache: KVCache
  pending: Int[Array, "B D+1"]
  features: Float[Array, "B D+1 H"]
  pending_count: Int[Array, "B"]

  @classmethod
  def after(cls, verified: Verified, cache: KVCache) -> "HeadState":
    """After a verify: `cache` holds what the head keeps (the committed text up to
    `c`); the accepted nodes and the target's token are pending, each with the
    target's hidden state at the fed column before it (`c`, then the path)."""
    return cls(cache=cache, pending=verified.emitted, features=verified.hidden_on_path(),
               pending_count=verified.accepted + 1)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle(TreeDrafter):
  """An EAGLE head's token tree of `tree_budget` nodes, verified in one target pass."""

  name: ClassVar[str] = "eagle"
  layout: ClassVar = prompt_layouts.Plain()

  heads: HeadsConfig | None = None  # `construct` turns the user's `mdjax.Heads` into its config

  def __post_init__(self):
    if not isinstance(self.heads, HeadsConfig) or self.heads.family not in decoded_by(self.name):
      got = (f"{self.heads.family} heads trained on {self.heads.base_model!r}"
             if isinstance(self.heads, HeadsConfig) else repr(self.heads))
      wanted = " or ".join(map(repr, decoded_by(self.name)))
      raise MdjaxError(f"strategy 'eagle' needs heads of family {wanted}, got {got}")
    self.heads.check_model(self.model.config)
    super().__post_init__()

  @classmethod
  def construct(cls, target: ModelFn, model, options: dict) -> tuple["Eagle", dict]:
    """The strategy with the heads' config as a static field; params `{"target": the
    model's, "heads": the heads'}`."""
    options = dict(options)
    heads = options.pop("heads", None)
    if not isinstance(heads, Heads):
      got = "None" if heads is None else f"a {type(heads).__name__}"
      wanted = " or ".join(map(repr, decoded_by(cls.name)))
      raise MdjaxError(f"strategy 'eagle' needs heads=<an mdjax.Heads of family {wanted}> "
                       f"(mdjax.load_heads), got {got}")
    reads = get_family(heads.config.family).target_layers(heads.config)  # (): the final norm
    return (cls(model=dataclasses.replace(target, hidden_layers=reads), heads=heads.config,
                **options), {"target": model.params, "heads": heads.params})

  @property
  def acceptance(self) -> tuple[tuple[float, ...], ...]:
    """The heads' held-out top-k accuracy per unrolled step, else the default."""
    return self.heads.top_accuracy or tree_choice.DRAFT_ACCURACY

  def draft_fraction(self, params) -> float:
    return tree_choice.heads_fraction(params["heads"], params["target"])

  def catch_up_width(self, depth: int) -> int:
    return 1 + depth  # `HeadState.pending`

  def head_pass_of(self, params) -> DraftPass:
    """The head as a draft pass: features in, (logits, predicted features, cache) out."""
    kind = get_family(self.heads.family)

    def head_pass(cache, tokens, positions, segments, topology, features, logits_at=None):
      return kind.draft_step(self.heads, params["heads"], params["target"], cache, tokens,
                             features, positions, segments, topology,
                             model_config=self.model.config, attention=self.model.attention,
                             logits_at=logits_at)
    return head_pass

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> DraftState:
    """The target's prefill (its hidden states kept), its first token, and the head's
    prefill: the prompt with the target's hidden states shifted by one."""
    batch = prompt.tokens.shape[0]
    logits, hidden, target_cache, topology = prefill_with_hidden(
        self.model, params["target"], prompt, cache)  # [B, 1, V], [B, P, H]
    state = drafting.start(DraftState, self.model, None, params, prompt, cache, limits, capacity,
                           limits.sampling, positions=self.tree_depth,
                           return_metadata=self.return_metadata,
                           prefilled=(logits, target_cache, topology))
    head_config = get_family(self.heads.family).cache_config(self.heads, self.model.config)
    head_cache = KVCache.create(head_config, batch, target_cache.num_slots, target_cache.dtype)
    shifted = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))  # [B, P, H] h_{t-1}, 0 at t = 0
    _, _, head_cache = self.head_pass_of(params)(
        head_cache, prompt.tokens, prompt.positions, prompt.segments, topology, shifted,
        logits_at=jnp.zeros((batch, 0), jnp.int32))  # no logits: only the cache is wanted
    last_hidden = jnp.take_along_axis(hidden, prompt.branch_last[:, :1, None], axis=1)  # [B, 1, H]
    width = (batch, 1 + self.tree_depth)
    return dataclasses.replace(state, draft=HeadState(
        cache=head_cache, pending=jnp.zeros(width, jnp.int32).at[:, 0].set(state.last),
        features=jnp.zeros((*width, hidden.shape[-1]), hidden.dtype).at[:, :1].set(last_hidden),
        pending_count=jnp.ones((batch,), jnp.int32)))

  def catch_up_head(self, head_pass: DraftPass, state: DraftState
                    ) -> tuple[Float[Array, "B V"], Float[Array, "B H"], KVCache]:
    """One head pass over the pending tokens: its logits after the last emitted token
    `c`, the feature it predicts there (level 1's), and its cache holding everything
    emitted so far."""
    head = state.draft
    positions, segments = drafting.pending_feed(state)
    last = (head.pending_count - 1)[:, None]  # [B, 1] the column of `c`
    logits, features, cache = head_pass(head.cache, head.pending, positions, segments,
                                        state.topology, head.features,
                                        logits_at=last)  # [B, 1, V], [B, 1 + D, H]
    return logits[:, 0], jnp.take_along_axis(features, last[..., None], axis=1)[:, 0], cache

  def step(self, params, state: DraftState) -> DraftState:
    head_pass = self.head_pass_of(params)
    logits, feature, head_cache = self.catch_up_head(head_pass, state)
    front_features = jnp.broadcast_to(feature[:, None], (feature.shape[0], self.tree_top_k,
                                                          feature.shape[1]))  # [B, K, H]
    state, verified, drafted, _ = self._tree_step(params["target"], state, head_pass, logits,
                                                  head_cache, front_features,
                                                  draft_ids=params["heads"].get("draft_ids"))
    return dataclasses.replace(state, draft=HeadState.after(
        verified, cache_ops.rollback(drafted.cache, head_cache.length)))
