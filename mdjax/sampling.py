"""Logits processors and token choice, shared by every strategy.

Processors run in Hugging Face's order: temperature, top-k, top-p, min-p. A
removed token gets logit -inf, so `jax.nn.softmax(process_logits(...))` is the
distribution a strategy samples from (and the `p`/`q` of speculative acceptance).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mdjax import platform
from mdjax.errors import MdjaxError, check_count, check_real


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p")
FILTERS = ("top_k", "top_p", "min_p")  # the processors after temperature, in their order


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """One row's sampling values, validated (host side). temperature 0 means greedy
  (argmax); top_k 0, top_p 1 and min_p 0 disable a filter."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    check_real("temperature", self.temperature, minimum=0)
    for name in ("top_p", "min_p"):
      check_real(name, getattr(self, name))
    check_count("top_k", self.top_k, 0)
    if not 0 < self.top_p <= 1:
      raise MdjaxError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0 <= self.min_p <= 1:
      raise MdjaxError(f"min_p must be in [0, 1], got {self.min_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def filters(self) -> tuple[str, ...]:
    """The filters that remove tokens with these values."""
    off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
    return tuple(name for name in FILTERS if getattr(self, name) != off[name])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """How a run draws its tokens, as a jitted program sees it: which processors run
  (static: they shape the program) and their values (data: one per output row, so a
  new temperature, top_k, top_p or min_p never recompiles).

    greedy       bool (static)         argmax; the values are not read
    filters      tuple[str] (static)   the filters that run (`FILTERS`, in order)
    temperature  float32[R]            > 0 when sampling
    top_k        int32[R]              tokens kept (the vocabulary where off)
    top_p        float32[R]            1 where off
    min_p        float32[R]            0 where off

  A processor broadcasts a row's value over the logits' middle axes: logits
  [R, ..., V] (the rows first, e.g. [R, D, V] for the positions of a draft chain).
  """

  temperature: Float[Array, "R"]
  top_k: Int[Array, "R"]
  top_p: Float[Array, "R"]
  min_p: Float[Array, "R"]
  greedy: bool = dataclasses.field(metadata=dict(static=True))
  filters: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def of(cls, rows: list[SamplingParams], vocab_size: int) -> "Sampling":
    """The values of `rows` (one `SamplingParams` per output row) as data."""
    greedy, filters = program_shape(rows)
    column = lambda name, dtype: jnp.asarray([getattr(row, name) for row in rows], dtype)
    top_k = [min(row.top_k or vocab_size, vocab_size) for row in rows]
    return cls(temperature=column("temperature", jnp.float32),
               top_k=jnp.asarray(top_k, jnp.int32), top_p=column("top_p", jnp.float32),
               min_p=column("min_p", jnp.float32), greedy=greedy, filters=filters)

  @classmethod
  def argmax(cls) -> "Sampling":
    """Greedy choice, for a draft that always proposes its argmax."""
    zero = jnp.zeros((), jnp.float32)
    return cls(temperature=zero, top_k=jnp.zeros((), jnp.int32), top_p=zero, min_p=zero,
               greedy=True, filters=())


def program_shape(rows: list[SamplingParams]) -> tuple[bool, tuple[str, ...]]:
  """What the values of `rows` decide about the program: greedy or not (every row
  samples or every row is greedy), and the filters some row uses."""
  modes = {row.greedy for row in rows}
  if len(modes) > 1:
    raise MdjaxError("temperature must be 0 in every row or in none: a greedy row and a "
                     "sampled row run different programs (make two calls)")
  return modes.pop(), tuple(name for name in FILTERS if any(name in row.filters for row in rows))


def per_row(value, like: Array) -> Array:
  """`value` (a scalar, or one per row [R]) broadcastable against `like` [R, ...]."""
  value = jnp.asarray(value)
  if value.ndim == 0:
    return value
  if value.shape[0] != like.shape[0]:
    raise ValueError(f"{value.shape[0]} row values for {like.shape[0]} rows of {like.shape}")
  return value.reshape(value.shape + (1,) * (like.ndim - 1))


def process_logits(logits: Float[Array, "R ... V"],
                   params: SamplingParams | Sampling) -> Float[Array, "R ... V"]:
  """Temperature-scaled float32 logits with filtered-out tokens at -inf (the values
  per row for a `Sampling`)."""
  logits = logits.astype(jnp.float32)
  if params.greedy:
    return logits
  logits = logits / per_row(params.temperature, logits)
  if "top_k" in params.filters:
    top_k = per_row(params.top_k, logits)
    logits = jnp.where(logits < kth_largest(logits, top_k), -jnp.inf, logits)
  if "top_p" in params.filters:
    logits = _top_p(logits, per_row(params.top_p, logits))
  if "min_p" in params.filters:
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = per_row(params.min_p, logits) * probs.max(axis=-1, keepdims=True)
    logits = jnp.where(probs < threshold, -jnp.inf, logits)
  return logits


def log_softmax(logits: Float[Array, "... V"]) -> Float[Array, "... V"]:
  """float32 log-softmax over the last axis (`logits - log_normalizer(logits)`)."""
  x = logits.astype(jnp.float32)
  if platform.current() != "gpu":
    return jax.nn.log_softmax(x, axis=-1)
  return x - log_normalizer(x)


def log_normalizer(logits: Float[Array, "... V"]) -> Float[Array, "... 1"]:
  """float32 log of the sum of exponentials over the last axis (what log-softmax
  subtracts).

  Built for a GPU, its max and sum of exponentials are found in one pass (an online
  reduction of (max, sum) pairs, as flash attention's): XLA:GPU reduces few long rows in
  two stages each, so `jax.nn.log_softmax`'s max, then sum, are 4 kernels and this 2.
  Elsewhere `jax.nn.logsumexp`: XLA:CPU runs the pairs' reduction element by element,
  ~5x its time (150 us against 32 at 4 x 4096). The same values up to float32 rounding."""
  x = logits.astype(jnp.float32)
  if platform.current() != "gpu":
    return jax.nn.logsumexp(x, axis=-1, keepdims=True)

  def merge(a, b):  # (max, sum of exp(x - max)) of two parts -> of both
    (max_a, sum_a), (max_b, sum_b) = a, b
    top = jnp.maximum(max_a, max_b)
    finite = jnp.where(jnp.isfinite(top), top, 0.0)  # all -inf so far: sums stay 0
    return top, sum_a * jnp.exp(max_a - finite) + sum_b * jnp.exp(max_b - finite)

  top, total = jax.lax.reduce((x, jnp.ones_like(x)), (jnp.float32(-jnp.inf), jnp.float32(0)),
                              merge, (x.ndim - 1,))  # [...]
  return (top + jnp.log(total))[..., None]


def kth_largest(x: Float[Array, "... V"], k: int | Int[Array, "... 1"]) -> Float[Array, "... 1"]:
  """The k-th largest value of each row of float32 `x` (duplicates counted), exactly;
  `k` one count, or one per row (data: e.g. `Sampling.top_k`, 1 <= k <= V).

  Built for a GPU: `jax.lax.top_k(x, k)[0][..., -1:]` for one static k, one or two
  kernels; for counts as data, the row sorted once and read at V - k. Elsewhere by
  32 bisection steps over float32's order-preserving integer keys: 32 compare-and-count
  passes over the row; inside a decode program XLA:CPU's top_k with k = 64 over a 49k
  vocabulary costs more than the model's whole pass at batch 64 (10 ms a row; these
  passes: well under 1), while on a GPU the 32 steps are ~7 kernels each (224 of a
  sampled step's 397 at the 1B shape). Both give the same threshold for `x < kth`: they
  differ only where the k-th value is a zero (-0.0 against 0.0), which compare equal."""
  if platform.current() == "gpu":
    if isinstance(k, int):
      return jax.lax.top_k(x.astype(jnp.float32), k)[0][..., -1:]
    ascending = jnp.sort(x.astype(jnp.float32), axis=-1)
    at = jnp.broadcast_to(x.shape[-1] - k, x.shape[:-1] + (1,))
    return jnp.take_along_axis(ascending, at, axis=-1)
  keys = _order_keys(x)
  low = jnp.full((*x.shape[:-1], 1), jnp.iinfo(jnp.int32).min, jnp.int32)  # count >= k
  high = jnp.full((*x.shape[:-1], 1), jnp.iinfo(jnp.int32).max, jnp.int32)

  def halve(_, bounds):
    low, high = bounds
    middle = (low >> 1) + (high >> 1) + ((low | high) & 1)  # ceil((low + high) / 2)
    enough = jnp.sum(keys >= middle, axis=-1, keepdims=True) >= k
    return jnp.where(enough, middle, low), jnp.where(enough, high, middle - 1)

  kth, _ = jax.lax.fori_loop(0, 32, halve, (low, high))
  return jax.lax.bitcast_convert_type(jnp.where(kth < 0, kth ^ 0x7FFFFFFF, kth), jnp.float32)


def _order_keys(x: Float[Array, "..."]) -> Int[Array, "..."]:
  """float32's order-preserving int32 keys of `x` (-0.0 below 0.0): the order `jnp.sort`
  sorts floats in."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32, increasing with x


def _top_p(logits: Float[Array, "... V"], top_p: float | Float[Array, "... 1"]
           ) -> Float[Array, "... V"]:
  """Keeps the smallest most-likely set whose probability reaches top_p (at least one;
  every token where top_p is 1: a sum rounded below 1 drops nothing). Tokens are ranked
  by logit, ties by index (the lower first): at a tie across the boundary the lower
  indices are kept."""
  if platform.current() == "gpu":
    return _top_p_sorted_once(logits, top_p)
  order = jnp.argsort(-logits, axis=-1)  # [..., V] most likely first
  sorted_probs = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), order, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # exclusive cumsum
  keep_sorted = mass_before < top_p  # the most likely token always: 0 < top_p
  keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1,
                            inplace=False)
  return jnp.where(keep | (top_p >= 1), logits, -jnp.inf)


def _top_p_sorted_once(logits: Float[Array, "... V"], top_p: float | Float[Array, "... 1"]
                       ) -> Float[Array, "... V"]:
  """`_top_p`'s set by one sort and no scatter (a GPU's way): the kept tokens are a
  prefix of the ranking, so they are those ranked no lower than the last kept one,
  compared by (logit's order key, index) as `jnp.argsort`'s stable ranking orders them."""
  down = ~_order_keys(logits)  # [..., V] int32, decreasing with the logit (no overflow)
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  ranked_down, ranked_index, sorted_probs = jax.lax.sort(
      (down, index, jax.nn.softmax(logits, axis=-1)), dimension=logits.ndim - 1, num_keys=2)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # exclusive cumsum
  last = (mass_before < top_p).sum(axis=-1, keepdims=True) - 1  # [..., 1] >= 0: 0 < top_p
  last_down = jnp.take_along_axis(ranked_down, last, axis=-1)
  last_index = jnp.take_along_axis(ranked_index, last, axis=-1)
  keep = (down < last_down) | ((down == last_down) & (index <= last_index)) | (top_p >= 1)
  return jnp.where(keep, logits, -jnp.inf)


def choose(keys: jax.Array, logits: Float[Array, "B V"],
           params: SamplingParams | Sampling) -> Int[Array, "B"]:
  """Argmax when greedy, else one sample per row from its own key (`keys`: [B])."""
  return draw(keys, process_logits(logits, params), params.greedy)


def draw(keys: jax.Array, processed: Float[Array, "B V"], greedy: bool) -> Int[Array, "B"]:
  """`choose` from logits `process_logits` already processed (a caller that reads them
  again, for log-probabilities, processes them once)."""
  if greedy:
    return jnp.argmax(processed, axis=-1).astype(jnp.int32)
  return jax.vmap(jax.random.categorical)(keys, processed).astype(jnp.int32)


def row_keys(key: jax.Array, rows: Int[Array, "B"], steps: Int[Array, "B"]) -> jax.Array:
  """Independent keys per (row, step): a row's randomness does not depend on the batch."""
  return jax.vmap(lambda r, s: jax.random.fold_in(jax.random.fold_in(key, r), s))(rows, steps)


def greedy_accept(proposal: Int[Array, "B D"], count: Int[Array, "B"],
                  choice: Int[Array, "B D+1"]) -> Int[Array, "B"]:
  """How many leading proposed tokens equal the target's argmax `choice` (the
  target's choice after the last emitted token, then after each proposed token).

  The tokens to emit are then `choice[:, :accepted + 1]`: the accepted proposal
  (equal to the target's choices) and the target's own next token, which is
  exactly what greedy decoding would have produced.
  """
  agree = (proposal == choice[:, :-1]) & (jnp.arange(proposal.shape[1]) < count[:, None])
  # a running AND over the D columns, unrolled (D is a draft's length: small): elementwise,
  # so on a GPU it fuses into what reads it; a cumulative product is a reduction, a kernel
  still, accepted = jnp.ones(agree.shape[:1], jnp.bool_), jnp.zeros(agree.shape[:1], jnp.int32)
  for column in range(agree.shape[1]):
    still = still & agree[:, column]
    accepted = accepted + still
  return accepted


def speculative_accept(keys: jax.Array, chain: Int[Array, "B D"], count: Int[Array, "B"],
                       q: Float[Array, "B D V"], p: Float[Array, "B D+1 V"]
                       ) -> tuple[Int[Array, "B"], Int[Array, "B"]]:
  """The speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023).

  `chain[b, :count[b]]` was sampled from the draft's distributions `q`; `p[:, i]`
  is the target's distribution after the emitted prefix and `chain[:, :i]`. Token
  i is kept with probability min(1, p_i(x) / q_i(x)); at the first rejection the
  next token is drawn from norm(max(0, p_i - q_i)); when all `count` tokens are
  kept, it is drawn from `p[:, count]` (the bonus token). Every emitted token is
  then distributed exactly as sampling the target alone. Returns (accepted [B],
  next_token [B]): emit `chain[:, :accepted]`, then `next_token`.
  """
  accept_keys, next_keys = jax.vmap(lambda k: tuple(jax.random.split(k)))(keys)
  uniform = jax.vmap(lambda k: jax.random.uniform(k, chain.shape[1:]))(accept_keys)  # [B, D]
  p_token = jnp.take_along_axis(p[:, :-1], chain[..., None], axis=-1)[..., 0]  # [B, D]
  q_token = jnp.take_along_axis(q, chain[..., None], axis=-1)[..., 0]
  keep = (uniform * q_token < p_token) & (jnp.arange(chain.shape[1]) < count[:, None])
  accepted = jnp.cumprod(keep, axis=1).sum(axis=1, dtype=jnp.int32)  # [B]
  p_next = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
  q_next = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), accepted[:, None, None],
                               axis=1)[:, 0]  # [B, V]; zeros at the bonus position
  rejected = (accepted < count)[:, None]
  residual = jnp.where(rejected, jnp.maximum(p_next - q_next, 0.0), p_next)
  # A rejection implies p_next != q_next, so the residual has mass; guard rounding anyway.
  residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_next)
  next_token = jax.vmap(jax.random.categorical)(next_keys, jnp.log(residual))
  return accepted, next_token.astype(jnp.int32)


