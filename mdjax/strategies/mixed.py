r"""`mixed`: drafts from several sources in ONE token tree, verified in one target pass.

Every step each source proposes a tree after the last emitted token `c`
(`mdjax.strategies.mix_sources`): prompt lookup (what followed earlier occurrences of
the last n-gram, in the prompt and the text emitted so far: several distinct matches,
siblings where they part), heads of any family (parallel heads through a static tree
of their top-k guesses, as `medusa`; a sequential head's EAGLE-2 tree, as `eagle`), a
draft model's greedy chain. The trees are merged into one trie (`trees.merge_trees`: a
path two sources propose is one path), verified like any tree (`trees.verify`:
greedy-exact, or lossless sampling by the tree rule, since every node is fixed before
the target's draw), and every source then follows the committed text, whichever
source's path was kept::

    lookup   a b c | a b d          c ── a ── b ── c         one pass over c and 7 nodes
    heads    a b, a f, e                  │    │    └── d
    draft    e g                          │    └── f
                                          └── e ── g         accepted: a b, then x
    credited: lookup 2, heads 2 (a b are both theirs), draft 0

Options: `sources` (a list of "prompt_lookup", "heads", "draft", in priority order:
a trie over the budget keeps the first sources' nodes; default: prompt lookup, plus
heads and a draft model when given), `prompt_lookup_num_tokens` and `max_ngram_size`
(as `prompt_lookup`), `prompt_lookup_num_matches` (distinct matches proposed),
`heads` and `num_heads` (parallel heads: the heads a tree may draw on; a sequential
head: its tree's depth; 0: all of them, or 4 levels), `draft` and `num_draft_tokens`
(as `speculative`), `tree_budget` (nodes verified per step, or "auto", the default),
the sampling options and `return_metadata`.

`tree_budget="auto"` (`mdjax.strategies.mix_choice`): per request, the heads' tree is
the one their own strategy's `auto` would choose (`tree_choice`; heads whose own `auto`
runs plain decoding are left out), a draft model that does not pay on its own is left
out, and plain decoding runs when no mix pays by the sources' priors and the measured
pass cost t(n); per step and row, how many of its nodes each source gives the trie,
from its acceptance so far in this request. With an integer budget the heads' tree is
their `build_tree` of that many nodes (parallel) or EAGLE-2's of depth `num_heads`
(4) and top-k 4 (sequential), every source proposes its whole tree and the trie keeps
its first nodes.

A source that cannot serve the request (heads trained on another model, a draft model
with another vocabulary or tokenizer, prompt lookup as the only source with no prompt
repeating a token) is an `MdjaxError` naming it, or under "auto" is left out, said in
`out.stats["left_out"]`. `out.stats` also has, per source, `drafted_<source>` (the trie
nodes holding its tokens) and `accepted_<source>` (those the target kept; a node two
sources proposed is credited to both), and the `drafting.stats` of every drafting
strategy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from mdjax.cache import KVCache
from mdjax.errors import MdjaxError, check_count
from mdjax.heads import Heads, HeadsConfig, get_family, vocab
from mdjax.heads import tree as medusa_tree
from mdjax.strategies import (drafting, mix_choice, mix_sources, prompt_layouts, tree_choice,
                              trees)
from mdjax.strategies.base import Limits, ModelFn, Prompt, Sampled, internal, prefill_with_hidden
from mdjax.strategies.drafting import DraftState
from mdjax.strategies.mix_choice import StepCost
from mdjax.strategies.mix_sources import DraftModel, ParallelHeads, PromptLookup, SequentialHead
from mdjax.strategies.pass_cost import pass_cost
from mdjax.strategies.registry import register
from mdjax.strategies.speculative_tree import DEFAULT_TOP_K, SLOT_MULTIPLE

SOURCES = ("prompt_lookup", "heads", "draft")
DEFAULT_HEAD_STEPS = 4  # tokens a sequential head unrolls with num_heads=0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class MixState(DraftState):
  """`DraftState` (D = the deepest source; `draft`: the draft model's `DraftModelState`,
  its `pending` [R, 1 + D] wide, or None), and (S = the sources)

    history    int32[R, H] | None  prompt lookup: the prompt, then the emitted tokens
    length     int32[R] | None     tokens in `history`
    read       Any                 heads: what parallel heads read (their `Guess`'s), or a
                                   sequential head's `eagle.HeadState`; None without heads
    expected   float32[R, S, D]    over the steps in which source s had a node at depth
                                   d + 1 in the trie and the path ran through its nodes
                                   to depth d, its table's chance of depth d + 1 then
                                   (`mix_choice`)
    hits       int32[R, S, D]      of those steps, the ones it was right at d + 1 too
    offered    int32[S]            trie nodes holding each source's tokens (live rows)
    credited   int32[S]            of those, the ones the target accepted
    row_steps  int32[]             verifies of live rows
  """

  history: Int[Array, "R H"] | None
  length: Int[Array, "R"] | None
  read: Any
  expected: Float[Array, "R S D"]
  hits: Int[Array, "R S D"]
  offered: Int[Array, "S"]
  credited: Int[Array, "S"]
  row_steps: Int[Array, ""]


def _serving_problem(name: str, model, heads, draft) -> str | None:
  """Why source `name` cannot serve a request on `model` (None: it can). A source given
  no input at all is the caller's mistake, raised at once."""
  if name == "heads":
    if not isinstance(heads, Heads):
      raise MdjaxError(f"source 'heads' of strategy 'mixed' needs heads=<mdjax Heads> "
                       f"(mdjax.load_heads), got {heads!r}")
    try:
      heads.check_model(model.config)
    except MdjaxError as error:
      return str(error)
    family = get_family(heads.config.family)
    if not family.sequential:
      try:
        family.guesser(heads.config, model.config, "block_sparse", 1)
      except MdjaxError as error:
        return str(error)
  if name == "draft":
    if not (hasattr(draft, "config") and hasattr(draft, "params")):
      raise MdjaxError(f"source 'draft' of strategy 'mixed' needs draft=<an mdjax Model>, "
                       f"got {draft!r}")
    if draft.config.vocab_size != model.config.vocab_size:
      return (f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the "
              f"target's ({model.config.vocab_size} tokens)")
    tokenizers = (getattr(model, "tokenizer", None), getattr(draft, "tokenizer", None))
    if None not in tokenizers and tokenizers[0].get_vocab() != tokenizers[1].get_vocab():
      return "the draft's tokenizer differs from the target's"
  return None


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Mixed(Sampled):
  """Trees of prompt lookup, heads and a draft model in one trie, verified in one pass."""

  name: ClassVar[str] = "mixed"
  layout: ClassVar = prompt_layouts.Plain()

  sources: tuple[str, ...] | None = None  # None: prompt lookup, and heads and draft if given
  prompt_lookup_num_tokens: int = 8
  max_ngram_size: int = 2
  prompt_lookup_num_matches: int = 3  # distinct matches proposed, siblings where they part
  heads: HeadsConfig | None = None  # `construct` turns the user's `mdjax.Heads` into its config
  num_heads: int = 0  # parallel heads used, or a sequential head's tree depth; 0: all, or 4
  draft: ModelFn | None = None  # `construct` turns the user's mdjax Model into its ModelFn
  num_draft_tokens: int = 4
  tree_budget: int | str = tree_choice.AUTO  # nodes verified per step, or "auto"
  return_metadata: bool = False  # per-token metadata (`mdjax.strategies.metadata`)
  step_cost: StepCost | None = internal()  # set by `auto`: node counts chosen per step
  # the heads' tree: parallel heads' rank paths best first, a sequential head's (depth,
  # top-k, nodes); set by `auto`, or from an integer budget
  heads_tree: tuple | None = internal()

  def __post_init__(self):
    super().__post_init__()
    if self.sources is None:
      object.__setattr__(self, "sources", ("prompt_lookup",) + ("heads",) * (self.heads is not None)
                         + ("draft",) * (self.draft is not None))
    if isinstance(self.sources, str) or not isinstance(self.sources, (list, tuple)):
      raise MdjaxError(f"sources must be a list of {', '.join(SOURCES)}, got {self.sources!r}")
    object.__setattr__(self, "sources", tuple(self.sources))
    unknown = [s for s in self.sources if s not in SOURCES]
    if unknown or not self.sources or len(set(self.sources)) < len(self.sources):
      raise MdjaxError(f"sources must be distinct names among {', '.join(SOURCES)}, "
                       f"got {list(self.sources)!r}")
    check_count("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens, 1)
    check_count("max_ngram_size", self.max_ngram_size, 1)
    check_count("prompt_lookup_num_matches", self.prompt_lookup_num_matches, 1)
    check_count("num_heads", self.num_heads, 0)
    check_count("num_draft_tokens", self.num_draft_tokens, 1)
    tree_choice.check_budget(self.tree_budget, 1)
    if "heads" in self.sources and not isinstance(self.heads, HeadsConfig):
      raise MdjaxError(f"source 'heads' needs heads=<mdjax Heads>, got {self.heads!r}")
    if "heads" in self.sources and self.num_heads > self.heads.num_heads and not self.sequential:
      raise MdjaxError(f"num_heads ({self.num_heads}) exceeds the {self.heads.num_heads} heads "
                       "given")
    if "draft" in self.sources:
      drafting.check_vocabulary(self.model, self.draft)
    if "heads" in self.sources and self.heads_tree is None and not self.auto:
      object.__setattr__(self, "heads_tree", self._given_heads_tree())

  @classmethod
  def construct(cls, target: ModelFn, model, options: dict) -> tuple["Mixed", dict]:
    """The strategy and its params `{"target", "heads"?, "draft"?}`; a source that
    cannot serve is an error, or left out under "auto" (module docstring)."""
    options = dict(options)
    heads, draft = options.pop("heads", None), options.pop("draft", None)
    sources = options.pop("sources", None)
    if sources is None:
      sources = ("prompt_lookup",) + ("heads",) * (heads is not None) + ("draft",) * (
          draft is not None)
    auto = options.get("tree_budget", tree_choice.AUTO) == tree_choice.AUTO
    left_out = {}
    for name in sources if isinstance(sources, (list, tuple)) else ():
      problem = _serving_problem(name, model, heads, draft)
      if problem is not None and not auto:
        raise MdjaxError(f"source {name!r} of strategy 'mixed' cannot serve this request: "
                         f"{problem}")
      if problem is not None:
        left_out[name] = problem
    if isinstance(sources, (list, tuple)):
      sources = tuple(name for name in sources if name not in left_out)
    params, fields = {"target": model.params}, {}
    if isinstance(sources, tuple) and "heads" in sources:
      reads = get_family(heads.config.family).target_layers(heads.config)
      target = dataclasses.replace(target, hidden_layers=reads)
      params["heads"] = heads.params
      if "draft_ids" in heads.params and "lm_head" not in heads.params:  # its columns, once
        params["heads"] = {**heads.params, "draft_unembedding": vocab.unembedding_columns(
            model.params, heads.params["draft_ids"])}
      fields["heads"] = heads.config
    if isinstance(sources, tuple) and "draft" in sources:
      params["draft"] = draft.params
      fields["draft"] = ModelFn(config=draft.config, attention=target.attention)
    if isinstance(sources, tuple) and not sources:
      sources = ("prompt_lookup",)  # every source left out: `auto` decodes plainly
      left_out.setdefault("prompt_lookup", "every other source was left out")
    return cls(model=target, sources=sources, request_stats={"left_out": left_out},
               **fields, **options), params

  @property
  def sequential(self) -> bool:
    return get_family(self.heads.family).sequential

  @property
  def used_heads(self) -> int:
    """Parallel heads a tree may draw on (`num_heads`, 0: all of them)."""
    return self.num_heads or self.heads.num_heads

  @property
  def head_accuracy(self) -> tuple[tuple[float, ...], ...]:
    """Parallel heads' top-k accuracies (the used heads'), else the default ones."""
    return ((self.heads.top_accuracy or ())[:self.used_heads]
            or medusa_tree.default_accuracy(self.used_heads))

  def _given_heads_tree(self) -> tuple:
    """The heads' tree for an integer budget (module docstring)."""
    if self.sequential:
      depth, top_k = self.num_heads or DEFAULT_HEAD_STEPS, DEFAULT_TOP_K
      return (depth, top_k, min(self.tree_budget, top_k + (depth - 1) * top_k**2))
    per_rank = medusa_tree.rank_accuracy(self.head_accuracy)
    available = sum(math.prod(row.size for row in per_rank[:d])
                    for d in range(1, len(per_rank) + 1))
    return mix_sources.ordered_by_value(
        tree_choice.best_static_tree(tree_choice.hashable(self.head_accuracy),
                                     min(self.tree_budget, available)), self.head_accuracy)

  @functools.cached_property
  def chains(self) -> tuple:
    """The source objects (`mix_sources`), in `sources` order."""
    made = {}
    for name in self.sources:
      if name == "prompt_lookup":
        made[name] = PromptLookup(cap=self.prompt_lookup_num_tokens,
                                  max_ngram_size=self.max_ngram_size,
                                  matches=self.prompt_lookup_num_matches)
      elif name == "heads" and self.sequential:
        depth, top_k, size = self.heads_tree
        made[name] = SequentialHead(heads=self.heads, target=self.model, tree_depth=depth,
                                    top_k=top_k, size=size)
      elif name == "heads":
        made[name] = ParallelHeads(heads=self.heads, target=self.model, nodes=self.heads_tree)
      else:
        made[name] = DraftModel(draft=self.draft, cap=self.num_draft_tokens)
    return tuple(made[name] for name in self.sources)

  @property
  def depth(self) -> int:
    """The deepest source: the deepest a trie goes."""
    return max(source.depth for source in self.chains)

  @property
  def tables(self) -> list[np.ndarray]:
    """Each source's reach table `[size + 1, D]` (`mix_choice`)."""
    return [source.table(self.depth) for source in self.chains]

  def _step_cost(self, params, cost, nodes: int) -> StepCost:
    costs = [source.fixed_and_per_token(params, cost, self.depth) for source in self.chains]
    return StepCost.of(cost, nodes, sum(fixed for fixed, _ in costs), [c for _, c in costs])

  def _auto_heads_tree(self, params, cost, batch: tree_choice.Batch) -> tree_choice.Choice:
    """The tree the heads' own strategy's `auto` chooses for this request (`medusa`'s
    static tree, `eagle`'s dynamic one), by the same rule and inputs."""
    if self.sequential:
      fraction = tree_choice.heads_fraction(params["heads"], params["target"])
      depths = range(1, tree_choice.MAX_DEPTH + 1)
      return tree_choice.chosen_dynamic_tree(
          tree_choice.hashable(self.heads.top_accuracy or tree_choice.DRAFT_ACCURACY), cost,
          fraction, tuple(1 + d for d in depths),
          (self.num_heads,) if self.num_heads else tuple(depths),
          tuple(range(1, min(tree_choice.MAX_TOP_K, self.model.vocab_size) + 1)), batch, True)
    fractions = tree_choice.first_heads_fractions(
        get_family(self.heads.family), params["heads"], params["target"], self.used_heads)
    return tree_choice.chosen_static_tree(tree_choice.hashable(self.head_accuracy), cost,
                                          fractions, 1, batch, True)

  def for_request(self, params, prompt: Prompt, capacity: int) -> Sampled:
    """Under "auto" (module docstring): plain decoding, or the sources that pay, the
    heads' tree, the trie's width and the step costs the compiled step chooses counts by."""
    left_out = dict((self.request_stats or {}).get("left_out", {}))
    if self.sources == ("prompt_lookup",) and not _repeats(prompt):
      problem = "nothing to match: no prompt repeats a token"
      if not self.auto:
        raise MdjaxError(f"source 'prompt_lookup' of strategy 'mixed' cannot serve this "
                         f"request: {problem}")
      left_out.setdefault("prompt_lookup", problem)
    if not self.auto:
      return dataclasses.replace(self, request_stats={"left_out": left_out,
                                                      "sources": self.sources})
    rows = prompt.tokens.shape[0]
    cost = pass_cost(self.model, params["target"], rows)
    batch = tree_choice.Batch(rows=rows, new_tokens=capacity)
    kept, heads_tree, stats = [], None, dict(cost.stats())
    for name in self.sources:
      if name == "heads":
        own = self._auto_heads_tree(params, cost, batch)
        if own.plain:
          left_out[name] = "does not pay here: its own `auto` tree would run plain decoding"
          continue
        heads_tree = ((own.depth, own.top_k, own.budget) if self.sequential else
                      mix_sources.ordered_by_value(tree_choice.best_static_tree(
                          tree_choice.hashable(self.head_accuracy), own.budget),
                          self.head_accuracy))
        stats |= {"heads_tree_budget": own.budget, "heads_tree_depth": own.depth,
                  "heads_tree_top_k": own.top_k}
      if name == "draft":
        alone = dataclasses.replace(self, sources=("draft",))
        fixed, per_token = alone.chains[0].fixed_and_per_token(params, cost, alone.depth)
        choice = mix_choice.request_choice(
            alone.tables, mix_choice.count_grid([self.num_draft_tokens], self.num_draft_tokens),
            StepCost.of(cost, self.num_draft_tokens, fixed, [per_token]), batch,
            allow_plain=False)
        if choice.speedup < tree_choice.MIN_GAIN:
          left_out[name] = (f"does not pay here: on its own its profile promises "
                            f"{choice.speedup:.2f}x plain decoding at best")
          continue
      if name == "prompt_lookup" and "prompt_lookup" in left_out:
        continue
      kept.append(name)
    kept = tuple(kept)
    stats["left_out"] = left_out
    if kept:
      mix = dataclasses.replace(self, sources=kept, heads_tree=heads_tree,
                                heads=self.heads if "heads" in kept else None,
                                draft=self.draft if "draft" in kept else None)
      nodes = min(sum(source.size for source in mix.chains), mix_choice.MAX_NODES)
      step_cost = mix._step_cost(params, cost, nodes)
      choice = mix_choice.request_choice(
          mix.tables, mix_choice.count_grid([source.size for source in mix.chains], nodes),
          step_cost, batch, allow_plain=not self.return_metadata)
      stats |= {"expected_tokens_per_pass": choice.tokens_per_pass,
                "expected_speedup": choice.speedup}
    if not kept or choice.plain:
      plain = tree_choice.plain_decoding(self, params, prompt, capacity, tree_choice.Choice(
          budget=0, depth=0, top_k=0, tokens_per_pass=1.0, speedup=1.0, cost=cost))
      return dataclasses.replace(plain, request_stats={**plain.request_stats, **stats})
    return dataclasses.replace(
        mix, tree_budget=nodes, step_cost=step_cost,
        request_stats={**stats, "tree_choice": "mix", "tree_budget": nodes, "sources": kept})

  @property
  def auto(self) -> bool:
    return self.tree_budget == tree_choice.AUTO

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, the generated tokens, and room for one trie (or one chain, or
    a head's catch-up and its tree's fed nodes, in a drafter's own cache)."""
    fed = max([getattr(source, "fed", 0) for source in self.chains])
    slots = prompt_len + capacity + 2 + max(self.tree_budget, self.depth + fed)
    return -(-slots // SLOT_MULTIPLE) * SLOT_MULTIPLE

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> MixState:
    logits, hidden, target_cache, topology = prefill_with_hidden(self.model, params["target"],
                                                                 prompt, cache)
    rows, sources, depth = prompt.tokens.shape[0], len(self.sources), self.depth
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    state = drafting.start(
        MixState, self.model, None, params, prompt, cache, limits, capacity, limits.sampling,
        positions=depth, return_metadata=self.return_metadata,
        prefilled=(logits, target_cache, topology), history=None, length=None, read=None,
        expected=jnp.zeros((rows, sources, depth), jnp.float32),
        hits=zeros(rows, sources, depth), offered=zeros(sources), credited=zeros(sources),
        row_steps=zeros())
    fields = {}
    for source in self.chains:
      fields |= source.start(params, prompt=prompt, hidden=hidden, cache=target_cache,
                             first=state.last, capacity=capacity, depth=depth, topology=topology)
    return dataclasses.replace(state, **fields)

  def step(self, params, state: MixState) -> MixState:
    keys, done = drafting.step_keys(state), state.buffer.done
    available = jnp.stack([source.available(state) for source in self.chains], axis=1)  # [R, S]
    counts = available
    tables = mix_choice.stacked(self.tables)  # [S, N + 1, D]
    if self.step_cost is not None:
      grid = mix_choice.count_grid([source.size for source in self.chains], self.tree_budget)
      counts = mix_choice.choose_counts(tables, mix_choice.factor(state.expected, state.hits),
                                        available, grid, self.step_cost)
    counts = jnp.where(done[:, None], 0, counts)  # [R, S]
    proposed = [source.propose(params, state, counts[:, s], keys)
                for s, source in enumerate(self.chains)]
    used = []  # S x [R, N_s]: the first counts[:, s] real nodes of each source's tree
    for s, (tree, _, _) in enumerate(proposed):
      real = tree.depth > 0
      used.append(real & (jnp.cumsum(real, axis=1) <= counts[:, s, None]))
    tree, node_of = trees.merge_trees([tree for tree, _, _ in proposed], used, self.tree_budget,
                                      self.depth)
    verified = trees.verify(self.model, params["target"], state, tree, self.depth, keys,
                            state.limits.sampling, narrow=True, keep_logits=self.return_metadata)
    depth = jnp.arange(self.depth)
    trie_nodes = jnp.arange(self.tree_budget)
    # holds[r, s, m]: trie node m holds a node of source s; at[r, s, d]: one at depth d + 1
    holds = jnp.stack([(nodes[..., None] == trie_nodes).any(axis=1) for nodes in node_of], 1)
    at = jnp.stack([((nodes >= 0)[..., None] & (t.depth[..., None] == depth + 1)).any(axis=1)
                    for nodes, (t, _, _) in zip(node_of, proposed)], axis=1)
    on_path = jnp.take_along_axis(holds, jnp.maximum(verified.path, 0)[:, None, :], axis=2)
    on_path &= (verified.path >= 0)[:, None, :]  # [R, S, D]
    credited = jnp.cumprod(on_path, axis=-1).sum(axis=-1, dtype=jnp.int32)  # [R, S]
    tried = at & (depth <= credited[..., None])  # [R, S, D]
    chance = jnp.asarray(np.stack([mix_choice.step_conditional(t) for t in tables]))[
        jnp.arange(len(self.chains)), counts]  # [R, S, D]
    after = trees.commit(state, tree, verified, state.limits.sampling,
                         draft_passes=sum(passes for _, _, passes in proposed))
    fields = {}
    for s, (source, (_, scratch, _)) in enumerate(zip(self.chains, proposed)):
      fields |= source.after(params, state, after, verified, scratch, credited[:, s])
    live = ~done[:, None]
    return dataclasses.replace(
        after, expected=state.expected + jnp.where(tried, chance, 0.0),
        hits=state.hits + (depth < credited[..., None]),
        offered=state.offered + (holds & live[..., None]).sum(axis=(0, 2), dtype=jnp.int32),
        credited=state.credited + jnp.where(live, credited, 0).sum(axis=0),
        row_steps=state.row_steps + (~done).sum(dtype=jnp.int32), **fields)

  def result(self, state: MixState):
    accepted = state.accepted_at.sum()
    stats = drafting.stats(state, accepted / jnp.maximum(state.row_steps, 1))
    for s, name in enumerate(self.sources):
      stats |= {f"drafted_{name}": state.offered[s], f"accepted_{name}": state.credited[s]}
    return state.buffer, stats


def _repeats(prompt: Prompt) -> bool:
  """(host) Some prompt row holds a token twice: a 1-gram lookup can match."""
  tokens, lengths = np.asarray(prompt.tokens), np.asarray(prompt.lengths)
  return any(len(set(row[:n].tolist())) < n for row, n in zip(tokens, lengths))
