"""The notebooks run top to bottom (small settings: MDJAX_NOTEBOOK_SMALL=1); the TPU
notebook on a simulated mesh of CPU devices (MDJAX_SIMULATED_DEVICES), compiled with
XLA's default optimisation."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.real_models  # both notebooks run SmolLM2-135M-Instruct

REPO = pathlib.Path(__file__).resolve().parent.parent
# notebook -> the CPU devices its first cell asks JAX for (its kernel is a process of its own)
SIMULATED_DEVICES = {"tpu_colab.ipynb": 8}
# The suite's XLA flags (tests/conftest.py) make compiling cheap and running slow. The TPU
# notebook's time is running SmolLM2 on 8 simulated devices (a few programs, hundreds of
# prompt tokens): its kernel runs with XLA's defaults, half the CPU (CHANGELOG.md).
COMPILE_CHEAP_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
RUN_BOUND = {"tpu_colab.ipynb"}


def without_compile_cheap_flags(flags: str) -> str:
  """`flags` (an XLA_FLAGS value) less the suite's compile-cheap flags."""
  return " ".join(flag for flag in flags.split() if flag not in COMPILE_CHEAP_FLAGS)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")))
def test_notebook_runs(name, monkeypatch):
  monkeypatch.setenv("MDJAX_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  devices = SIMULATED_DEVICES.get(name)
  if devices:
    monkeypatch.setenv("MDJAX_SIMULATED_DEVICES", str(devices))
  else:
    monkeypatch.delenv("MDJAX_SIMULATED_DEVICES", raising=False)
  if name in RUN_BOUND:
    monkeypatch.setenv("XLA_FLAGS", without_compile_cheap_flags(os.environ.get("XLA_FLAGS", "")))
  notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(REPO)}}).execute()
  errors = [o for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
  if devices:  # the notebook also asserts it: a simulation that did not take fails twice
    printed = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    assert f"JAX sees {devices} devices (cpu" in printed, printed[:2000]
