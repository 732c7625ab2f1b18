"""Losses that the trainers and the heads' objectives share (below both: the library
never imports `mdjax.train`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def kl_to_teacher(student: Float[Array, "... V"], teacher: Float[Array, "... V"],
                  temperature: float) -> Float[Array, "..."]:
  """`tau^2 * KL(softmax(teacher / tau) || softmax(student / tau))` per token.

  The tau^2 keeps the gradient's scale independent of tau (Hinton et al. 2015).
  """
  log_p = jax.nn.log_softmax(teacher / temperature, axis=-1)  # [..., V]
  log_q = jax.nn.log_softmax(student / temperature, axis=-1)
  return temperature ** 2 * jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
