"""mdjax.xla_flags: mdjax's XLA flags are set on import, and the user's own win."""

import os
import subprocess
import sys

from mdjax import xla_flags


def test_the_users_flag_of_the_same_name_wins_and_others_are_kept():
  assert xla_flags.with_defaults("") == " ".join(f"--{k}={v}" for k, v in xla_flags.FLAGS.items())
  mine = "--xla_gpu_enable_command_buffer=FUSION --xla_backend_optimization_level=0"
  assert xla_flags.with_defaults(mine) == mine


def test_importing_mdjax_sets_them_before_a_backend_starts():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  code = "import os, mdjax, jax; jax.numpy.ones(2).block_until_ready(); print(os.environ['XLA_FLAGS'])"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == xla_flags.with_defaults("").split()