def tree_accept(keys: jax.Array, tokens: Int[Array, "B N"], parent: Int[Array, "B N"],
                p: Float[Array, "B N+1 V"], depth: int
                ) -> tuple[Int[Array, "B D"], Int[Array, "B"]]:
  """The multi-candidate rule: walk a draft token tree from its root.

  Node n holds `tokens[:, n]` under node `parent[:, n]` (-1: the root), at most
  `depth` levels deep, a node's children in the order they are tried (the draft's
  rank); `p[:, 0]` is the target's distribution at the root, `p[:, 1 + n]` after
  node n. At the current node the children c_1, c_2, ... are tried in turn: c_i is
  accepted with probability p_i(c_i), where p_i is p with c_1 .. c_{i-1} zeroed and
  renormalised; the walk moves to the first accepted child. When every child is
  rejected (or there is none), the next token is drawn from p with all the node's
  children zeroed. For a draft whose children are fixed tokens (a deterministic
  top-k, q = 1), every emitted token is distributed exactly as p. A one-hot p (the
  target's argmax) is greedy verification: it accepts the child equal to the argmax,
  then emits the argmax. Returns (path [B, depth]: the accepted node per level, -1
  past the accepted ones; next_token [B]).
  """
  batch, num_nodes = tokens.shape
  rows = jnp.arange(batch)
  try_keys, next_keys = jax.vmap(lambda k: tuple(jax.random.split(k)))(keys)
  uniform = jax.vmap(lambda k: jax.random.uniform(k, (num_nodes,)))(try_keys)  # [B, N] a try each

  def children(node: Int[Array, "B"]):
    """p after `node` [B, V], its children [B, N] and their target probabilities [B, N]."""
    p_node = p[rows, node + 1]  # [B, V]
    child = parent == node[:, None]  # [B, N]
    return p_node, child, jnp.where(child, jnp.take_along_axis(p_node, tokens, axis=1), 0.0)

  def level(carry, _):
    node, walking = carry  # [B] current node (-1: root), [B] still accepting
    p_node, child, p_child = children(node)
    rest = p_node.sum(-1, keepdims=True) - (jnp.cumsum(p_child, axis=1) - p_child)  # [B, N]
    hit = child & (uniform * rest < p_child) & walking[:, None]  # mass left after earlier tries
    found = hit.any(axis=1)
    node = jnp.where(found, jnp.argmax(hit, axis=1).astype(jnp.int32), node)
    return (node, found), jnp.where(found, node, -1)

  start = (jnp.full((batch,), -1, jnp.int32), jnp.ones((batch,), jnp.bool_))
  # unrolled on a GPU, where a loop's every trip is a few kernels of its own (the CPU,
  # which launches nothing, keeps the loop: a smaller program to compile)
  (node, _), path = jax.lax.scan(level, start, length=depth,
                                 unroll=not platform.is_cpu())  # path [D, B]
  p_node, child, _ = children(node)
  residual = jnp.where(_holds(tokens, child, p_node.shape[-1]), 0.0, p_node)  # [B, V]
  # The last rejected child left mass elsewhere, so the residual has some; guard rounding.
  residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_node)
  next_token = jax.vmap(jax.random.categorical)(next_keys, jnp.log(residual))
  return path.T, next_token.astype(jnp.int32)


