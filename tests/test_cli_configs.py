"""Every decode config runs end to end on its model (a few tokens) and prints its
text; the lossless ones reproduce greedy's tokens on the same model and prompt.

The configs run at a few tokens and a few branches (`_config`), in this process through `experiments.decode.decode` (what the CLI's
`main` calls), sharing compiled programs; one run goes through the CLI itself and
checks its output: the text, then one JSON summary line.

The configs run here on models laid out for `layer_loop="scan"`, each model loaded once
(`_scanned_models_loaded_once`): a real model's program then compiles one layer instead
of 30, about 10 CPU s less each (CHANGELOG.md), and what these tests prove (a config
runs end to end and prints its text; a lossless one gives greedy's tokens) does not
depend on the layer loop, which tests/test_layer_loop.py proves gives the same tokens
for every strategy. The CLI run is configs/greedy.py on the shipped code-tiny (the
command its docstring gives): what it proves is the CLI's output, which does not depend
on the model, and its process takes ~9 CPU s on code-tiny against ~20 on SmolLM2, whose
30 layers it compiles unrolled. It keeps the default loop (unrolled on the CPU) and its
own load, and is compared with the scanned greedy run of the same config: the two loops
agree on its tokens too.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

import mdjax
from configs import common
from experiments import decode
from mdjax.checkpoints import load as checkpoints_load
from mdjax.checkpoints.registry import GGUF_MODELS
from mdjax.models.config import default_weight_dtype

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.py")
                 if p.stem not in ("__init__", "common") and not p.stem.startswith(("lm_", "heads_")))
LOSSLESS = ("greedy", "prompt_lookup", "speculative", "self_speculative", "lookahead", "jacobi",
            "speculative_tree", "medusa", "blockwise", "eagle")
# The prefill's token and a step or two's: under the suite's compile-cheap XLA flags a step
# of SmolLM2 runs unoptimised, ~0.45 CPU s a row, so a real model's config is mostly steps
NEW_TOKENS = 3
# a config's other sizes, cut as its budget is: the pipelines' and branches' tokens, and
# how many branches, candidates, samples or questions (two: still several, sharing a cache)
SIZES = {"branch_tokens": NEW_TOKENS, "candidate_tokens": NEW_TOKENS, "num_branches": 2,
         "num_candidates": 2, "num_samples": 2}
QUESTIONS = 2
# What the CLI run overrides in configs/greedy.py: code-tiny completing the held-out function,
# in float32 on any platform (its tokens are compared exactly with another layer loop's)
CLI_OVERRIDES = {"model": "code-tiny", "chat": False, "prompt": common.HELDOUT_FUNCTION,
                 "dtype": "float32"}


def _config(name: str):
  """configs/<name>.py at the test's sizes (`NEW_TOKENS`, `SIZES`, `QUESTIONS`)."""
  spec = importlib.util.spec_from_file_location(f"configs.{name}", REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.max_new_tokens = NEW_TOKENS
  config.update({field: size for field, size in SIZES.items() if field in config})
  if "questions" in config:
    config.questions = tuple(config.questions)[:QUESTIONS]
  return config


@pytest.fixture(scope="module", autouse=True)
def _scanned_models_loaded_once():
  """Every model this module loads (`mdjax.load` without a `layer_loop`) is scanned, and
  loaded once (no dtype and the platform's are one load): ten configs name SmolLM2, whose
  load from the conversion cache costs ~5 CPU s and proves nothing new after the first."""
  loaded, load = {}, mdjax.load

  def load_once(path_or_name, **options):
    options["dtype"] = options.get("dtype") or default_weight_dtype()
    key = (path_or_name, tuple(sorted(options.items())))
    if key not in loaded:
      loaded[key] = load(path_or_name, **options)
    return loaded[key]

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpoints_load, "default_layer_loop", lambda: "scan")  # what load asks
    patch.setattr(mdjax, "load", load_once)
    yield


@pytest.fixture(scope="module")
def greedy_of():
  """config -> the summary of greedy decoding with its model, prompt and settings (the
  fields configs/greedy.py has; a strategy's own options unused), decoded once per
  distinct such config: most configs share a model and prompt."""
  fields, done = sorted(_config("greedy")), {}

  def run(config):
    twin = _config("greedy")
    twin.update({k: config[k] for k in fields if k in config and k != "strategy"})
    key = json.dumps(twin.to_dict(), sort_keys=True)
    if key not in done:
      done[key] = decode.decode(twin)
    return done[key]

  return run


@pytest.fixture(scope="module")
def greedy_summary(greedy_of):
  """The CLI run's config decoded in this process, scanned (`greedy_of`: it is greedy)."""
  config = _config("greedy")
  config.update(CLI_OVERRIDES)
  return greedy_of(config)


def test_cli_prints_text_then_one_json_summary(greedy_summary):
  overrides = [f"--config.{field}={value}" for field, value in CLI_OVERRIDES.items()]
  result = subprocess.run([sys.executable, "-m", "experiments.decode", "--config=configs/greedy.py",
                           f"--config.max_new_tokens={NEW_TOKENS}", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  *text, last = result.stdout.splitlines()
  summary = json.loads(last)
  assert summary["sequences"] == greedy_summary["sequences"]
  assert summary["texts"][0] in "\n".join(text)


def _needs_real_model(name: str) -> bool:
  return _config(name).model in GGUF_MODELS


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.real_models) if _needs_real_model(name) else name
    for name in CONFIGS])
def test_config_runs(name, greedy_of, capsys):
  summary = decode.decode(_config(name))
  json.dumps(summary)  # what the CLI prints must be JSON
  printed = capsys.readouterr().out
  assert summary["strategy"] == name  # every config is named after its strategy
  assert summary["sequences"] and all(len(s) <= NEW_TOKENS for s in summary["sequences"])
  if name != "skeleton_fill":  # which prints the source with its bodies filled in instead
    assert all(t in printed for t in summary["texts"])
  if name in LOSSLESS:  # the same model and prompt, decoded by greedy (another run)
    assert summary["sequences"] == greedy_of(_config(name))["sequences"]
