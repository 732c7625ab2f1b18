"""Stop strings, matched on the device where transformers' `StopStringCriteria` matches.

A row stops right after the token that completes a stop string (its text keeps the
string). transformers decides that after each appended token, from the row's last
`window` ids (prompt and generated alike), `window` being the longest stop string's
length in units:

- units are UTF-8 bytes for a byte-level (GPT-2, SmolLM2) or byte-fallback
  (sentencepiece: Gemma) tokenizer, else characters: "é" is 2 units there, 1 here;
- a token's units are the text it decodes to after a fixed prefix: "Ġthe" and "▁the"
  give " the", a byte token ("<0xE2>", a byte-level "â") its one byte, a special token
  its literal text ("<|im_end|>"); an id the tokenizer lacks (a padded embedding's)
  has no text, and no match runs through it;
- the string must END inside the last token, at least one unit into it; it may start
  anywhere in the window: in an earlier token's middle, or in the prompt. "stop" fires
  on [.., "sto", "pped"] and on ["xstopx"], never on ["stop", "at"]: a string wholly
  before the last token is not looked at again (one wholly in the prompt stops nothing).

So the prompt counts: a string begun in the prompt's last tokens and ended by the first
generated token stops transformers there; `completed` takes `prompt_tail` for it.

The window for "→\\n\\n" (e2 86 92 0a 0a: 5 units, so the last 5 tokens; statically
L = 8 tokens, the longest string's units rounded up to 4), the token "\\n\\nThe" just written:

    tokens   " we"   " go"     " →"      "\\n" | "\\n\\nThe"      <- tokens[r, ends[r, a]]
    units      .. 67 6f   20 e2 86 92   0a   | 0a 0a 54 68 65
    text     the last K = L - 1 units before  | head: the first K units
    "→\\n\\n" ends m = 1 unit into the last token: text[-4:] + head[:1] equals it, so it
    fires. A string ending m >= its length units in lies inside the token: `inside`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from mdjax.errors import MdjaxError

PREFIX = "abcdef"  # decoded before each token, then cut: a decoder drops a leading space
BYTE_TOKEN = re.compile(r"<0x[0-9a-fA-F]{2}>")  # sentencepiece's byte-fallback tokens
# GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others
# for chr(256), chr(257), ... in byte order
_PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
BYTE_LEVEL = {chr(b): b for b in _PRINTABLE} | {
    chr(256 + i): b for i, b in enumerate(sorted(set(range(256)) - set(_PRINTABLE)))}
_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> _Vocab


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StopStrings:
  """One request's stop strings and the vocabulary as they see it (K = L - 1 units).

    head    int[V, K]    each token's first K units (-1 after its end; int16 for bytes)
    tail    int[V, K]    its last K units, right-aligned (-1 before its start)
    length  int32[V]     its length in units, at most K; -1: no text (an id the
                         tokenizer lacks), which no match runs through
    inside  bool[V, S]   whether stop string s lies wholly inside the token
    chars   int32[S, L]  the stop strings' units (-1 after the end)
    size    int32[S]     their lengths (0: a padding slot, never matched)

  S and L are rounded up to multiples of 4, so that other stop strings of similar
  lengths reuse a compiled program; texts and the true longest length are data.
  """

  head: Int[Array, "V K"]
  tail: Int[Array, "V K"]
  length: Int[Array, "V"]
  inside: Bool[Array, "V S"]
  chars: Int[Array, "S L"]
  size: Int[Array, "S"]

  @classmethod
  def build(cls, tokenizer, strings: str | list[str], vocab_size: int) -> StopStrings:
    """The tables of `strings` (one str: one string) for ids in [0, vocab_size)."""
    strings = [strings] if isinstance(strings, str) else strings
    if not isinstance(strings, (list, tuple)) or not strings or not all(
        isinstance(s, str) for s in strings):
      raise MdjaxError(f"stop_strings must be a string or a non-empty list of strings, "
                       f"got {strings!r}")
    if "" in strings:
      raise MdjaxError(f"stop_strings must not hold an empty string, got {strings!r}")
    if tokenizer is None:
      raise MdjaxError("stop_strings needs a tokenizer; the model has none")
    vocab = _vocab(tokenizer)
    targets = [s.encode() if vocab.as_bytes else s for s in strings]
    lens = [len(t) for t in targets]
    num, width = -(-len(targets) // 4) * 4, -(-max(lens) // 4) * 4
    chars, k = np.full((num, width), -1, np.int32), width - 1
    for s, t in enumerate(targets):
      chars[s, :lens[s]] = _units([t], vocab.as_bytes)
    n = min(vocab_size, len(vocab.texts))
    have, start = vocab.length[:n, None], vocab.offset[:n, None]
    j = np.arange(k)
    pick = lambda at, ok: np.where(ok, vocab.units[np.clip(at, 0, len(vocab.units) - 1)], -1)
    head = np.full((vocab_size, k), -1, np.int16 if vocab.as_bytes else np.int32)  # half: bytes
    tail, length = head.copy(), np.full(vocab_size, -1, np.int32)
    inside = np.zeros((vocab_size, num), bool)
    head[:n] = pick(start + j, j < have)
    tail[:n] = pick(start + have - k + j, j >= k - have)
    length[:n] = np.minimum(vocab.length[:n], k)
    for s, t in enumerate(targets):
      inside[:n, s] = [x is not None and t in x for x in vocab.texts[:n]]
    return cls(head=jnp.asarray(head), tail=jnp.asarray(tail), length=jnp.asarray(length),
               inside=jnp.asarray(inside), chars=jnp.asarray(chars),
               size=jnp.asarray(np.pad(lens, (0, num - len(lens))), jnp.int32))

  def prompt_tail(self, prompts: list[list[int]]) -> Int[Array, "R W"]:
    """Each row's last W = L - 1 prompt tokens (all the window can reach), -1 before."""
    width = self.chars.shape[1] - 1
    out = np.full((len(prompts), width), -1, np.int32)
    for r, prompt in enumerate(prompts):
      kept = list(prompt)[-width:]
      out[r, width - len(kept):] = kept
    return jnp.asarray(out)


