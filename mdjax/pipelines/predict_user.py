"""`predict_user`: k candidate next user messages for a chat transcript, and a reply to each.

1. candidates (`parallel_sample`): the transcript (text, already in the model's chat
   format) then `user_prefix`; `num_candidates` samples of up to `candidate_tokens`
   tokens, all over the transcript's one KV; each is cut at `turn_end`.
2. replies (`multi_question`, when `reply=True`): the transcript as the shared
   context, and per candidate `user_prefix + candidate + turn_end + assistant_prefix`
   as its question; each reply (up to `max_new_tokens`, greedy unless sampling
   options are given) == decoding that transcript + candidate alone.

`out.sequences` / `out.texts`: the replies (the candidates when `reply=False`),
prompt-major; `out.intermediate[i]`: prompt i's candidates and replies.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from mdjax.errors import MdjaxError, check_count
from mdjax.generate import GenerationOutput, generate
from mdjax.models.model import Model
from mdjax.pipelines.base import Sampled, add_stats


@dataclasses.dataclass(frozen=True, kw_only=True)
class PredictUser(Sampled):
  """Both phases for every transcript: see the module docstring. The sampling options
  are the candidates' (temperature 1 unless set) and the replies' (greedy unless set)."""

  name: ClassVar[str] = "predict_user"
  num_candidates: int = 4
  candidate_tokens: int = 32
  user_prefix: str = "\nUser:"
  assistant_prefix: str = "\nAssistant:"
  turn_end: str = "\n"
  reply: bool = True

  def __post_init__(self):
    check_count("num_candidates", self.num_candidates, 1)
    check_count("candidate_tokens", self.candidate_tokens, 1)
    if not isinstance(self.turn_end, str) or not self.turn_end:
      raise MdjaxError(f"turn_end must be a non-empty string, got {self.turn_end!r}")

  def run(self, model: Model, prompts, *, max_new_tokens: int, eos_token_id,
          seed: int) -> GenerationOutput:
    if model.tokenizer is None:
      raise MdjaxError("strategy 'predict_user' builds text turns: the model needs a tokenizer")
    transcripts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not all(isinstance(t, str) and t for t in transcripts):
      raise MdjaxError("predict_user takes chat transcripts as non-empty text")
    k, common = self.num_candidates, dict(eos_token_id=eos_token_id, seed=seed)
    candidates = generate(model, [t + self.user_prefix for t in transcripts],
                          strategy="parallel_sample", num_samples=k,
                          max_new_tokens=self.candidate_tokens,
                          **({"temperature": 1.0} | self.sampling), **common)
    cut = [text.split(self.turn_end)[0] for text in candidates.texts]
    per_prompt = [cut[i * k:(i + 1) * k] for i in range(len(transcripts))]
    if not self.reply:
      candidates.texts, candidates.intermediate = cut, [dict(candidates=c) for c in per_prompt]
      return candidates
    questions = [[self.user_prefix + c + self.turn_end + self.assistant_prefix for c in row]
                 for row in per_prompt]
    replies = generate(model, transcripts, strategy="multi_question", questions=questions,
                       max_new_tokens=max_new_tokens, **self.sampling, **common)
    add_stats(replies, candidates)
    replies.intermediate = [dict(candidates=row, replies=replies.texts[i * k:(i + 1) * k])
                            for i, row in enumerate(per_prompt)]
    return replies
