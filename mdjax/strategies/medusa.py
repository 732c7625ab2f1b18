r"""`medusa` and `blockwise`: heads guess the tokens after the next one from the
target's hidden state, and the target verifies their guesses as a tree in one pass.

Medusa (Cai et al. 2024) puts K heads on the target's final-norm hidden state
(`mdjax.heads.medusa`): from h_t, head k guesses token t + 1 + k, the target's own
head token t + 1. Each step, the last verify left `x` (the target's token, emitted,
not yet cached) and h, the target's hidden state at the token before `x`; the heads
read h, and a static sparse tree (`mdjax.heads.tree`: each node a path of ranks,
depth d = head d's guesses) picks which of their top-k guesses to verify. With the
tree ((0,), (1,), (0, 0), (0, 1), (0, 0, 0)) and K = 3::

    heads(h)      head 1 top-2: a a'    head 2 top-2: b b'    head 3 top-1: d

                  x               node   a   a'  b   b'  d     (tree order)
                /   \             parent -1  -1  0   0   2
               a     a'           depth  1   1   2   2   3
              / \
             b   b'
             |
             d

One target pass feeds `x` and the nodes, each node its own segment seeing the
committed text and its ancestors (`mdjax.strategies.trees`, which draws the mask),
and accepts a path: greedy keeps the child equal to the target's argmax, so the
output is exactly greedy decoding's; sampling uses the multi-candidate rule
(`mdjax.sampling.tree_accept`), lossless because the heads' top-k is a fixed set of
candidates. Say `a b` are kept and the target's token after `b` is `y`: emit
`a b y`; the target's hidden state at `b` is what the heads read next step::

    cache   ... | x a b            (a' b' d dropped and compacted away)
    next    heads(h at b) guess the tokens after y; the target feeds y first

The hidden state of the first step is the prefill's, at the last prompt token.

With branches (`questions=`, as `multi_question`), every branch grows its own tree
under its own last token, in its own segment: all trees of all branches of a row
are verified in the same pass, each branch keeps its own path (`trees.verify`).
Context in segment 0, two questions (segments 1, 2), a tree of M = 5 nodes::

    feed     x1 a1 a1' b1 b1' d1 | x2 a2 a2' b2 b2' d2     one pass, 2 x (1 + M) tokens
    seg      1  3  4   5  6   7  | 2  8  9   10 11  12     nodes after the prompt's 3
    parent   (x1: question 1's)  | (x2: question 2's)      a, a' under x; b, b' under a ...

`acceptance="typical"` is Medusa's typical acceptance, LOSSY (the output no longer
follows the target's law; it needs sampling options): a node is accepted when the
target gives its token, after its parent, more than min(typical_epsilon,
typical_delta * exp(-H)), H the entropy of that distribution; of the nodes whose
whole path is accepted, the deepest wins (ties: the first in tree order), and the
next token is sampled from the target's distribution after it (`typical_accept`).

Blockwise parallel decoding (Stern et al. 2018) is the special case of one chain,
x then head 1's top-1, head 2's top-1, ...: `strategy="blockwise"` (`Blockwise`)
verifies the longest prefix of that block the target agrees with.

Options: `heads` (an `mdjax.Heads` of the medusa family, required), `questions`
(optional, as `multi_question`), `num_heads` (use the first n; 0: all),
`tree_budget` (nodes; 0: the heads' calibrated tree when they carry one, else a tree
of `DEFAULT_BUDGET` nodes built from their measured top-k accuracies, or from
`mdjax.heads.tree.default_accuracy` when they carry none), `tree` (explicit rank
paths, instead of a budget), `acceptance`, `typical_epsilon`, `typical_delta`, the
sampling options and `return_metadata`.

Statistics (as `speculative_tree`): `drafted_at` / `accepted_at` count the nodes
verified and accepted per depth, `mean_accepted_length` the accepted nodes per
verify of a row; `draft_passes` is 0 (the heads run inside the step).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from mdjax.cache import KVCache
from mdjax.errors import MdjaxError, check_count, check_real
from mdjax.heads import tree as medusa_tree
from mdjax.heads.base import Heads, HeadsConfig
from mdjax.heads.medusa import medusa_logits
from mdjax.sampling import tree_accept
from mdjax.strategies import drafting, layouts, trees
from mdjax.strategies.base import Limits, ModelFn, Prompt, Sampled, internal
from mdjax.strategies.drafting import DraftState
from mdjax.strategies.registry import register
from mdjax.strategies.speculative_tree import SLOT_MULTIPLE
from mdjax.strategies.trees import Tree

ACCEPTANCES = ("exact", "typical")
DEFAULT_BUDGET = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadsState(DraftState):
  """`DraftState` (R = B x N output rows, one per branch; D = the tree's depth; no
  draft model), and

    hidden          float[R, H]  the target's final-norm hidden state at the token
                                 before `last`: what the heads read
    branch_segment  int32[R]     the segment branch r decodes in (-1: no such branch)
  """

  hidden: Float[Array, "R H"]
  branch_segment: Int[Array, "R"]


def typical_accept(keys: jax.Array, tokens: Int[Array, "B N"], parent: Int[Array, "B N"],
                   p: Float[Array, "B N+1 V"], depth: int, *, epsilon: float, delta: float
                   ) -> tuple[Int[Array, "B D"], Int[Array, "B"]]:
  """Medusa's typical acceptance on a tree (`tree_accept`'s arguments and result).

  Node n passes when `p[:, 1 + parent[n]]` (the target's distribution after its
  parent; column 0 the root) gives its token more than min(epsilon, delta * exp(-H)),
  H that distribution's entropy. The deepest node that passes with all its
  ancestors is accepted with its path (ties: the lowest index); the next token is
  sampled from `p` after it. Lossy: the emitted tokens do not follow `p`'s law.
  """
  batch = tokens.shape[0]
  rows = jnp.arange(batch)
  plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
  threshold = jnp.minimum(epsilon, delta * jnp.exp(plogp.sum(axis=-1)))  # [B, N + 1]
  above = parent + 1  # [B, N] column of each node's parent
  passes = p[rows[:, None], above, tokens] > jnp.take_along_axis(threshold, above, axis=1)
  under_root, up = parent < 0, jnp.maximum(parent, 0)
  take = lambda x: jnp.take_along_axis(x, up, axis=1)
  accepted, level = passes, jnp.ones_like(parent)
  for _ in range(depth - 1):  # after i rounds, right for the nodes i + 1 levels deep
    accepted = passes & (under_root | take(accepted))
    level = jnp.where(under_root, 1, 1 + take(level))
  best = jnp.argmax(jnp.where(accepted, level, 0), axis=1)  # [B] the first deepest
  node = jnp.where(accepted[rows, best], best, -1).astype(jnp.int32)
  last = node
  path = jnp.full((batch, depth), -1, jnp.int32)
  for _ in range(depth):  # from the accepted node up to the root, one level per round
    path = path.at[rows, jnp.where(node >= 0, level[rows, node] - 1, depth)].set(node, mode="drop")
    node = jnp.where(node >= 0, parent[rows, jnp.maximum(node, 0)], -1)
  next_token = jax.vmap(jax.random.categorical)(keys, jnp.log(p[rows, last + 1]))
  return path, next_token.astype(jnp.int32)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Medusa(Sampled):
  """Medusa heads' guesses, as a static tree, verified in one target pass."""

  name: ClassVar[str] = "medusa"
  layout: ClassVar = layouts.Questions(required=False)

  heads: HeadsConfig | None = None  # `construct` turns the user's `mdjax.Heads` into its config
  num_heads: int = 0  # 0: every head
  tree_budget: int = 0  # 0: the heads' calibrated tree, else DEFAULT_BUDGET nodes
  tree: tuple[tuple[int, ...], ...] | None = None  # explicit rank paths (instead of a budget)
  acceptance: str = "exact"  # or "typical" (lossy, with sampling)
  typical_epsilon: float = 0.09
  typical_delta: float = 0.3
  return_metadata: bool = False  # per-token metadata (`mdjax.strategies.metadata`)

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.heads, HeadsConfig):
      raise MdjaxError(f"strategy {self.name!r} needs heads=<mdjax Heads> (mdjax.load_heads), "
                       f"got {self.heads!r}")
    check_count("num_heads", self.num_heads, 0)
    if self.num_heads > self.heads.num_heads:
      raise MdjaxError(f"num_heads ({self.num_heads}) exceeds the {self.heads.num_heads} heads "
                       "given")
    check_count("tree_budget", self.tree_budget, 0)
    if self.tree is not None:
      if self.tree_budget:
        raise MdjaxError(f"give tree or tree_budget, not both (tree_budget {self.tree_budget})")
      object.__setattr__(self, "tree", medusa_tree.check_tree(self.tree, self.used_heads,
                                                              self.model.vocab_size))
    if self.acceptance not in ACCEPTANCES:
      raise MdjaxError(f"acceptance must be one of {', '.join(ACCEPTANCES)}, "
                       f"got {self.acceptance!r}")
    check_real("typical_epsilon", self.typical_epsilon, minimum=0, maximum=1)
    check_real("typical_delta", self.typical_delta, minimum=0)
    if self.acceptance == "typical" and self.sampling.greedy:
      raise MdjaxError("acceptance='typical' needs sampling (e.g. temperature=0.7): at "
                       "temperature 0 decoding is greedy and exact")
    self.nodes  # builds and checks the tree

  @classmethod
  def construct(cls, target: ModelFn, model, options: dict) -> tuple["Medusa", dict]:
    """The strategy with the heads' config as its static field, and the params it
    runs on, `{"target": ..., "heads": ...}`."""
    options = dict(options)
    heads = options.pop("heads", None)
    if not isinstance(heads, Heads):
      raise MdjaxError(f"strategy {cls.name!r} needs heads=<mdjax Heads> (mdjax.load_heads), "
                       f"got {heads!r}")
    if heads.config.family != "medusa":
      raise MdjaxError(f"strategy {cls.name!r} needs medusa heads, got "
                       f"{heads.config.family} heads {heads.name or heads.config.base_model!r}")
    heads.check_model(model.config)
    return cls(model=target, heads=heads.config, **options), {"target": model.params,
                                                              "heads": heads.params}

  @property
  def used_heads(self) -> int:
    return self.num_heads or self.heads.num_heads

  @functools.cached_property
  def nodes(self) -> medusa_tree.MedusaTree:
    """The tree verified every step (see the class options)."""
    if self.tree is not None:
      return self.tree
    if not self.tree_budget and self.heads.tree:
      kept = [node for node in self.heads.tree if len(node) <= self.used_heads]
      return medusa_tree.check_tree(kept, self.used_heads, self.model.vocab_size)
    accuracy = (self.heads.top_accuracy[:self.used_heads] if self.heads.top_accuracy
                else medusa_tree.default_accuracy(self.used_heads))
    if len(accuracy) < self.used_heads:
      raise MdjaxError(f"the heads' top_accuracy has {len(accuracy)} rows for the "
                       f"{self.used_heads} heads used")
    tree = medusa_tree.build_tree(accuracy, self.tree_budget or DEFAULT_BUDGET)
    return medusa_tree.check_tree(tree, self.used_heads, self.model.vocab_size)

  @functools.cached_property
  def arrays(self) -> medusa_tree.TreeArrays:
    return medusa_tree.TreeArrays.of(self.nodes)

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, and per branch its generated tokens and room for one tree."""
    slots = prompt_len + (capacity + 1 + len(self.nodes)) * branches
    return -(-slots // SLOT_MULTIPLE) * SLOT_MULTIPLE

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> HeadsState:
    topology = prompt.topology()
    logits, hidden, cache = self.model(params["target"], cache, prompt.tokens, prompt.positions,
                                       prompt.segments, topology,
                                       logits_at=prompt.branch_last)  # [B, N, V], [B, P, H]
    hidden = jnp.take_along_axis(hidden, prompt.branch_last[..., None], axis=1)  # [B, N, H]
    return drafting.start(HeadsState, self.model, None, params, prompt, cache, limits, capacity,
                          self.sampling, positions=self.arrays.max_depth,
                          return_metadata=self.return_metadata,
                          prefilled=(logits, cache, topology),
                          hidden=hidden.reshape(-1, hidden.shape[-1]),  # [R, H]
                          branch_segment=prompt.branch_segment.reshape(-1))

  def _guess(self, params, hidden: Float[Array, "R H"]) -> Tree:
    """The tree's tokens: node n is head[n]'s rank[n] guess."""
    arrays, rows = self.arrays, hidden.shape[0]
    heads_params = jax.tree.map(lambda a: a[:self.used_heads], params["heads"])
    logits = medusa_logits(heads_params, params["target"], hidden,
                           model_config=self.model.config)  # [R, K, V]
    _, top = jax.lax.top_k(logits, arrays.num_ranks)  # [R, K, ranks]
    broadcast = lambda a: jnp.broadcast_to(jnp.asarray(a), (rows, a.size))
    return Tree(tokens=top[:, arrays.head, arrays.rank].astype(jnp.int32),  # [R, M]
                parent=broadcast(arrays.parent), depth=broadcast(arrays.depth))

  def step(self, params, state: HeadsState) -> HeadsState:
    tree = self._guess(params, state.hidden)
    accept = tree_accept if self.acceptance == "exact" else functools.partial(
        typical_accept, epsilon=self.typical_epsilon, delta=self.typical_delta)
    verified = trees.verify(self.model, params["target"], state, tree, self.arrays.max_depth,
                            drafting.step_keys(state), self.sampling, accept,
                            branch_segment=state.branch_segment)
    state = trees.commit(state, tree, verified, self.sampling, draft_passes=0)
    return dataclasses.replace(state, hidden=verified.hidden_at_last())

  def result(self, state: HeadsState):
    drafted, accepted = state.drafted_at, state.accepted_at
    # every verify of a live row checks the whole tree
    return state.buffer, drafting.stats(
        state, accepted.sum() * len(self.nodes) / jnp.maximum(drafted.sum(), 1))


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Blockwise(Medusa):
  """Blockwise parallel decoding: the chain of every head's top-1 guess (see the
  module docstring); options `heads`, `questions`, `num_heads`, sampling,
  `return_metadata`."""

  name: ClassVar[str] = "blockwise"

  tree_budget: int = internal(0)
  tree: tuple[tuple[int, ...], ...] | None = internal(None)
  acceptance: str = internal("exact")
  typical_epsilon: float = internal(0.09)
  typical_delta: float = internal(0.3)

  @functools.cached_property
  def nodes(self) -> medusa_tree.MedusaTree:
    return medusa_tree.chain(self.used_heads)
