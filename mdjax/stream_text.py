"""Text as it is written: each output row's new text after every pass
(`mdjax.stream(..., text=True)`), so that a row's pieces joined are exactly its
`generate(...).texts` entry.

A token may end inside a character: SmolLM2's byte-level vocabulary spells " 日" in
three tokens, and the first two decode to " \ufffd" (U+FFFD, the replacement character).
As transformers' `TextStreamer` does, each row's tokens so far are decoded whole with
the tokenizer's own `decode` (no byte tables of ours), and only what later tokens
cannot change is shown; the rest is held back until they settle it:

    decoded so far          shown     held back
    " 日\ufffd"             " 日"     "\ufffd"          an incomplete character
    " 日本"                 "本"

A row that is done shows the rest of its text: all of it, without the EOS that ended
it (as `generate`'s texts leave it out), and with the token that completed a stop
string (as `generate` keeps it). `TextStreamer` holds back a whole word, not only an
incomplete character, because a tokenizer that cleans up tokenization spaces
(`clean_up_tokenization_spaces`: " ." becomes "." once the "." comes) rewrites the end
of a text as it grows; with such a tokenizer the last two words are held back too (the
clean-up's patterns span at most two spaces), without one only incomplete characters
are, so the text shows as soon as it is written.

Every pass decodes each row that grew from its start (the tokenizer's decode is Rust:
tens of microseconds for a thousand tokens), so what is shown is always a prefix of
the text `generate` decodes.
"""

from __future__ import annotations

import re
from typing import Sequence

REPLACEMENT = "\ufffd"  # what a decode shows for the bytes of an incomplete character
# the start of the second-to-last run of whitespace: the clean-up rewrites only after it
_LAST_TWO_WORDS = re.compile(r"\s+\S*\s+\S*$")


def settled(text: str, cleans_up_spaces: bool) -> str:
  """The part of a row's `text` so far that more tokens cannot change: without a
  trailing incomplete character, and (`cleans_up_spaces`) without its last two words."""
  text = text.rstrip(REPLACEMENT)
  if cleans_up_spaces:
    last_two = _LAST_TWO_WORDS.search(text)
    if last_two is not None:
      return text[:last_two.start()]
    first_space = re.search(r"\s", text)
    return text if first_space is None else text[:first_space.start()]
  return text


class Pieces(list):
  """One pass's new text of every row (a list of str, "" for a row that did not
  grow), and which rows are done (`done`, one bool per row): a done row's text is all
  shown, and its later pieces are ""."""

  def __init__(self, pieces: Sequence[str], done: Sequence[bool]):
    super().__init__(pieces)
    self.done = tuple(bool(d) for d in done)


class RowTexts:
  """Each output row's text as its tokens arrive: `update` gives every row's new
  piece. `eos`: the ids that end a row (a done row's last token, left out of its text)."""

  def __init__(self, tokenizer, eos: Sequence[int], rows: int):
    self.tokenizer = tokenizer
    self.eos = frozenset(eos)
    self.cleans_up_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    self.shown = [""] * rows  # what each row has shown
    self.seen = [(0, False)] * rows  # its token count and done flag at the last update

  def update(self, tokens: Sequence[Sequence[int]], done: Sequence[bool]) -> Pieces:
    """Every row's new text, from its tokens so far (`tokens[r]`: all of them) and
    whether it is done; "" for a row that did not grow."""
    pieces = []
    for row, (ids, finished) in enumerate(zip(tokens, done)):
      if (len(ids), bool(finished)) == self.seen[row]:
        pieces.append("")
        continue
      self.seen[row] = (len(ids), bool(finished))
      if ids and ids[-1] in self.eos:
        ids = ids[:-1]  # an EOS ends a row, and is never part of its text
      text = self.tokenizer.decode(list(ids))
      if not finished:
        text = settled(text, self.cleans_up_spaces)
        if not text.startswith(self.shown[row]):  # not yet settled where it was shown
          pieces.append("")
          continue
      pieces.append(text[len(self.shown[row]):])
      self.shown[row] = text
    return Pieces(pieces, done)
