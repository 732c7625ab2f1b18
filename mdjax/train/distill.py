"""Knowledge distillation: train a draft to predict what its target would predict.

A speculative draft is only as useful as its agreement with the target (its argmax is
the target's argmax, or its law is close to the target's). Trained on data alone, a
small draft learns the data's law; distilled, it learns the target's (Hinton et al.
2015; DistillSpec, Zhou et al. 2024). With `config.teacher` set, each training token's
loss mixes the data and the teacher::

    loss = (1 - w) * CE(data token, student)  +  w * tau^2 * KL(teacher_tau || student_tau)

`w = config.distill_weight`, `tau = config.distill_temperature`, `p_tau` = softmax(logits
/ tau). The teacher is frozen (its logits are a stop-gradient input of the same jitted
step), so a run stays a pure function of (seed, step) and resumes bitwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mdjax import programs
from mdjax.checkpoints import hf
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.transformer import Params, causal_logits


@dataclasses.dataclass(frozen=True)
class Teacher:
  """A frozen model whose next-token law the student is pulled towards."""

  name: str
  params: Params
  config: ModelConfig
  weight: float  # w: the KL term's share of the loss
  temperature: float  # tau


def load_teacher(config: ml_collections.ConfigDict, student: ModelConfig) -> Teacher | None:
  """`config.teacher` (a registered name or a model directory) as float32, or None."""
  if not config.teacher:
    return None
  if not 0 < config.distill_weight <= 1:
    raise MdjaxError(f"config.distill_weight must be in (0, 1] with a teacher, "
                     f"got {config.distill_weight}")
  if not config.distill_temperature > 0:
    raise MdjaxError(f"config.distill_temperature must be > 0, got {config.distill_temperature}")
  model = hf.load_hf_dir(hf.resolve(config.teacher), dtype="float32")
  if model.config.vocab_size != student.vocab_size:
    raise MdjaxError(f"teacher {config.teacher!r} has a vocabulary of {model.config.vocab_size} "
                     f"tokens, the student {student.vocab_size}: they must share the tokenizer")
  return Teacher(name=config.teacher, params=model.params, config=model.config,
                 weight=float(config.distill_weight),
                 temperature=float(config.distill_temperature))


def teacher_logits(teacher: Teacher, teacher_params: Params, inputs: jax.Array) -> jax.Array:
  """`[B, T] -> [B, T, V]`, no gradient (the params are an argument so jit does not bake
  them into the program as constants)."""
  return jax.lax.stop_gradient(causal_logits(teacher_params, inputs, config=teacher.config))


def agreement(params: Params, config: ModelConfig, teacher: Teacher, sequences: np.ndarray,
              batch_size: int) -> float:
  """Share of the positions of `sequences` `[N, T + 1]` where the student's argmax is the
  teacher's (the draft's greedy acceptance rate under teacher forcing)."""
  same, count = 0, 0
  for start in range(0, len(sequences), batch_size):
    inputs = jnp.asarray(sequences[start:start + batch_size, :-1])
    same += int(_same_argmax(params, teacher.params, inputs, config=config,
                             teacher_config=teacher.config))
    count += inputs.size
  return same / count


@functools.partial(programs.jit, static_argnames=("config", "teacher_config"))
def _same_argmax(params, teacher_params, inputs, *, config, teacher_config):
  student = causal_logits(params, inputs, config=config)
  teacher = causal_logits(teacher_params, inputs, config=teacher_config)
  return jnp.sum(jnp.argmax(student, axis=-1) == jnp.argmax(teacher, axis=-1))
