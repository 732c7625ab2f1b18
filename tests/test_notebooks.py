"""The notebooks run top to bottom (small settings: MDJAX_NOTEBOOK_SMALL=1)."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")))
def test_notebook_runs(name, monkeypatch):
  monkeypatch.setenv("MDJAX_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(REPO)}}).execute()
  errors = [o for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
