"""The controls a request sets beside its strategy, named as transformers names them,
and the logits processors that apply them.

    repetition_penalty   > 0: a token seen in the prompt or the generated text has its
                         logit divided by it (multiplied when negative)
    presence_penalty     OpenAI's: subtracted once from a token generated before
    frequency_penalty    OpenAI's: subtracted per time a token was generated
    no_repeat_ngram_size n: a token that would repeat an n-gram of the text is banned
    bad_words_ids        token sequences never generated (the last token of one is
                         banned where the text ends with the others)
    logit_bias           {token id: bias} added to the logits
    min_new_tokens       the EOS ids are banned before this many tokens
    stop_strings         a row ends after the token that completes one (`stop_strings`)
    logprobs, top_logprobs   each generated token's log-probability (and the k best)

The processors run in transformers' order (`PROCESSORS`), before the sampling values
(`mdjax.sampling.process_logits`: temperature, top_k, top_p, min_p):

    logit_bias -> repetition_penalty -> presence / frequency -> no_repeat_ngram_size
      -> bad_words_ids -> min_new_tokens -> temperature -> top_k -> top_p -> min_p

(presence and frequency penalties are vLLM's, beside the repetition penalty, which
transformers does not have.) The values are data, one per output row where per-row
(`Controls`); what shapes the program (which controls are on, the n-gram size, the
bad words' shape, the number of stop strings, the count of top log-probabilities) is
static, so a new value never recompiles.

A column of logits is processed with the text it continues: the row's prompt, its
generated tokens, then (for a draft's positions) the drafted tokens before it,
`Context`. Chains and trees verify their drafts with exactly the distribution plain
decoding would use at that point, so every lossless strategy stays lossless.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from mdjax.errors import MdjaxError, check_count
from mdjax.sampling import per_row
from mdjax.stop_strings import StopStrings

PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
CONTROL_OPTIONS = PENALTIES + ("no_repeat_ngram_size", "bad_words_ids", "logit_bias",
                               "min_new_tokens", "stop_strings", "logprobs", "top_logprobs")
PROCESSORS = ("logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty",
              "no_repeat_ngram_size", "bad_words_ids", "min_new_tokens")


def static(default=None):
  return dataclasses.field(default=default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Controls:
  """A request's controls as a jitted program sees them (None: off).

    repetition_penalty  float32[R]   1 in a row without one
    presence_penalty    float32[R]   0 in a row without one
    frequency_penalty   float32[R]
    bias                float32[V]   logit_bias (0 elsewhere)
    banned              bool[V]      bad words of one token
    bad_words           int32[W, L]  bad words of 2+ tokens, right-aligned (-1 before)
    min_new_tokens      int32[R]
    prompt              int32[R, P]  each output row's prompt, right-aligned (-1 before):
                                     what the repetition penalty, n-grams and bad words read
    stops               StopStrings  the stop strings' tables
    stop_tail           int32[R, W]  each output row's last prompt tokens, where a stop
                                     string may begin (`StopStrings.prompt_tail`)
    ngram               int (static) no_repeat_ngram_size (0: off)
    logprobs            int (static) -1: off; else top_logprobs (0: the chosen token's only)
  """

  repetition_penalty: Float[Array, "R"] | None = None
  presence_penalty: Float[Array, "R"] | None = None
  frequency_penalty: Float[Array, "R"] | None = None
  bias: Float[Array, "V"] | None = None
  banned: Bool[Array, "V"] | None = None
  bad_words: Int[Array, "W L"] | None = None
  min_new_tokens: Int[Array, "R"] | None = None
  prompt: Int[Array, "R P"] | None = None
  stops: StopStrings | None = None
  stop_tail: Int[Array, "R W"] | None = None
  ngram: int = static(0)
  logprobs: int = static(-1)

  @property
  def processes(self) -> bool:
    """Whether any processor changes the logits."""
    return any(x is not None for x in (self.repetition_penalty, self.presence_penalty,
                                       self.frequency_penalty, self.bias, self.banned,
                                       self.bad_words, self.min_new_tokens)) or self.ngram > 0

  def on(self) -> tuple[str, ...]:
    """The controls this request sets (to refuse those a strategy does not honor)."""
    names = [name for name in PENALTIES + ("min_new_tokens",) if getattr(self, name) is not None]
    names += ["logit_bias"] * (self.bias is not None)
    names += ["bad_words_ids"] * (self.banned is not None or self.bad_words is not None)
    names += ["no_repeat_ngram_size"] * (self.ngram > 0)
    names += ["stop_strings"] * (self.stops is not None)
    names += ["logprobs"] * (self.logprobs >= 0)
    return tuple(names)


# ----------------------------------------------------------------------- building (host)

def build(options: dict, *, vocab_size: int, tokenizer, num_prompts: int, branches: int,
          row_prompts, max_new_tokens: int, eos_ids: tuple[int, ...] = ()) -> Controls | None:
  """The controls of `options` (every name in `CONTROL_OPTIONS` it holds), validated:
  one clear line naming the option for bad input. Per-row values (a list, one per
  prompt) repeat over each prompt's `branches` output rows; `row_prompts()`: the prompt
  tokens each output row continues (context and question). A bad word that is one EOS id
  is dropped, as transformers drops it (`min_new_tokens` is how to hold EOS back). None
  when none is set."""
  if not options:
    return None
  rows = num_prompts * branches
  values = {}
  for name in PENALTIES:
    if options.get(name) is not None:
      values[name] = _per_row(name, options[name], num_prompts, branches,
                              positive=name == "repetition_penalty")
  bias = banned = bad_words = None
  if options.get("logit_bias") is not None:
    bias = np.zeros(vocab_size, np.float32)
    given = options["logit_bias"]
    if not isinstance(given, dict):
      raise MdjaxError(f"logit_bias must be a dict {{token id: bias}}, got {given!r}")
    for token, value in given.items():
      _check_token("logit_bias", token, vocab_size)
      if not isinstance(value, numbers.Real) or isinstance(value, bool) or np.isnan(value):
        raise MdjaxError(f"logit_bias of token {token} must be a number, got {value!r}")
      bias[int(token)] = value
  if options.get("bad_words_ids") is not None:
    banned, bad_words = _bad_words(options["bad_words_ids"], vocab_size, eos_ids)
  ngram = options.get("no_repeat_ngram_size") or 0
  check_count("no_repeat_ngram_size", ngram, 0)
  minimum = None
  if options.get("min_new_tokens") is not None:
    check_count("min_new_tokens", options["min_new_tokens"], 0)
    if options["min_new_tokens"] > max_new_tokens:
      raise MdjaxError(f"min_new_tokens ({options['min_new_tokens']}) is above max_new_tokens "
                       f"({max_new_tokens})")
    minimum = jnp.full((rows,), options["min_new_tokens"], jnp.int32)
  logprobs = -1
  if options.get("logprobs") or options.get("top_logprobs"):
    top = options.get("top_logprobs") or 0
    check_count("top_logprobs", top, 0)
    if top > vocab_size:
      raise MdjaxError(f"top_logprobs ({top}) is above the vocabulary size ({vocab_size})")
    logprobs = top
  elif options.get("logprobs") not in (None, False):
    raise MdjaxError(f"logprobs must be True or False, got {options['logprobs']!r}")
  stops = stop_tail = None
  if options.get("stop_strings") is not None:
    stops = StopStrings.build(tokenizer, options["stop_strings"], vocab_size)
    stop_tail = stops.prompt_tail(row_prompts())
  needs_prompt = "repetition_penalty" in values or ngram or bad_words is not None
  return Controls(
      **{name: jnp.asarray(v, jnp.float32) for name, v in values.items()},
      bias=None if bias is None else jnp.asarray(bias),
      banned=None if banned is None else jnp.asarray(banned),
      bad_words=None if bad_words is None else jnp.asarray(bad_words),
      min_new_tokens=minimum, prompt=_right_aligned(row_prompts()) if needs_prompt else None,
      stops=stops, stop_tail=stop_tail, ngram=ngram, logprobs=logprobs)


def _per_row(name: str, value, num_prompts: int, branches: int, positive: bool) -> np.ndarray:
  """One float per output row from one value or one per prompt, checked."""
  many = isinstance(value, (list, tuple))
  given = list(value) if many else [value] * num_prompts
  if len(given) != num_prompts:
    raise MdjaxError(f"{name} has {len(given)} values for {num_prompts} prompts: give one "
                     "value, or one per prompt")
  for v in given:
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not np.isfinite(v):
      raise MdjaxError(f"{name} must be a finite number, got {v!r}")
    if positive and v <= 0:
      raise MdjaxError(f"{name} must be > 0 (1 is off), got {v!r}")
  return np.repeat(np.asarray(given, np.float32), branches)


def _check_token(option: str, token, vocab_size: int) -> None:
  if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or not (
      0 <= token < vocab_size):
    raise MdjaxError(f"{option}: {token!r} is not a token id in [0, {vocab_size})")


def _bad_words(words, vocab_size: int, eos_ids: tuple[int, ...]
               ) -> tuple[np.ndarray | None, np.ndarray | None]:
  """bool[V] for the one-token words but the EOS ids, int32[W, L] for the longer ones
  (right-aligned)."""
  if not isinstance(words, (list, tuple)) or not words or not all(
      isinstance(w, (list, tuple)) and w for w in words):
    raise MdjaxError(f"bad_words_ids must be a non-empty list of non-empty token id lists, "
                     f"got {words!r}")
  for word in words:
    for token in word:
      _check_token("bad_words_ids", token, vocab_size)
  single = [w[0] for w in words if len(w) == 1 and w[0] not in eos_ids]
  longer = [list(w) for w in words if len(w) > 1]
  banned = None
  if single:
    banned = np.zeros(vocab_size, bool)
    banned[single] = True
  return banned, (_right_aligned(longer) if longer else None)


def _right_aligned(lists: list[list[int]]) -> Int[Array, "N L"]:
  """int32[N, L]: each list at the end of its row, -1 before it."""
  width = max(1, max(len(x) for x in lists))
  out = np.full((len(lists), width), -1, np.int32)
  for i, x in enumerate(lists):
    if x:
      out[i, width - len(x):] = x
  return jnp.asarray(out)


# ----------------------------------------------------------------- processing (device)

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
  """The text each column of logits continues, for output row r:

    generated  int32[R, N]     the row's generated tokens (-1 past `count`)
    count      int32[R]
    path       int32[R, T, E]  for column t, the drafted tokens between the generated
                               text and it, in order (-1 after `path_len`)
    path_len   int32[R, T]

  Plain decoding feeds no drafts (E = 0). A chain's column t continues the chain's
  first t tokens; a tree node's, the nodes on its path::

      prompt | generated          | path of column t   -> the logits of column t
      a b c  | d e                | x0 x1              -> after "a b c d e x0 x1"
  """

  generated: Int[Array, "R N"]
  count: Int[Array, "R"]
  path: Int[Array, "R T E"]
  path_len: Int[Array, "R T"]

  @classmethod
  def plain(cls, generated: Int[Array, "R N"], count: Int[Array, "R"]) -> "Context":
    rows = generated.shape[0]
    return cls(generated, count, jnp.zeros((rows, 1, 0), jnp.int32),
               jnp.zeros((rows, 1), jnp.int32))

  @classmethod
  def chain(cls, generated: Int[Array, "R N"], count: Int[Array, "R"],
            chain: Int[Array, "R D"]) -> "Context":
    """Columns 0..D: column t after the chain's first t tokens."""
    width = chain.shape[1]
    before = jnp.arange(width)[None, :] < jnp.arange(width + 1)[:, None]  # [D + 1, D]
    path = jnp.where(before[None], chain[:, None, :], -1)  # [R, D + 1, D]
    return cls(generated, count, path, jnp.broadcast_to(jnp.arange(width + 1),
                                                        (chain.shape[0], width + 1)))

  @classmethod
  def tree(cls, generated: Int[Array, "R N"], count: Int[Array, "R"], tokens: Int[Array, "R M"],
           parent: Int[Array, "R M"], depth: Int[Array, "R M"], max_depth: int) -> "Context":
    """Columns 0..M of a tree's verify pass: column 0 the root (nothing drafted), column
    1 + n after node n, i.e. after the nodes on its path (`parent` -1: under the root;
    `depth` 1 for a child of the root, 0 for padding)::

        root -> a -> b        column of b: path (a, b), path_len 2
             -> c             column of c: path (c,),   path_len 1
    """
    rows, nodes = tokens.shape
    r, n = jnp.arange(rows)[:, None], jnp.arange(nodes)[None, :]
    path = jnp.full((rows, nodes, max_depth), -1, jnp.int32)
    node = jnp.broadcast_to(n, (rows, nodes))
    for _ in range(max_depth):  # from each node up to the root, one level per round
      live = node >= 0
      at = jnp.maximum(node, 0)
      level = jnp.where(live, jnp.take_along_axis(depth, at, axis=1) - 1, max_depth)
      path = path.at[r, n, level].set(jnp.take_along_axis(tokens, at, axis=1), mode="drop")
      node = jnp.where(live, jnp.take_along_axis(parent, at, axis=1), -1)
    root = jnp.full((rows, 1, max_depth), -1, jnp.int32)
    return cls(generated, count, jnp.concatenate([root, path], axis=1),
               jnp.pad(jnp.maximum(depth, 0), ((0, 0), (1, 0))))

  def counts(self, vocab: int) -> Int[Array, "R T V"]:
    """How often each token was generated before each column."""
    base = _tally(self.generated, vocab, jnp.int32)[:, None]  # [R, 1, V]
    return base + self._on_path(vocab) if self.path.shape[2] else base

  def seen(self, prompt: Int[Array, "R P"], vocab: int) -> Bool[Array, "R T V"]:
    """Which tokens the text before each column holds (prompt, generated, path): one
    scatter over the prompt and the generated tokens together."""
    base = _tally(jnp.concatenate([prompt, self.generated], axis=1), vocab, jnp.bool_)[:, None]
    return base | (self._on_path(vocab) > 0) if self.path.shape[2] else base

  def _on_path(self, vocab: int) -> Int[Array, "R T V"]:
    """How often each token is on each column's path."""
    rows, columns = self.path_len.shape
    r, t = jnp.arange(rows)[:, None, None], jnp.arange(columns)[None, :, None]
    return jnp.zeros((rows, columns, vocab), jnp.int32).at[
        r, t, jnp.where(self.path >= 0, self.path, vocab)].add(1, mode="drop")

  def sequences(self, prompt: Int[Array, "R P"]) -> tuple[Int[Array, "R T S"], Int[Array, "R T"]]:
    """Each column's whole text (prompt, generated, path; -1 in the prompt's left
    padding and after the end) [R, T, P + N + E], and where it ends."""
    width, generated = prompt.shape[1], self.generated.shape[1]
    index = jnp.arange(width + generated + self.path.shape[2])  # [S]
    gen_at = index[None, :] - width  # [1, S]
    from_generated = jnp.take_along_axis(self.generated, jnp.clip(gen_at, 0, generated - 1)
                                         .repeat(self.count.shape[0], 0), axis=1)  # [R, S]
    path_at = gen_at - self.count[:, None]  # [R, S]
    from_path = jnp.take_along_axis(
        self.path, jnp.clip(path_at, 0, max(self.path.shape[2] - 1, 0))[:, None, :]
        .repeat(self.path.shape[1], 1), axis=2) if self.path.shape[2] else None  # [R, T, S]
    seq = jnp.where(index < width, jnp.pad(prompt, ((0, 0), (0, index.size - width)))[:, None],
                    -1)  # [R, 1, S]
    seq = jnp.where((gen_at >= 0) & (gen_at < self.count[:, None]), from_generated, seq[:, 0])
    seq = jnp.broadcast_to(seq[:, None], self.path.shape[:2] + index.shape)
    if from_path is not None:
      on_path = (path_at[:, None] >= 0) & (path_at[:, None] < self.path_len[..., None])
      seq = jnp.where(on_path, from_path, seq)
    return seq, width + self.count[:, None] + self.path_len


def process(logits: Float[Array, "R T V"], controls: Controls | None, context: Context,
            eos_ids: Int[Array, "E"]) -> Float[Array, "R T V"]:
  """The logits with every processor of `controls` applied (float32), in `PROCESSORS`'
  order (the sampling values come after: `mdjax.sampling.process_logits`); unchanged
  without one."""
  if controls is None or not controls.processes:
    return logits
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if controls.bias is not None:
    logits = logits + controls.bias
  if controls.repetition_penalty is not None:
    seen = context.seen(controls.prompt, vocab)  # [R, T | 1, V]
    penalty = per_row(controls.repetition_penalty, logits)
    logits = jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)
  if controls.presence_penalty is not None or controls.frequency_penalty is not None:
    counts = context.counts(vocab)  # [R, T | 1, V]
  if controls.presence_penalty is not None:
    logits = logits - per_row(controls.presence_penalty, logits) * (counts > 0)
  if controls.frequency_penalty is not None:
    logits = logits - per_row(controls.frequency_penalty, logits) * counts
  sequence = end = None
  if controls.ngram or controls.bad_words is not None:
    sequence, end = context.sequences(controls.prompt)
  if controls.ngram:
    logits = jnp.where(_repeated_ngrams(sequence, end, controls.ngram, vocab), -jnp.inf, logits)
  if controls.banned is not None:
    logits = jnp.where(controls.banned, -jnp.inf, logits)
  if controls.bad_words is not None:
    logits = jnp.where(_bad_word_ends(sequence, end, controls.bad_words, vocab), -jnp.inf,
                       logits)
  if controls.min_new_tokens is not None:
    generated = context.count[:, None] + context.path_len  # [R, T]
    early = (generated < per_row(controls.min_new_tokens, generated))[..., None]
    is_eos = (jnp.arange(vocab)[:, None] == eos_ids).any(-1)  # [V]
    logits = jnp.where(early & is_eos, -jnp.inf, logits)
  return logits


