r"""`medusa` and `blockwise`: heads guess the tokens after the next one from the
target's hidden states, and the target verifies their guesses as a tree in one pass.

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
next token is sampled from the target's distribution after it
(`mdjax.sampling.typical_accept`).

MTP heads (Gloeckle et al. 2024, `mdjax.heads.mtp`) guess the same tokens as Medusa's
(head k: token t + 1 + k), each through a decoder layer with its own attention over
the target's hidden states, so they keep a KV cache of their own over the committed
text and follow it: prefill fills it with the prompt's hidden states; after each
verify the heads catch up on the committed tokens, `c` and the accepted path, fed
the target's hidden states there (`trees.Verified.hidden` along the path, at the
target's positions, in the branch's segment), and their outputs at the last one are
what the next tree is read from. Say `a b` are kept after `x`::

    target cache   ... x  a  b         hidden  h_x  h_a  h_b   (one verify pass)
    heads' cache   ... x  a  b         fed     h_x  h_a  h_b   (one heads pass)
    next tree      lm_head(heads' outputs at b): head k's top-k guess the token k after y

Verification is unchanged (greedy stays exactly greedy). What the heads read is their
family's `guess` (`HeadFamily.guesser`, an `mdjax.heads.family.Guess`: Medusa's reads the
target's hidden state and keeps no cache, MTP's its own cache and outputs); this
strategy hands it the prompt, then after each verify the committed tokens' hidden
states, positions and segments, and the step is shared.

Blockwise parallel decoding (Stern et al. 2018) is the special case of one chain,
x then head 1's top-1, head 2's top-1, ...: `strategy="blockwise"` (`Blockwise`)
verifies the longest prefix of that block the target agrees with.

Options: `heads` (an `mdjax.Heads` of family medusa or mtp, required), `questions`
(optional, as `multi_question`), `num_heads` (use the first n; 0: all),
`tree_budget` (nodes, or "auto", the default: the tree of the most expected tokens
per second given what a pass costs here and the heads' accuracies, or no tree when
none pays, `mdjax.strategies.tree_choice`; 0: the heads' calibrated tree when they
carry one, else a tree of `DEFAULT_BUDGET` nodes built from their measured top-k
accuracies, or from
`mdjax.heads.tree.default_accuracy` when they carry none), `tree` (explicit rank
paths, instead of a budget), `acceptance`, `typical_epsilon`, `typical_delta`, the
sampling options and `return_metadata`.

Statistics (as `speculative_tree`): `drafted_at` / `accepted_at` count the nodes
verified and accepted per depth, `mean_accepted_length` the accepted nodes per
verify of a row; `draft_passes` is 0 for Medusa heads (they run inside the step), one
per step for MTP heads (their catch-up pass).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from mdjax.cache import KVCache
from mdjax.errors import MdjaxError, check_count, check_real
from mdjax.heads import tree as medusa_tree
from mdjax.heads import vocab
from mdjax.heads.base import Heads, HeadsConfig
from mdjax.heads.family import Feed, Guess, HeadFamily
from mdjax.heads.registry import decoded_by, get as get_family
from mdjax.sampling import tree_accept, typical_accept
from mdjax.strategies import drafting, prompt_layouts, tree_choice, trees
from mdjax.strategies.base import (Limits, ModelFn, Prompt, Sampled, internal,
                                   prefill_with_hidden)
from mdjax.strategies.drafting import DraftState
from mdjax.strategies.pass_cost import pass_cost
from mdjax.strategies.registry import register
from mdjax.strategies.speculative_tree import SLOT_MULTIPLE
from mdjax.strategies.trees import Tree, Verified

ACCEPTANCES = ("exact", "typical")
DEFAULT_BUDGET = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadsState(DraftState):
  """`DraftState` (R = B x N output rows, one per branch; D = the tree's depth; no
  draft model), and

    read            what the heads guess the next tree from: whatever their family's
                    `Guess` keeps (an array or a pytree, e.g. the target's hidden state
                    at the token before `last`)
    branch_segment  int32[R]     the segment branch r decodes in (-1: no such branch)
    parents         int32[B, G + N M]  the verify pass's segment parents
                                 (`trees.pass_parents`: the tree is the same every step)
  """

  read: Any
  branch_segment: Int[Array, "R"]
  parents: Int[Array, "B G+N*M"]


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Medusa(Sampled):
  """Medusa (or MTP) heads' guesses, as a static tree, verified in one target pass."""

  name: ClassVar[str] = "medusa"
  layout: ClassVar = prompt_layouts.Questions(required=False)

  heads: HeadsConfig | None = None  # `construct` turns the user's `mdjax.Heads` into its config
  num_heads: int = 0  # 0: every head
  tree_budget: int | str = tree_choice.AUTO  # nodes, "auto" (`tree_choice`) or 0 (see above)
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
    tree_choice.check_budget(self.tree_budget, 0)
    if self.tree is not None:
      if self.tree_budget not in (0, tree_choice.AUTO):
        raise MdjaxError(f"give tree or tree_budget, not both (tree_budget {self.tree_budget})")
      object.__setattr__(self, "tree", medusa_tree.check_tree(self.tree, self.used_heads,
                                                              self.model.vocab_size))
    if self.acceptance not in ACCEPTANCES:
      raise MdjaxError(f"acceptance must be one of {', '.join(ACCEPTANCES)}, "
                       f"got {self.acceptance!r}")
    check_real("typical_epsilon", self.typical_epsilon, minimum=0, maximum=1)
    check_real("typical_delta", self.typical_delta, minimum=0)
    if self.acceptance == "typical" and self.greedy:
      raise MdjaxError("acceptance='typical' needs sampling (e.g. temperature=0.7): at "
                       "temperature 0 decoding is greedy and exact")
    if not self.auto:
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
    if heads.config.family not in decoded_by(cls.name):
      raise MdjaxError(f"strategy {cls.name!r} needs {' or '.join(decoded_by(cls.name))} heads, "
                       f"got {heads.config.family} heads "
                       f"{heads.name or heads.config.base_model!r}")
    heads.check_model(model.config)
    params = heads.params
    if "draft_ids" in params and "lm_head" not in params:  # the model's draft columns, once
      params = {**params, "draft_unembedding": vocab.unembedding_columns(model.params,
                                                                         params["draft_ids"])}
    return cls(model=target, heads=heads.config, **options), {"target": model.params,
                                                              "heads": params}

  @property
  def used_heads(self) -> int:
    """The heads the tree may draw on (`num_heads`, 0: all of them)."""
    return self.num_heads or self.heads.num_heads

  @property
  def drafting_heads(self) -> int:
    """The heads that run each step: as many as the tree is deep (a tree of depth d
    reads heads 1 .. d only; the rest would cost time and draft nothing)."""
    return self.arrays.max_depth

  @property
  def family(self) -> HeadFamily:
    return get_family(self.heads.family)

  @functools.cached_property
  def guess(self) -> Guess:
    """What the heads of this family read, and how it follows the committed text."""
    return self.family.guesser(self.heads, self.model.config, self.model.attention,
                               self.drafting_heads)

  @property
  def auto(self) -> bool:
    """The tree is still to be chosen for the request (`for_request`)."""
    return self.tree_budget == tree_choice.AUTO and self.tree is None

  def for_request(self, params, prompt: Prompt, capacity: int) -> Sampled:
    """With `tree_budget="auto"`: the budget of the most expected tokens per second at
    this request's batch and branches, or plain decoding when no tree pays (never with
    `return_metadata`, which describes drafts)."""
    if not self.auto:
      return self
    rows, branches = prompt.branch_segment.shape
    cost = pass_cost(self.model, params["target"], rows)
    # a tree of depth d runs the first d heads (a draft vocabulary's columns among them)
    fractions = tree_choice.first_heads_fractions(
        self.family, params["heads"], params["target"], self.used_heads)
    choice = tree_choice.chosen_static_tree(
        tree_choice.hashable(self.accuracy), cost, fractions, branches,
        tree_choice.Batch(rows=rows * branches, new_tokens=capacity),
        allow_plain=not self.return_metadata)
    if choice.plain:
      return tree_choice.plain_decoding(self, params, prompt, capacity, choice)
    return dataclasses.replace(self, tree_budget=choice.budget,
                               request_stats=choice.stats(self.greedy))

  @property
  def accuracy(self) -> tuple[tuple[float, ...], ...]:
    """The used heads' top-k accuracies (`mdjax.heads.tree`), else the default ones."""
    accuracy = (self.heads.top_accuracy[:self.used_heads] if self.heads.top_accuracy
                else medusa_tree.default_accuracy(self.used_heads))
    if len(accuracy) < self.used_heads:
      raise MdjaxError(f"the heads' top_accuracy has {len(accuracy)} rows for the "
                       f"{self.used_heads} heads used")
    return accuracy

  @functools.cached_property
  def nodes(self) -> medusa_tree.MedusaTree:
    """The tree verified every step (see the class options)."""
    if self.tree is not None:
      return self.tree
    if self.auto:
      raise MdjaxError("tree_budget='auto' chooses the tree per request: "
                       "Medusa.for_request gives the strategy that has one")
    if not self.tree_budget and self.heads.tree:
      kept = [node for node in self.heads.tree if len(node) <= self.used_heads]
      return medusa_tree.check_tree(kept, self.used_heads, self.model.vocab_size)
    tree = medusa_tree.build_tree(self.accuracy, self.tree_budget or DEFAULT_BUDGET)
    return medusa_tree.check_tree(tree, self.used_heads, self.model.vocab_size)

  @functools.cached_property
  def arrays(self) -> medusa_tree.TreeArrays:
    return medusa_tree.TreeArrays.of(self.nodes)

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, and per branch its generated tokens and room for one tree."""
    slots = prompt_len + (capacity + 1 + len(self.nodes)) * branches
    return -(-slots // SLOT_MULTIPLE) * SLOT_MULTIPLE

  def _used(self, params) -> dict:
    """`{"target", "heads"}` with the heads cut to the `drafting_heads`."""
    return {"target": params["target"],
            "heads": self.family.first_heads(params["heads"], self.drafting_heads)}

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> HeadsState:
    logits, hidden, cache, topology = prefill_with_hidden(self.model, params["target"], prompt,
                                                          cache)  # [B, N, V], [B, P, H]
    branch_segment = prompt.branch_segment.reshape(-1)  # [R]
    parent = self._every_row(self.arrays.parent, branch_segment.size)
    return drafting.start(HeadsState, self.model, None, params, prompt, cache, limits, capacity,
                          limits.sampling, positions=self.arrays.max_depth,
                          return_metadata=self.return_metadata,
                          prefilled=(logits, cache, topology),
                          read=self.guess.start(self._used(params), hidden, prompt.branch_last,
                                                Feed(prompt.positions, prompt.segments,
                                                     prompt.topology()),
                                                cache.num_slots, cache.dtype),
                          branch_segment=branch_segment,
                          parents=trees.pass_parents(topology.parent, parent, branch_segment))

  def _tree(self, logits: Float[Array, "R K V"], draft_ids: Int[Array, "Vd"] | None) -> Tree:
    """The tree's tokens from the heads' logits: node n is head[n]'s rank[n] guess (a
    draft-vocabulary column mapped to its target id)."""
    arrays, rows = self.arrays, logits.shape[0]
    _, top = jax.lax.top_k(logits, arrays.num_ranks)  # [R, K, ranks]
    tokens = vocab.to_target(top[:, arrays.head, arrays.rank], draft_ids)  # [R, M]
    return Tree(tokens=tokens.astype(jnp.int32), parent=self._every_row(arrays.parent, rows),
                depth=self._every_row(arrays.depth, rows))

  @staticmethod
  def _every_row(a: np.ndarray, rows: int) -> Int[Array, "R M"]:
    """A row of the static tree's (`TreeArrays`) in each of `rows` rows."""
    return jnp.broadcast_to(jnp.asarray(a), (rows, a.size))

  def step(self, params, state: HeadsState) -> HeadsState:
    used = self._used(params)
    tree = self._tree(self.guess.logits(used, state.read), used["heads"].get("draft_ids"))
    accept = tree_accept if self.acceptance == "exact" else functools.partial(
        typical_accept, epsilon=self.typical_epsilon, delta=self.typical_delta)
    verified = trees.verify(self.model, params["target"], state, tree, self.arrays.max_depth,
                            drafting.step_keys(state), state.limits.sampling, accept,
                            branch_segment=state.branch_segment, parents=state.parents)
    read = self.guess.advance(used, state.read, self._committed_hidden(verified),
                              verified.accepted, self._committed(state, verified))
    state = trees.commit(state, tree, verified, state.limits.sampling, draft_passes=self.guess.passes)
    return dataclasses.replace(state, read=read)

  def _committed_hidden(self, verified: Verified) -> Float[Array, "R D+1 H"]:
    """The target's hidden states at `c` and each accepted node (`hidden_on_path`): of a
    chain, the verify's columns as they are (its path is its first nodes, and the
    columns past the path are not committed, which is all `advance` reads), saving a
    gather."""
    if len(self.nodes) == self.arrays.max_depth:  # a chain
      return verified.hidden
    return verified.hidden_on_path()

  @staticmethod
  def _committed(state: HeadsState, verified: Verified) -> Feed:
    """Where each row's fed `c` and path sit, `[R, 1 + D]`: after `next_pos`, in the
    branch's segment up to the last accepted node (-1 past it, and in finished rows,
    whose positions are never read: 0, so that one kernel on a GPU writes both)."""
    column = jnp.arange(verified.path.shape[1] + 1)[None, :]
    committed = (column <= verified.accepted[:, None]) & ~state.buffer.done[:, None]
    return Feed(jnp.where(committed, state.next_pos[:, None] + column, 0),
                jnp.where(committed, state.branch_segment[:, None], -1), state.topology)

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
