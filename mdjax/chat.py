"""Chat prompts for instruct models, through the tokenizer's own chat template.

Several questions over one passage become one shared context and one branch per
question (`strategy="multi_question"`): each question's full chat is rendered by the
template, and the tokens every rendering shares form the context::

    rendering j   <|im_start|>user\\n{passage}\\n\\n{question j}<|im_end|>\\n<|im_start|>assistant\\n
    context       <|im_start|>user\\n{passage}\\n\\n        (the longest common token prefix)
    question j    the rest of rendering j

so context + question j is exactly rendering j, and answer j is exactly the answer to
that one chat alone.
"""

from __future__ import annotations

from mdjax.errors import MdjaxError, require
from mdjax.models.model import Model


def _template(model: Model):
  tokenizer = model.tokenizer
  if tokenizer is None or not getattr(tokenizer, "chat_template", None):
    raise MdjaxError(f"chat=True needs a chat template, and the model {model.name or model.path!r} "
                     "has none (use a plain prompt, or an instruct model)")
  require("jinja2", "a chat template")  # transformers renders templates with it
  return tokenizer


def chat_ids(model: Model, user: str, system: str | None = None) -> list[int]:
  """One user turn (after `system`, if given) and the assistant's opening, as ids."""
  messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": user}]
  rendered = _template(model).apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
  return model.tokenizer.encode(rendered, add_special_tokens=False)


def chat_questions(model: Model, passage: str, questions: list[str], system: str | None = None,
                   separator: str = "\n\n") -> tuple[list[int], list[list[int]]]:
  """The shared context and each question's own tokens (see the module docstring):
  question j's chat is one user turn, `passage + separator + questions[j]`."""
  if not questions:
    raise MdjaxError("chat_questions needs at least one question")
  rendered = [chat_ids(model, passage + separator + q, system) for q in questions]
  shared = min(len(ids) - 1 for ids in rendered)  # every question keeps at least one token
  for ids in rendered[1:]:
    shared = next((i for i, (a, b) in enumerate(zip(ids[:shared], rendered[0])) if a != b),
                  shared)
  return rendered[0][:shared], [ids[shared:] for ids in rendered]