def _tally(tokens: Int[Array, "R N"], vocab: int, dtype) -> Array:
  """[R, V]: how often (bool: whether) each row holds each token (-1 entries: none)."""
  rows = jnp.arange(tokens.shape[0])[:, None]
  index = jnp.where(tokens >= 0, tokens, vocab)
  empty = jnp.zeros((tokens.shape[0], vocab), dtype)
  if dtype == jnp.bool_:
    return empty.at[rows, index].set(True, mode="drop")
  return empty.at[rows, index].add(1, mode="drop")


def _tail(sequence: Int[Array, "R T S"], end: Int[Array, "R T"], length: int
          ) -> Int[Array, "R T L"]:
  """The last `length` tokens before `end` (-1 before the start)."""
  at = end[..., None] - length + jnp.arange(length)  # [R, T, L]
  return jnp.where(at >= 0, jnp.take_along_axis(sequence, jnp.maximum(at, 0), axis=2), -1)


def _repeated_ngrams(sequence: Int[Array, "R T S"], end: Int[Array, "R T"], n: int,
                     vocab: int) -> Bool[Array, "R T V"]:
  """transformers' no_repeat_ngram rule: the tokens that would complete an n-gram that
  the text already holds, for texts of at least n - 1 tokens (left padding never matches
  a real token; an n-gram must end before `end`)."""
  rows, columns, width = sequence.shape
  last = _tail(sequence, end, n - 1)  # [R, T, n - 1]
  starts = width - n + 1
  match = jnp.ones((rows, columns, starts), jnp.bool_)
  for i in range(n - 1):
    match &= sequence[..., i:i + starts] == last[..., i:i + 1]
  follower = sequence[..., n - 1:]  # [R, T, starts]: the token after each (n-1)-gram
  match &= (jnp.arange(starts) + n - 1 < end[..., None]) & (follower >= 0)
  r, t = jnp.arange(rows)[:, None, None], jnp.arange(columns)[None, :, None]
  return jnp.zeros((rows, columns, vocab), jnp.bool_).at[
      r, t, jnp.where(match, follower, vocab)].set(True, mode="drop")


def _bad_word_ends(sequence: Int[Array, "R T S"], end: Int[Array, "R T"],
                   words: Int[Array, "W L"], vocab: int) -> Bool[Array, "R T V"]:
  """The last token of every bad word whose other tokens end the text."""
  rows, columns, _ = sequence.shape
  length = words.shape[1]
  tail = _tail(sequence, end, length - 1)  # [R, T, L - 1]
  prefix = words[:, :-1]  # [W, L - 1], -1 padded on the left
  hit = ((prefix < 0) | (tail[:, :, None] == prefix)).all(-1)  # [R, T, W]
  r, t = jnp.arange(rows)[:, None, None], jnp.arange(columns)[None, :, None]
  return jnp.zeros((rows, columns, vocab), jnp.bool_).at[
      r, t, jnp.where(hit, words[:, -1], vocab)].set(True, mode="drop")
