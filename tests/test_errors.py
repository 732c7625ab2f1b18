"""Bad input raises one clear `MdjaxError` naming the offending value (docs/design.md §11),
through the API and through `python -m experiments.decode` (one stderr line, exit != 0,
no traceback).

Every CLI case is a separate process that imports JAX, so the module starts them all
at once on a small pool and each test waits for its own.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys

import pytest

import mdjax

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = "random-llama-tiny"  # vocab 256, max_position_embeddings 512, EOS 2
# The default model and prompt are the shipped code model's; the tiny one has no tokenizer.
TINY_ARGS = [f"--config.model={TINY}", "--config.prompt=", "--config.prompt_ids=1,15,27,100,7,42",
             "--config.chat=False", "--config.compare_sequential=False"]
CLI_WORKERS = 3
CLI_TIMEOUT_S = 300
HAPPY_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model():
  return mdjax.load(TINY)


def test_mdjax_error_is_a_value_error():
  assert issubclass(mdjax.MdjaxError, ValueError)
  assert issubclass(mdjax.CheckpointError, mdjax.MdjaxError)


API_CASES = {  # name: (call on the tiny model, regex its message must match)
    "unknown strategy": (lambda m: mdjax.generate(m, [1, 2], strategy="bogus"),
                         r"unknown strategy 'bogus'; valid strategies: .*greedy.*sample"),
    "strategy not a name": (lambda m: mdjax.generate(m, [1, 2], strategy=None),
                            r"strategy must be a name, got None"),
    "negative id": (lambda m: mdjax.generate(m, [1, -3]), r"token id -3 outside"),
    "id == vocab": (lambda m: mdjax.generate(m, [1, 256]), r"token id 256 outside .*256"),
    "bad id in second prompt": (lambda m: mdjax.generate(m, [[1, 2], [3, 300]]),
                                r"prompt 1 has token id 300"),
    "float ids": (lambda m: mdjax.generate(m, [[1.5, 2.0]]),
                  r"prompt 0 must be text or integer token ids, got \[1\.5, 2\.0\]"),
    "empty prompt": (lambda m: mdjax.generate(m, [[]]), r"prompt 0 is empty"),
    "empty prompt list": (lambda m: mdjax.generate(m, []), r"non-empty list .*got \[\]"),
    "negative max_new_tokens": (lambda m: mdjax.generate(m, [1, 2], max_new_tokens=-1),
                                r"max_new_tokens must be an integer >= 0, got -1"),
    "fractional max_new_tokens": (lambda m: mdjax.generate(m, [1, 2], max_new_tokens=2.5),
                                  r"max_new_tokens .*got 2\.5"),
    "beyond context": (lambda m: mdjax.generate(m, [1] * 500, max_new_tokens=20),
                       r"500 \+ max_new_tokens 20 = 520 .*max_position_embeddings=512"),
    "negative temperature": (lambda m: mdjax.generate(m, [1, 2], strategy="sample",
                                                      temperature=-1),
                             r"temperature must be a finite number >= 0, got -1"),
    "text temperature": (lambda m: mdjax.generate(m, [1, 2], strategy="sample",
                                                  temperature="hot"),
                         r"temperature must be a finite number >= 0, got 'hot'"),
    "infinite temperature": (lambda m: mdjax.generate(m, [1, 2], strategy="sample",
                                                      temperature=float("inf")),
                             r"temperature must be a finite number >= 0, got inf"),
    "top_p 0": (lambda m: mdjax.generate(m, [1, 2], strategy="sample", top_p=0),
                r"top_p must be in \(0, 1\], got 0"),
    "top_p 1.5": (lambda m: mdjax.generate(m, [1, 2], strategy="sample", top_p=1.5),
                  r"top_p must be in \(0, 1\], got 1\.5"),
    "top_k -1": (lambda m: mdjax.generate(m, [1, 2], strategy="sample", top_k=-1),
                 r"top_k must be an integer >= 0, got -1"),
    "top_k fractional": (lambda m: mdjax.generate(m, [1, 2], strategy="sample", top_k=2.5),
                         r"top_k must be an integer >= 0, got 2\.5"),
    "min_p 2": (lambda m: mdjax.generate(m, [1, 2], strategy="sample", min_p=2),
                r"min_p must be in \[0, 1\], got 2"),
    "unknown option": (lambda m: mdjax.generate(m, [1, 2], strategy="sample", num_beams=2),
                       r"unknown option 'num_beams' for strategy 'sample'; valid options: "
                       r".*temperature"),
    "sampling option for greedy": (lambda m: mdjax.generate(m, [1, 2], temperature=0.5),
                                   r"unknown option 'temperature' for strategy 'greedy'"),
    "bad attention": (lambda m: mdjax.generate(m, [1, 2], attention="flash"),
                      r"attention must be .*got 'flash'"),
    "eos out of vocab": (lambda m: mdjax.generate(m, [1, 2], eos_token_id=256),
                         r"eos_token_id 256 is not a token id in \[0, 256\)"),
    "negative eos": (lambda m: mdjax.generate(m, [1, 2], eos_token_id=[2, -1]),
                     r"eos_token_id -1 is not a token id"),
    "text seed": (lambda m: mdjax.generate(m, [1, 2], seed="x"),
                  r"seed must be an integer, got 'x'"),
    "text without tokenizer": (lambda m: mdjax.generate(m, "hello"),
                               rf"prompt 0 is text but the model '{TINY}' has no tokenizer"),
    "forward_logits id out of vocab": (lambda m: mdjax.forward_logits(m, [1, 999]),
                                       r"token id 999 outside"),
    "forward_logits empty": (lambda m: mdjax.forward_logits(m, []), r"prompt 0 is empty"),
    "forward_logits text": (lambda m: mdjax.forward_logits(m, "hi"), r"has no tokenizer"),
    "forward_logits too long": (lambda m: mdjax.forward_logits(m, [1] * 600),
                                r"600 .* max_position_embeddings=512"),
    "bad dtype": (lambda m: mdjax.load(TINY, dtype="float16"),
                  r"dtype 'float16'.*float32, bfloat16"),
    "missing model path": (lambda m: mdjax.load("/nonexistent/model"), r"'/nonexistent/model'"),
}


@pytest.mark.parametrize("case", API_CASES)
def test_api_error(model, case):
  call, match = API_CASES[case]
  with pytest.raises(mdjax.MdjaxError, match=match):
    call(model)


# One case per way a bad value reaches the CLI (flag parsing, config file, the model's
# load, the prompt, after loading the model, strategy options, the draft): every
# `MdjaxError` leaves through the one handler (`experiments.cli.one_line_errors`), and
# the API cases above cover every value.
CLI_CASES = {  # name: (arguments after the module, regex the one stderr line must match)
    "missing config file": (["--config=configs/nope.py"], r"configs/nope\.py"),
    "non-integer override": (["--config=configs/greedy.py", "--config.max_new_tokens=abc"],
                             r"max_new_tokens=abc"),
    "unknown field": (["--config=configs/greedy.py", "--config.bogus=1"], r"'bogus'"),
    "unknown strategy": (["--config.strategy=bogus"], r"unknown strategy 'bogus'.*greedy"),
    "missing model": (["--config.model=/nonexistent"], r"'/nonexistent'"),
    "malformed prompt_ids": (["--config.prompt_ids=1,x"], r"prompt_ids .*'1,x'"),
    "id out of vocab": (["--config.prompt_ids=1,99999"], r"token id 99999 outside"),
    "empty prompt": (["--config.prompt_ids="], r"prompt 0 is empty"),
    "text without tokenizer": (["--config.prompt=hello"], r"has no tokenizer"),
    "negative temperature": (["--config=configs/sample.py", "--config.temperature=-1"],
                             r"temperature must be a finite number >= 0, got -1"),
    "draft of another vocabulary": (["--config=configs/speculative.py", "--config.draft=random-llama"],
                                    r"draft's vocabulary \(4096 tokens\) .* target's \(256"),
    "draft schedule": (["--config=configs/speculative.py", f"--config.draft={TINY}",
                        "--config.draft_schedule=fast"], r"draft_schedule .* got 'fast'"),
    "chat without a template": (["--config.chat=True", "--config.prompt=hello"],
                                r"chat=True needs a chat template.*'random-llama-tiny'"),
    "question text, no tokenizer": (["--config=configs/multi_question.py", "--config.questions=('a',)"],
                       r"has no tokenizer"),
}


def _cli_args(args: list[str]) -> list[str]:
  """`args` on the tiny model, with configs/greedy.py unless they name a config (first:
  config_flags rejects overrides before it)."""
  config = [a for a in args if a.startswith("--config=")] or ["--config=configs/greedy.py"]
  return config + TINY_ARGS + [a for a in args if a not in config]


def _decode(args: list[str]) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.decode", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
  """Every CLI case, plus the happy path (key None), running concurrently."""
  output_json = tmp_path_factory.mktemp("decode") / "out.json"
  happy = ["--config=configs/greedy.py", *TINY_ARGS,
           f"--config.max_new_tokens={HAPPY_NEW_TOKENS}", f"--output_json={output_json}"]
  with concurrent.futures.ThreadPoolExecutor(CLI_WORKERS) as pool:
    runs = {None: pool.submit(_decode, happy)}
    runs.update({case: pool.submit(_decode, _cli_args(args))
                 for case, (args, _) in CLI_CASES.items()})
    yield runs, output_json
    for run in runs.values():
      run.cancel()


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_error(cli_runs, case):
  result = cli_runs[0][case].result()
  assert result.returncode != 0
  assert "Traceback" not in result.stdout + result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  assert re.search(CLI_CASES[case][1], lines[0]), lines[0]


def test_cli_greedy_matches_api(cli_runs, model):
  runs, output_json = cli_runs
  result = runs[None].result()
  assert result.returncode == 0, result.stderr
  assert result.stderr == ""
  lines = result.stdout.splitlines()
  assert lines[0] == model.description and "RANDOM WEIGHTS" in lines[0]
  summary = json.loads(output_json.read_text())
  assert lines[-1] == f"--- summary (JSON): {output_json}"  # the file, not the terminal
  assert not any(line.startswith("{") for line in lines)
  assert summary["model"] == TINY and summary["strategy"] == "greedy"
  assert {"target_passes", "generated_tokens", "wall_s"} <= set(summary["stats"])
  out = mdjax.generate(model, [summary["prompt_tokens"]], strategy="greedy",
                       max_new_tokens=HAPPY_NEW_TOKENS)
  assert summary["sequences"] == out.sequences
  assert lines[1] == " ".join(map(str, out.sequences[0]))
