"""mdjax.backends: on a host without a GPU or TPU, `import mdjax` starts the CPU alone,
so nothing prints a plugin traceback or libtpu's warnings, and the GPU and TPU compile
targets still load; a platform the user chose is kept; a program built for a target
this host lacks, found again in JAX's persistent cache, is compiled again quietly; a GPU
target builds with the CUDA tools the package registry gives, no CUDA toolkit needed."""

import os
import subprocess
import sys
import warnings

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


def test_a_program_built_for_an_absent_device_is_compiled_again_without_a_warning():
  """JAX's persistent compilation cache (the suite sets one: tests/conftest.py) stores a
  program built for an H200, which no client here can load back: the second build of
  the same program compiles it again, and says nothing (`compile_targets.compile_for`)."""
  import jax
  import numpy as np

  from mdjax import compile_targets
  assert os.environ.get("JAX_COMPILATION_CACHE_DIR")
  texts = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
      jax.clear_caches()  # the second build reads the persistent cache's entry
      compiled = compile_targets.compile_for(jax.jit(lambda x: x * 2 + 1), "h200",
                                             np.zeros(8, np.float32))
      texts.append(compiled.as_text())
  assert texts[0] == texts[1] and "fusion" in texts[0]
  assert not [w for w in caught if "compilation cache" in str(w.message)], [
      str(w.message) for w in caught]


def test_a_gpu_target_builds_with_the_registrys_cuda_tools_alone():
  """requirements-compile-targets.txt brings ptxas and libdevice (nvidia-cuda-nvcc,
  nvidia-nvvm): pointed at them first, and with no CUDA toolkit on the PATH, XLA builds a
  program with a sine (a libdevice call) for an H200 with them."""
  import nvidia
  tools = next(os.path.join(p, "cu13") for p in nvidia.__path__
               if os.path.exists(os.path.join(p, "cu13", "bin", "ptxas")))
  assert os.path.exists(os.path.join(tools, "nvvm", "libdevice", "libdevice.10.bc"))
  code = ("import jax, jax.numpy as jnp, numpy as np\n"
          "from mdjax import compile_targets\n"
          "program = compile_targets.compile_for(jax.jit(lambda x: jnp.sin(x) * 2),\n"
          "                                      'h200', np.zeros(1024, np.float32))\n"
          "print(program.as_text().count('fusion('))\n")
  path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                         if not os.path.exists(os.path.join(d, "ptxas")))
  out = run(code, {**UNCHOSEN, "PATH": path, "XLA_FLAGS": f"--xla_gpu_cuda_data_dir={tools}"})
  assert int(out.stdout) >= 1
