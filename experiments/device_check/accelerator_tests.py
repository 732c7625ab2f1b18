"""The `tests` section: what an accelerator can get wrong that a CPU does not, checked by
`pytest -m accelerator` (`tests/test_accelerator.py`) in a subprocess on this device:
float32 logits and greedy vs transformers, every lossless strategy == greedy and
multi_question == sequential in float32 and bfloat16. Counts, and each failing test
with its message, from pytest's junit XML.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
from xml.etree import ElementTree

from experiments.device_check import Settings

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_command(settings: Settings, junit: pathlib.Path) -> list[str]:
  """pytest on the accelerator tests, with the repository's addopts (2 CPU workers by
  file) replaced: `test_workers` workers by test when pytest-xdist is there."""
  command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
             "-m", "accelerator", f"--junitxml={junit}", "tests/test_accelerator.py"]
  if settings.test_workers and importlib.util.find_spec("xdist"):
    command += ["-n", str(settings.test_workers), "--dist", "load"]
  if settings.tests_k:
    command += ["-k", settings.tests_k]
  return command


def junit_summary(junit: pathlib.Path) -> dict:
  """Counts and every failing or erroring test with its message, from a junit XML."""
  root = ElementTree.parse(junit).getroot()
  suite = root if root.tag == "testsuite" else root.find("testsuite")
  failing = []
  for case in suite.iter("testcase"):
    for problem in list(case.findall("failure")) + list(case.findall("error")):
      failing.append(dict(test=f"{case.get('classname')}::{case.get('name')}", kind=problem.tag,
                          message=(problem.get("message") or "")[:2000]))
  counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
  return dict(counts, passed=counts["tests"] - counts["failures"] - counts["errors"]
              - counts["skipped"], failing=failing)


def run_tests(settings: Settings, out_dir: pathlib.Path) -> dict:
  junit = out_dir / f".device_check_tests.{os.getpid()}.xml"
  command = test_command(settings, junit)
  try:
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          timeout=settings.test_timeout_s,
                          env=dict(os.environ, JAX_PLATFORMS=""))  # the device, not
    #                                          the suite's default of the CPU (conftest)
  except subprocess.TimeoutExpired as timeout:  # its output so far says which tests ran
    output = b"".join(x if isinstance(x, bytes) else x.encode()
                      for x in (timeout.stdout, timeout.stderr) if x)
    raise RuntimeError(f"the tests ran past {settings.test_timeout_s}s; the output's end: "
                       f"{output.decode(errors='replace')[-3000:]}") from None
  try:
    summary = junit_summary(junit)
  finally:
    junit.unlink(missing_ok=True)
  return dict(summary, returncode=proc.returncode, command=" ".join(command[1:]),
              output_tail=(proc.stdout + proc.stderr)[-4000:])
