"""mdjax.backends: on a host without a GPU or TPU, `import mdjax` starts the CPU alone,
so nothing prints a plugin traceback or libtpu's warnings, and the GPU and TPU compile
targets still load; a platform the user chose is kept."""

import os
import subprocess
import sys

from mdjax import backends

ROOT = os.path.dirname(os.path.dirname(__file__))
# the suite itself runs with JAX_PLATFORMS=cpu (tests/conftest.py): these processes do not
UNCHOSEN = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}


def run(code: str, env: dict) -> subprocess.CompletedProcess:
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
  assert out.returncode == 0, out.stderr
  return out


def test_a_host_without_an_accelerator_starts_quietly_and_still_compiles_for_gpu_and_tpu():
  code = ("import mdjax, jax\n"
          "from mdjax import compile_targets\n"
          "print(jax.config.jax_platforms, jax.default_backend())\n"
          "print(compile_targets.device('h200').platform, compile_targets.device('v5e').platform)\n")
  out = run(code, UNCHOSEN)
  platforms, compiled_for = out.stdout.splitlines()
  if backends.host_has_accelerator():  # a GPU machine (docs/device/next_lease.sh): left to jax
    assert platforms.split()[0] == "None", out.stdout
  else:
    assert platforms == "cpu cpu", out.stdout
    assert out.stderr == "", out.stderr  # no CUDA plugin traceback, no libtpu warning
  assert compiled_for == "gpu tpu"


def test_the_users_own_platform_is_kept():
  out = run("import mdjax, jax; print(jax.config.jax_platforms)", {**UNCHOSEN, "JAX_PLATFORMS": "cpu,tpu"})
  assert out.stdout.strip() == "cpu,tpu"
