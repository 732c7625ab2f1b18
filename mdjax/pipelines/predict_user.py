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

from mdjax.errors import MdjaxError, check_count

OPTIONS = ("num_candidates", "candidate_tokens", "user_prefix", "assistant_prefix", "turn_end",
           "reply", "temperature", "top_k", "top_p", "min_p")


def run(generate, encode, model, prompts, *, max_new_tokens: int, eos_token_id, seed: int,
        num_candidates: int = 4, candidate_tokens: int = 32, user_prefix: str = "\nUser:",
        assistant_prefix: str = "\nAssistant:", turn_end: str = "\n", reply: bool = True,
        **sampling):
  """Both phases for every transcript (see the module docstring)."""
  if model.tokenizer is None:
    raise MdjaxError("strategy 'predict_user' builds text turns: the model needs a tokenizer")
  check_count("num_candidates", num_candidates, 1)
  check_count("candidate_tokens", candidate_tokens, 1)
  if not isinstance(turn_end, str) or not turn_end:
    raise MdjaxError(f"turn_end must be a non-empty string, got {turn_end!r}")
  transcripts = [prompts] if isinstance(prompts, str) else list(prompts)
  if not all(isinstance(t, str) and t for t in transcripts):
    raise MdjaxError("predict_user takes chat transcripts as non-empty text")
  common = dict(eos_token_id=eos_token_id, seed=seed)
  candidates = generate(model, [t + user_prefix for t in transcripts], strategy="parallel_sample",
                        num_samples=num_candidates, max_new_tokens=candidate_tokens,
                        **({"temperature": 1.0} | sampling), **common)
  cut = [text.split(turn_end)[0] for text in candidates.texts]
  per_prompt = [cut[i * num_candidates:(i + 1) * num_candidates] for i in range(len(transcripts))]
  if not reply:
    candidates.texts, candidates.intermediate = cut, [dict(candidates=c) for c in per_prompt]
    return candidates
  questions = [[user_prefix + c + turn_end + assistant_prefix for c in row] for row in per_prompt]
  replies = generate(model, transcripts, strategy="multi_question", questions=questions,
                     max_new_tokens=max_new_tokens, **sampling, **common)
  for key in ("target_passes", "generated_tokens", "prompt_tokens", "wall_s", "compile_s"):
    replies.stats[key] += candidates.stats[key]
  replies.intermediate = [
      dict(candidates=row, replies=replies.texts[i * num_candidates:(i + 1) * num_candidates])
      for i, row in enumerate(per_prompt)]
  return replies
