"""The platform mdjax builds a program for: the host's (`jax.default_backend()`), or the
target a program is compiled for ahead of time (`building_for`).

mdjax picks its paths by platform: the attention (`block_sparse` on CPU, `fused` on GPU
and TPU), the layer loop (unrolled on CPU, scanned elsewhere), the weight and cache
dtypes, and the shapes of some products (XLA:CPU's slow one-row bfloat16 product).
Every such choice asks `current()`, so a program compiled on this CPU for a GPU target
(`mdjax.compile_targets`) is the program that GPU would run, not the CPU's::

    with platform.building_for("gpu"):
      compiled = jax.jit(step).trace(*abstract_args_on_a_gpu_target).lower().compile()
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from mdjax.errors import MdjaxError

PLATFORMS = ("cpu", "gpu", "tpu")

_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("mdjax_target_platform",
                                                                     default=None)


def current() -> str:
  """"cpu", "gpu" or "tpu": the target being built for, else the host's backend."""
  return _target.get() or jax.default_backend()


def is_cpu() -> bool:
  return current() == "cpu"


@contextlib.contextmanager
def building_for(platform: str):
  """Within the block, mdjax chooses its paths as on `platform` (traced programs only:
  the arrays it creates eagerly still live on the host's devices)."""
  if platform not in PLATFORMS:
    raise MdjaxError(f"unknown platform {platform!r}; known: {', '.join(PLATFORMS)}")
  token = _target.set(platform)
  try:
    yield
  finally:
    _target.reset(token)
