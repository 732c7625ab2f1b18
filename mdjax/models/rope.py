"""Rotary position embedding (RoPE) in Hugging Face's half-split layout (rotate_half):
each head's first half x1 and second half x2 at angle a = position * inv_freq become

    x1 cos a - x2 sin a  |  x2 cos a + x1 sin a          (in float32, rounded back)

`apply_rope` is the one implementation in jnp: the layers use it, and so does the
reference of the GPU's attention kernel (`mdjax.models.decode_attention`), whose
Triton code computes the same two lines element for element.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def apply_rope(x: Float[Array, "B T N H"], positions: Int[Array, "B T"],
               inv_freq: Float[Array, "H/2"]) -> Float[Array, "B T N H"]:
  """Rotary embedding in Hugging Face's half-split layout (rotate_half)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)
