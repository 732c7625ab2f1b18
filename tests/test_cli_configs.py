"""Every decode config runs end to end on the shipped model (a few tokens) and prints
its text and one JSON summary line; the lossless ones reproduce greedy's tokens."""

import concurrent.futures
import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.py")
                 if p.stem not in ("__init__", "common") and not p.stem.startswith("lm_"))
LOSSLESS = ("greedy", "prompt_lookup", "speculative", "self_speculative", "lookahead", "jacobi",
            "speculative_tree")
NEW_TOKENS = 6


def _decode(name: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.decode", f"--config=configs/{name}.py",
                         f"--config.max_new_tokens={NEW_TOKENS}"], cwd=REPO, capture_output=True,
                        text=True, timeout=600)


@pytest.fixture(scope="module")
def runs():
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    return dict(zip(CONFIGS, pool.map(_decode, CONFIGS)))


@pytest.mark.parametrize("name", CONFIGS)
def test_config_runs(runs, name):
  result = runs[name]
  assert result.returncode == 0, result.stderr
  summary = json.loads(result.stdout.splitlines()[-1])
  assert summary["strategy"] == name  # every config is named after its strategy
  assert summary["sequences"] and all(len(s) <= NEW_TOKENS for s in summary["sequences"])
  if name in LOSSLESS:
    assert summary["sequences"] == json.loads(runs["greedy"].stdout.splitlines()[-1])["sequences"]
