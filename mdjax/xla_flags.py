"""The XLA flags mdjax sets, in one place: set when `mdjax` is imported, before JAX starts
a backend, and overridden by any flag of the same name in the user's own `XLA_FLAGS`.

    flag                                  value                 why
    --xla_gpu_enable_command_buffer       FUSION, CUBLAS,       a decode pass is hundreds of
                                          CUBLASLT, CUSTOM_CALL, small kernels (~4.7 us a launch
                                          CUDNN, WHILE,          on an H200, ~1.3 us inside a
                                          CONDITIONAL            CUDA graph); WHILE and
                                                                 CONDITIONAL (not in XLA's
                                                                 default set) put loops and
                                                                 switches in the graph too

GPU flags only: XLA:CPU and XLA:TPU ignore them. They take effect only in a process whose
JAX backend starts after `import mdjax` (a backend reads `XLA_FLAGS` once, when it starts).
To leave one out, set it yourself, e.g. `XLA_FLAGS=--xla_gpu_enable_command_buffer=`
(XLA's own default is FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN).
"""

from __future__ import annotations

import os
from typing import MutableMapping

FLAGS: dict[str, str] = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
}


def with_defaults(user_flags: str) -> str:
  """`user_flags` (an `XLA_FLAGS` value) after mdjax's `FLAGS` that it does not set itself."""
  given = {flag.split("=", 1)[0].lstrip("-") for flag in user_flags.split()}
  ours = [f"--{name}={value}" for name, value in FLAGS.items() if name not in given]
  return " ".join(ours + user_flags.split())


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
  """Sets `environ["XLA_FLAGS"]` to `with_defaults` of what it holds."""
  environ["XLA_FLAGS"] = with_defaults(environ.get("XLA_FLAGS", ""))
