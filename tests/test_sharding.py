"""Every strategy and both trainers on a device mesh == one device:
`tests/multidevice/mesh_checks.py` and `train_checks.py`, run in a process of their own
with 8 simulated CPU devices (JAX fixes the device count when its backend starts, and
this process has started it with one)."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_the_mesh_and_training_checks_pass_on_8_simulated_devices():
  env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                        str(REPO / "tests" / "multidevice" / "mesh_checks.py"),
                        str(REPO / "tests" / "multidevice" / "train_checks.py")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
  assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
  assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]
