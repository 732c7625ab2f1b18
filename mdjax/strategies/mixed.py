r"""`mixed`: drafts from several sources in ONE token tree, verified in one target pass.

Every step each source proposes a chain after the last emitted token `c`
(`mdjax.strategies.mix_sources`): prompt lookup (what followed the latest earlier
occurrence of the last n-gram, in the prompt and the text emitted so far), heads of
any family (parallel heads' top-1 guesses, or a sequential head's unrolled chain,
through the family's own drafting), a draft model's greedy chain. The chains are
merged into one trie (`trees.merge_chains`: a path two sources propose is one path),
verified like any tree (`trees.verify`: greedy-exact, or lossless sampling by the tree
rule, since every chain is fixed before the target's draw), and every source then
follows the committed text, whichever source's path was kept::

    lookup   a b c                  c ── a ── b ── c         one pass over c and 6 nodes
    heads    a b d                            │    └── d
    draft    e f                              └── ...
                                    c ── e ── f              accepted: a b, then x
    credited: lookup 2, heads 2 (a b are both theirs), draft 0

Options: `sources` (a list of "prompt_lookup", "heads", "draft", in priority order:
a trie over the budget keeps the first sources' tokens; default: prompt lookup, plus
heads and a draft model when given), `prompt_lookup_num_tokens` and `max_ngram_size`
(as `prompt_lookup`), `heads` and `num_heads` (heads used by parallel heads, tokens
unrolled by a sequential head; 0: all of them, or 4), `draft` and `num_draft_tokens`
(as `speculative`), `tree_budget` (nodes verified per step, or "auto", the default),
the sampling options and `return_metadata`.

`tree_budget="auto"` (`mdjax.strategies.mix_choice`): per request, plain decoding of
the target when no mix pays by the sources' priors and the measured pass cost t(n),
and a source that costs passes and does not pay on its own is left out; per step and
row, each source's chain length from its acceptance so far in this request. With an integer
budget every source proposes its whole chain and the trie keeps its first nodes.

A source that cannot serve the request (heads trained on another model, a draft model
with another vocabulary or tokenizer, prompt lookup as the only source with no prompt
repeating a token) is an `MdjaxError` naming it, or under "auto" is left out, said in
`out.stats["left_out"]`. `out.stats` also has, per source, `drafted_<source>` (its
tokens in the trie) and `accepted_<source>` (those the target kept; a node two sources
proposed is credited to both), and the `drafting.stats` of every drafting strategy.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from mdjax.cache import KVCache
from mdjax.errors import MdjaxError, check_count
from mdjax.heads import Heads, HeadsConfig, get_family, vocab
from mdjax.strategies import drafting, mix_choice, prompt_layouts, tree_choice, trees
from mdjax.strategies.base import Limits, ModelFn, Prompt, Sampled, internal, prefill_with_hidden
from mdjax.strategies.drafting import DraftState
from mdjax.strategies.mix_choice import StepCost
from mdjax.strategies.mix_sources import DraftModel, ParallelHeads, PromptLookup, SequentialHead
from mdjax.strategies.pass_cost import pass_cost
from mdjax.strategies.registry import register
from mdjax.strategies.speculative_tree import SLOT_MULTIPLE

SOURCES = ("prompt_lookup", "heads", "draft")
DEFAULT_HEAD_STEPS = 4  # tokens a sequential head unrolls with num_heads=0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class MixState(DraftState):
  """`DraftState` (D = the longest chain; `draft`: the draft model's `DraftModelState`,
  its `pending` [R, 1 + D] wide, or None), and (S = the sources)

    history    int32[R, H] | None  prompt lookup: the prompt, then the emitted tokens
    length     int32[R] | None     tokens in `history`
    read       Any                 heads: what parallel heads read (their `Guess`'s), or a
                                   sequential head's `eagle.HeadState`; None without heads
    tried      int32[R, S, D]      steps in which source s's token d was verified with the
                                   ones before it right
    hits       int32[R, S, D]      of those, the steps it was right too
    offered    int32[S]            tokens each source had in the trie (live rows)
    credited   int32[S]            of those, the ones the target accepted
    row_steps  int32[]             verifies of live rows
  """

  history: Int[Array, "R H"] | None
  length: Int[Array, "R"] | None
  read: Any
  tried: Int[Array, "R S D"]
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
  """Chains of prompt lookup, heads and a draft model in one trie, verified in one pass."""

  name: ClassVar[str] = "mixed"
  layout: ClassVar = prompt_layouts.Plain()

  sources: tuple[str, ...] | None = None  # None: prompt lookup, and heads and draft if given
  prompt_lookup_num_tokens: int = 8
  max_ngram_size: int = 2
  heads: HeadsConfig | None = None  # `construct` turns the user's `mdjax.Heads` into its config
  num_heads: int = 0  # parallel heads used, or tokens a sequential head unrolls; 0: all, or 4
  draft: ModelFn | None = None  # `construct` turns the user's mdjax Model into its ModelFn
  num_draft_tokens: int = 4
  tree_budget: int | str = tree_choice.AUTO  # nodes verified per step, or "auto"
  return_metadata: bool = False  # per-token metadata (`mdjax.strategies.metadata`)
  step_cost: StepCost | None = internal()  # set by `auto`: chain lengths chosen per step

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

  @functools.cached_property
  def chains(self) -> tuple:
    """The source objects (`mix_sources`), in `sources` order."""
    made = {}
    for name in self.sources:
      if name == "prompt_lookup":
        made[name] = PromptLookup(cap=self.prompt_lookup_num_tokens,
                                  max_ngram_size=self.max_ngram_size)
      elif name == "heads" and self.sequential:
        made[name] = SequentialHead(heads=self.heads, target=self.model,
                                    cap=self.num_heads or DEFAULT_HEAD_STEPS)
      elif name == "heads":
        made[name] = ParallelHeads(heads=self.heads, target=self.model,
                                   cap=self.num_heads or self.heads.num_heads)
      else:
        made[name] = DraftModel(draft=self.draft, cap=self.num_draft_tokens)
    return tuple(made[name] for name in self.sources)

  @property
  def depth(self) -> int:
    """The longest chain: the deepest a trie goes."""
    return max(source.cap for source in self.chains)

  @property
  def prior(self) -> np.ndarray:
    """`[S, D]` each source's prior accuracy per depth (`mix_choice.conditional`)."""
    return np.asarray([mix_choice.conditional(source.prior(), self.depth)
                       for source in self.chains], np.float32)

  def _step_cost(self, params, cost, nodes: int) -> StepCost:
    costs = [source.fixed_and_per_token(params, cost, self.depth) for source in self.chains]
    return StepCost.of(cost, nodes, sum(fixed for fixed, _ in costs), [c for _, c in costs])

  def for_request(self, params, prompt: Prompt, capacity: int) -> Sampled:
    """Under "auto" (module docstring): plain decoding, or the sources that pay, the
    trie's width and the step costs the compiled step chooses lengths by."""
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
    nodes = min(sum(source.cap for source in self.chains), mix_choice.MAX_NODES)
    choice = mix_choice.request_choice(  # the best mix, against plain decoding
        self.prior, [source.cap for source in self.chains], nodes,
        self._step_cost(params, cost, nodes), batch, allow_plain=not self.return_metadata)
    if self.sources == ("prompt_lookup",) and "prompt_lookup" in left_out:
      choice = mix_choice.RequestChoice(lengths=(0,), tokens_per_pass=1.0, speedup=1.0)
    stats = {"left_out": left_out, "expected_tokens_per_pass": choice.tokens_per_pass,
             "expected_speedup": choice.speedup, **cost.stats()}
    kept = []
    for s, source in enumerate(self.chains):
      fixed, per_token = source.fixed_and_per_token(params, cost, self.depth)
      alone = mix_choice.request_choice(  # its best lengths on its own, margin or not
          self.prior[s:s + 1], [source.cap], source.cap,
          StepCost.of(cost, source.cap, fixed, [per_token]), batch, allow_plain=False)
      if (fixed, per_token) == (0, 0) or alone.speedup >= tree_choice.MIN_GAIN:
        kept.append(source.name)
      else:
        left_out[source.name] = (f"does not pay here: on its own its profile promises "
                                 f"{alone.speedup:.2f}x plain decoding at best")
    kept = tuple(kept)
    if choice.plain or not kept:
      plain = tree_choice.plain_decoding(self, params, prompt, capacity, tree_choice.Choice(
          budget=0, depth=0, top_k=0, tokens_per_pass=1.0, speedup=1.0, cost=cost))
      return dataclasses.replace(plain, request_stats={**plain.request_stats, **stats})
    mix = dataclasses.replace(self, sources=kept, heads=self.heads if "heads" in kept else None,
                              draft=self.draft if "draft" in kept else None)
    nodes = min(sum(source.cap for source in mix.chains), mix_choice.MAX_NODES)
    step_cost = mix._step_cost(params, cost, nodes)
    choice = mix_choice.request_choice(mix.prior, [source.cap for source in mix.chains], nodes,
                                       step_cost, batch, allow_plain=False)
    return dataclasses.replace(
        mix, tree_budget=nodes, step_cost=step_cost,
        request_stats={**stats, "tree_choice": "mix", "tree_budget": nodes, "sources": kept,
                       "expected_tokens_per_pass": choice.tokens_per_pass,
                       "expected_speedup": choice.speedup})

  @property
  def auto(self) -> bool:
    return self.tree_budget == tree_choice.AUTO

  def cache_slots(self, prompt_len: int, capacity: int, branches: int = 1) -> int:
    """The padded prompt, the generated tokens, and room for one trie (or one chain in
    a drafter's own cache)."""
    slots = prompt_len + capacity + 2 + max(self.tree_budget, self.depth)
    return -(-slots // SLOT_MULTIPLE) * SLOT_MULTIPLE

  def init(self, params, prompt: Prompt, cache: KVCache, limits: Limits,
           capacity: int) -> MixState:
    logits, hidden, target_cache, topology = prefill_with_hidden(self.model, params["target"],
                                                                 prompt, cache)
    rows, sources, depth = prompt.tokens.shape[0], len(self.sources), self.depth
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    state = drafting.start(
        MixState, self.model, None, params, prompt, cache, limits, capacity, self.sampling,
        positions=depth, return_metadata=self.return_metadata,
        prefilled=(logits, target_cache, topology), history=None, length=None, read=None,
        tried=zeros(rows, sources, depth), hits=zeros(rows, sources, depth),
        offered=zeros(sources), credited=zeros(sources), row_steps=zeros())
    fields = {}
    for source in self.chains:
      fields |= source.start(params, prompt=prompt, hidden=hidden, cache=target_cache,
                             first=state.last, capacity=capacity, depth=depth, topology=topology)
    return dataclasses.replace(state, **fields)

  def step(self, params, state: MixState) -> MixState:
    keys, done = drafting.step_keys(state), state.buffer.done
    available = jnp.stack([source.available(state) for source in self.chains], axis=1)  # [R, S]
    lengths = available
    if self.step_cost is not None:
      grid = mix_choice.length_grid([source.cap for source in self.chains], self.tree_budget)
      accuracy = mix_choice.estimate(jnp.asarray(self.prior), state.tried, state.hits)
      lengths = mix_choice.choose_lengths(accuracy, available, grid, self.step_cost)
    lengths = jnp.where(done[:, None], 0, lengths)  # [R, S]
    proposed = [source.propose(params, state, lengths[:, s], keys)
                for s, source in enumerate(self.chains)]
    tree, node_of = trees.merge_chains([(tokens, lengths[:, s])
                                        for s, (tokens, _, _) in enumerate(proposed)],
                                       self.tree_budget)  # node_of [R, S, D]
    verified = trees.verify(self.model, params["target"], state, tree, self.depth, keys,
                            self.sampling, narrow=True)
    in_trie = node_of >= 0
    on_path = in_trie & (node_of == verified.path[:, None, :])
    credited = jnp.cumprod(on_path, axis=-1).sum(axis=-1, dtype=jnp.int32)  # [R, S]
    depth = jnp.arange(self.depth)
    after = trees.commit(state, tree, verified, self.sampling,
                         draft_passes=sum(passes for _, _, passes in proposed))
    fields = {}
    for s, (source, (_, scratch, _)) in enumerate(zip(self.chains, proposed)):
      fields |= source.after(params, state, after, verified, scratch, credited[:, s])
    return dataclasses.replace(
        after, tried=state.tried + (in_trie & (depth <= credited[..., None])),
        hits=state.hits + (depth < credited[..., None]),
        offered=state.offered + in_trie.sum(axis=(0, 2), dtype=jnp.int32),
        credited=state.credited + credited.sum(axis=0), row_steps=state.row_steps + (~done).sum(
            dtype=jnp.int32), **fields)

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
