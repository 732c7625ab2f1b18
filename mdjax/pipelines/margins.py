"""`margins`: writing in the margins (Russak et al. 2024, arXiv 2408.14906).

A long context is cut into chunks of `chunk_tokens` tokens. Three phases, each one
`mdjax.generate` call whose outputs equal their sequential counterparts:

1. notes (`margin_notes`): after every chunk i, the `instruction` and a note of up
   to `note_tokens` tokens, all chunks in one pass per token. Note i sees chunks
   1..i (the paper's running prefix) over one chain of segments
   (`mdjax.strategies.prompt_layouts.Chains`)::

       chunk 1 -- chunk 2 -- chunk 3          the context, prefilled once
          \\          \\          \\
         instr+note1 instr+note2 instr+note3   one branch per chunk

2. relevance (`multi_question`): the shared prefix `classify_prefix` (with the
   question) and, per note, `note + classify_suffix`; the first
   `classify_tokens` tokens of each answer are matched against `keep_pattern`.
3. answer (greedy): `answer_template` with the question and the kept notes.

`out.sequences` / `out.texts` hold the answers; `out.intermediate[i]` the notes,
the relevance answers and which notes were kept for prompt i; `out.stats` sums the
three calls (`target_passes`, `generated_tokens`, `wall_s`, `compile_s`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from mdjax.errors import MdjaxError, check_count
from mdjax.generate import GenerationOutput, generate
from mdjax.models.model import Model
from mdjax.pipelines.base import Pipeline, add_stats, regex
from mdjax.prompts import encode_prompts

INSTRUCTION = "\n# Note on the code above, relevant to the question:\n#"
CLASSIFY_PREFIX = "Question: {question}\nIs this note relevant to the question (yes/no)?\n"
CLASSIFY_SUFFIX = "\nAnswer:"
ANSWER_TEMPLATE = "Notes:\n{notes}\n\nQuestion: {question}\nAnswer:"


def chunk_ids(ids: list[int], chunk_tokens: int) -> list[list[int]]:
  """`ids` cut into consecutive chunks of `chunk_tokens` (the last may be shorter)."""
  return [ids[i:i + chunk_tokens] for i in range(0, len(ids), chunk_tokens)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Margins(Pipeline):
  """The three phases for every prompt (a context): see the module docstring."""

  name: ClassVar[str] = "margins"
  question: str | None = None
  chunk_tokens: int = 128
  note_tokens: int = 32
  instruction: str = INSTRUCTION
  classify_prefix: str = CLASSIFY_PREFIX
  classify_suffix: str = CLASSIFY_SUFFIX
  classify_tokens: int = 3
  keep_pattern: str = r"(?i)^\s*yes"
  answer_template: str = ANSWER_TEMPLATE

  def __post_init__(self):
    if not isinstance(self.question, str) or not self.question.strip():
      raise MdjaxError(f"strategy 'margins' needs a non-empty question, got {self.question!r}")
    regex("keep_pattern", self.keep_pattern)
    check_count("chunk_tokens", self.chunk_tokens, 1)

  def run(self, model: Model, prompts, *, max_new_tokens: int, eos_token_id,
          seed: int) -> GenerationOutput:
    if model.tokenizer is None:
      raise MdjaxError("strategy 'margins' builds text prompts: the model needs a tokenizer")
    contexts = [chunk_ids(ids, self.chunk_tokens) for ids in encode_prompts(model, prompts)]
    common = dict(eos_token_id=eos_token_id, seed=seed)
    notes = generate(model, contexts, strategy="margin_notes", instruction=self.instruction,
                     max_new_tokens=self.note_tokens, **common)
    counts = [len(c) for c in contexts]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    per_prompt = [notes.texts[s:s + n] for s, n in zip(starts, counts)]
    relevance = generate(
        model, [self.classify_prefix.format(question=self.question)] * len(contexts),
        strategy="multi_question",
        questions=[[note + self.classify_suffix for note in texts] for texts in per_prompt],
        max_new_tokens=self.classify_tokens, **common)
    labels = [relevance.texts[s:s + n] for s, n in zip(starts, counts)]
    keep = regex("keep_pattern", self.keep_pattern)
    kept = [[bool(keep.search(label)) for label in row] for row in labels]
    answer_prompts = [self.answer_template.format(
        question=self.question, notes="\n".join(n.strip() for n, k in zip(texts, flags) if k))
        for texts, flags in zip(per_prompt, kept)]
    answers = generate(model, answer_prompts, max_new_tokens=max_new_tokens, **common)
    phases = (notes, relevance, answers)
    add_stats(answers, notes, relevance)
    answers.stats["tokens_per_pass"] = (answers.stats["generated_tokens"]
                                        / (answers.stats["target_passes"] + len(phases)))
    answers.intermediate = [dict(notes=texts, relevance=row, kept=flags, answer_prompt=prompt)
                            for texts, row, flags, prompt in zip(per_prompt, labels, kept,
                                                                 answer_prompts)]
    return answers
