"""A missing optional package (torch for the transformers oracle, jinja2 for chat
templates) is one clear `MissingPackageError` naming it and the pip command, and on the
command line one `error: ...` line, exit code 1, no traceback. `sys.modules[name] = None`
makes `import name` fail as if the package were not installed."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest
import tokenizers
import transformers
from tokenizers import models, pre_tokenizers

import mdjax
from mdjax import chat
from mdjax.errors import MissingPackageError, require

from helpers import random_model

REPO = pathlib.Path(__file__).resolve().parents[1]
TORCH_MESSAGE = ("the transformers oracle needs the package 'torch', which is not installed: "
                 "python3 -m pip install torch==2.13.0")


def test_require_names_the_package_and_the_pip_command(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)
  with pytest.raises(MissingPackageError) as raised:
    require("torch", "the transformers oracle", "torch==2.13.0")
  assert str(raised.value) == TORCH_MESSAGE
  assert isinstance(raised.value, mdjax.MdjaxError) and isinstance(raised.value, ImportError)
  assert require("json", "a test").dumps([]) == "[]"  # installed: the module itself


def test_benchlib_runs_without_torch(monkeypatch):
  """The oracle's torch is imported on use; machine_info then leaves its fields out."""
  from experiments.bench import common as benchlib

  monkeypatch.setitem(sys.modules, "torch", None)
  with pytest.raises(MissingPackageError, match="torch==2.13.0"):
    benchlib.torch_oracle()
  assert not {"torch", "torch_threads"} & set(benchlib.machine_info({}))


def _chat_model() -> mdjax.Model:
  """A random model whose tiny word-level tokenizer has a chat template."""
  words = ["[UNK]", "user:", "assistant:", "Hi"]
  tokenizer = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                                    unk_token="[UNK]"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  template = ("{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"
              "{% if add_generation_prompt %}assistant:{% endif %}")
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template)
  return dataclasses.replace(random_model(), tokenizer=fast)


def test_a_chat_template_without_jinja2_is_a_clear_error(monkeypatch):
  model = _chat_model()
  assert chat.chat_ids(model, "Hi") == [1, 3, 2]  # with jinja2: the template renders
  monkeypatch.setitem(sys.modules, "jinja2", None)
  with pytest.raises(MissingPackageError, match=r"a chat template needs the package 'jinja2', "
                                                r"which is not installed: python3 -m pip install "
                                                r"jinja2$"):
    chat.chat_ids(model, "Hi")


def test_cli_without_torch_prints_one_line():
  """bench_decode fails at the oracle before any work: one line, exit 1, no traceback."""
  hide_torch = ("import runpy, sys; sys.modules['torch'] = None; "
                "sys.argv = ['bench_decode', '--quick', '--out_dir=unused']; "
                "runpy.run_module('experiments.bench.decode', run_name='__main__')")
  run = subprocess.run([sys.executable, "-c", hide_torch], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
  assert run.returncode == 1, run.stderr
  assert "Traceback" not in run.stderr
  errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
  assert errors == ["error: " + TORCH_MESSAGE], run.stderr
  assert not (REPO / "unused").exists()