def completed(stops: StopStrings, tokens: Int[Array, "R N"], ends: Int[Array, "R A"],
              prompt_tail: Int[Array, "R W"] | None = None) -> Int[Array, "R A"]:
  """The stop string that the token at `tokens[r, ends[r, a]]` completes (the lowest
  index where several do), else -1; -1 too where `ends[r, a]` is -1.

  Each `ends` is judged on the row's tokens up to it, as transformers judges after
  appending that token alone: later tokens of the row (written in the same step) are
  not looked at. `tokens` are the generated tokens (-1: none); `prompt_tail` the prompt's
  last tokens (`StopStrings.prompt_tail`; None: the prompt takes no part, unlike
  transformers, whose window runs into it).

  The window is transformers' own: the last `max(size)` tokens, `size` in units. That is
  enough for any string when every token has at least one unit (SmolLM2's and Gemma 3's
  do); with tokens of no units (empty strings) a match could span more tokens, which
  transformers misses, so a wider window here would stop where transformers does not.
  L tokens are gathered (static), those past `max(size)` masked (data).
  """
  num_rows, k = tokens.shape[0], stops.head.shape[1]
  window = k + 1
  before = jnp.full((num_rows, 1), -1, jnp.int32)  # one column: nothing before the prompt
  if prompt_tail is not None:
    before = jnp.concatenate([before, prompt_tail.astype(jnp.int32)], axis=1)
  back = jnp.arange(window - 1, -1, -1)  # oldest first: the last token is 0 back
  at = ends[..., None] - back  # [R, A, L]
  rows = lambda x, i: jnp.take_along_axis(x, i.reshape(num_rows, -1), 1).reshape(i.shape)
  ids = jnp.where(at >= 0, rows(tokens, jnp.clip(at, 0, tokens.shape[1] - 1)),
                  rows(before, jnp.clip(at + before.shape[1], 0, before.shape[1] - 1)))
  ids = jnp.where((ends[..., None] >= 0) & (back < stops.size.max()), ids, -1)
  known = (ids >= 0) & (ids < stops.length.shape[0])
  ids = jnp.where(known, ids, 0)
  # The text before the last token, newest unit first: unit u lies in the token whose
  # span [start, start + length) holds it; a token without text ends the text there.
  prior = ids[..., -2::-1]  # [R, A, L-1] newest first
  length = jnp.where(known[..., -2::-1], stops.length[prior], -1)
  length = jnp.where(jnp.cumsum(length < 0, axis=-1) == 0, length, 0)
  start = jnp.cumsum(length, axis=-1) - length
  into = jnp.arange(k) - start[..., None]  # [R, A, L-1, K]: unit u's place in each token
  units = jnp.take_along_axis(stops.tail[prior], jnp.clip(k - 1 - into, 0, k - 1), axis=-1)
  units = jnp.where((into >= 0) & (into < length[..., None]), units, -1).max(axis=-2)
  last = ids[..., -1]
  head = jnp.where(known[..., -1:], stops.head[last], -1)
  text = jnp.concatenate([units[..., ::-1], head], axis=-1)  # [R, A, 2K]: the boundary at K
  # A string of n units starting at text[b], b < K, ends b + n - K units into the token.
  spans = text[..., jnp.arange(k)[:, None] + jnp.arange(window)]  # [R, A, K, L]
  same = ((spans[..., None, :] == stops.chars)
          | (jnp.arange(window) >= stops.size[:, None])).all(axis=-1)  # [R, A, K, S]
  across = (same & (jnp.arange(k)[:, None] + stops.size > k)).any(axis=-2)
  fires = across | (stops.inside[last] & known[..., -1:])  # [R, A, S]
  return jnp.where(fires.any(axis=-1), jnp.argmax(fires, axis=-1), -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Vocab:
  """Each token id's text as transformers' stop-string criterion sees it (None: no such
  id), and the same flattened into units, where token i is units[offset[i]:][:length[i]]."""

  texts: list
  as_bytes: bool
  units: np.ndarray
  offset: np.ndarray
  length: np.ndarray


def _vocab(tokenizer) -> _Vocab:
  """The tokenizer's `_Vocab`, made once per tokenizer (Gemma's 262k tokens: ~1 s)."""
  try:
    return _VOCABS[tokenizer]
  except (KeyError, TypeError):
    pass
  mode = _mode(tokenizer)
  base = tokenizer.convert_ids_to_tokens(tokenizer(PREFIX, add_special_tokens=False)["input_ids"])
  vocab = tokenizer.get_vocab()
  texts = [None] * (max(vocab.values()) + 1)
  for token, i in vocab.items():
    if mode == "ByteLevel" and all(c in BYTE_LEVEL for c in token):
      texts[i] = bytes(BYTE_LEVEL[c] for c in token)
    elif mode == "ByteFallback" and BYTE_TOKEN.fullmatch(token):
      texts[i] = bytes([int(token[3:5], 16)])
    else:
      text = tokenizer.convert_tokens_to_string(base + [token])
      text = text[text.index(PREFIX) + len(PREFIX):]
      texts[i] = text.encode() if mode else text
  length = np.array([-1 if t is None else len(t) for t in texts], np.int32)
  offset = np.concatenate([[0], np.cumsum(np.maximum(length, 0))[:-1]])
  units = np.append(_units([t for t in texts if t], mode is not None), -1)  # -1: never empty
  result = _Vocab(texts, mode is not None, units, offset, length)
  try:
    _VOCABS[tokenizer] = result
  except TypeError:  # neither hashable nor weakly referable: made again next time
    pass
  return result


def _mode(tokenizer) -> str | None:
  """'ByteFallback' or 'ByteLevel' where the tokenizer's decoder is or holds one (in that
  order): units are bytes; None: characters."""
  decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
  if decoder is not None and type(decoder).__name__ == "ByteLevel":  # with no JSON state too
    return "ByteLevel"
  try:
    state = json.dumps(json.loads(decoder.__getstate__()))  # one spelling of each "type"
  except (AttributeError, TypeError, ValueError):
    return None
  return next((k for k in ("ByteFallback", "ByteLevel") if f'"type": "{k}"' in state), None)


def _units(texts: list, as_bytes: bool) -> np.ndarray:
  """int32 units of the texts, concatenated: bytes, or characters' code points."""
  if as_bytes:
    return np.frombuffer(b"".join(texts), np.uint8).astype(np.int32)
  return np.frombuffer("".join(texts).encode("utf-32-le"), np.uint32).astype(np.int32)