def with_ancestors(passes: Bool[Array, "B N"], parent: Int[Array, "B N"], depth: int
                   ) -> Bool[Array, "B N"]:
  """Which nodes of a tree at most `depth` levels deep pass with every ancestor: node n
  when `passes[n]` and its parent (`parent[n]`: a node index, negative under the root)
  does, settled in `depth - 1` rounds of elementwise reads (after i rounds, right for the
  nodes i + 1 levels deep): no walk, no reduction (on a GPU it fuses into what reads it)."""
  under_root, up = parent < 0, jnp.maximum(parent, 0)  # every index in bounds: no checks
  accepted = passes
  for _ in range(depth - 1):
    accepted = passes & (under_root | jnp.take_along_axis(accepted, up, axis=1,
                                                          mode="promise_in_bounds"))
  return accepted


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
  accepted = with_ancestors(passes, parent, depth)
  under_root, up = parent < 0, jnp.maximum(parent, 0)
  level = jnp.ones_like(parent)
  for _ in range(depth - 1):  # after i rounds, right for the nodes i + 1 levels deep
    level = jnp.where(under_root, 1, 1 + jnp.take_along_axis(level, up, axis=1))
  best = jnp.argmax(jnp.where(accepted, level, 0), axis=1)  # [B] the first deepest
  node = jnp.where(accepted[rows, best], best, -1).astype(jnp.int32)
  last = node
  path = jnp.full((batch, depth), -1, jnp.int32)
  for _ in range(depth):  # from the accepted node up to the root, one level per round
    path = path.at[rows, jnp.where(node >= 0, level[rows, node] - 1, depth)].set(node, mode="drop")
    node = jnp.where(node >= 0, parent[rows, jnp.maximum(node, 0)], -1)
  next_token = jax.vmap(jax.random.categorical)(keys, jnp.log(p[rows, last + 1]))
  return path, next_token.astype(jnp.int32)

def _holds(tokens: Int[Array, "B N"], chosen: Bool[Array, "B N"], vocab: int
           ) -> Bool[Array, "B V"]:
  """Which tokens some chosen node holds."""
  rows = jnp.arange(tokens.shape[0])[:, None]
  return jnp.zeros((tokens.shape[0], vocab), jnp.bool_).at[
      rows, jnp.where(chosen, tokens, vocab)].set(True, mode="drop")
