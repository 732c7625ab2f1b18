"""experiments.bench.spec_bench: method specs, and a whole report on a tiny random model.

No timing is asserted: the report measures, the test checks that it can, and that every
lossless method reproduces greedy's tokens at temperature 0 (float32: exactly)."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import mdjax
from experiments.bench import spec_bench
from experiments.bench.common import Prompt, random_ids, write_results
from mdjax.errors import MdjaxError

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_method_spec_parses_label_strategy_and_options():
  method = spec_bench.Method.parse("mix=medusa:heads=medusa,tree_budget=4,top_p=0.5")
  assert (method.label, method.strategy) == ("mix", "medusa")
  assert dict(method.given) == {"heads": "medusa", "tree_budget": 4, "top_p": 0.5}
  assert spec_bench.Method.parse("prompt_lookup").label == "prompt_lookup"
  assert spec_bench.parse_value("prompt_lookup+heads") == ["prompt_lookup", "heads"]
  assert spec_bench.parse_value("true") is True and spec_bench.parse_value("auto") == "auto"


@pytest.mark.parametrize("spec, named", [("nope", "'nope'"), ("medusa:heads", "'heads'"),
                                         ("greedy", "'greedy'"), ("medusa:depth=3", "'depth'"),
                                         ("medusa:temperature=1", "temperature")])
def test_a_bad_method_spec_is_an_error_naming_it(spec, named):
  with pytest.raises(MdjaxError, match=named):
    spec_bench.Method.parse(spec)


def test_report_on_a_tiny_random_model(tmp_path):
  """Batch 2 (a kind's one prompt filling both rows: batch 1 runs the same code),
  temperatures 0 and 0.7: a cell per kind and overall for every contender, the baseline
  at 1 token per pass, greedy's tokens at T=0, prompt lookup left out at T=0.7 (it
  decodes greedily only), auto's choices kept; then the JSON, PNG and README written."""
  model = mdjax.load("random-llama-tiny")
  rng = np.random.default_rng(0)
  prompts = [Prompt(kind, random_ids(rng, model.config.vocab_size, 12).tolist())
             for kind in ("writing", "coding")]
  methods = {m.label: (m.strategy, m.options(model, quick=True))
             for m in map(spec_bench.Method.parse, ("prompt_lookup", "medusa:heads=medusa"))}
  settings = spec_bench.Settings(kinds=(), prompts_per_kind=1, max_new_tokens=4, batches=(2,),
                                 temperatures=(0.0, 0.7), repeats=1)
  header = dict(machine=dict(cpu_count=1, load_average=0.0), command="test")
  results = spec_bench.run(model, methods, prompts, settings, header)

  assert list(results["runs"]) == ["batch 2, T=0", "batch 2, T=0.7"]
  assert results["mismatches"] == []
  for key, entry in results["runs"].items():
    greedy = entry["temperature"] == 0
    names = ["greedy", "prompt_lookup", "medusa"] if greedy else ["sample", "medusa"]
    assert entry["left_out"] == ({} if greedy else
                                 {"prompt_lookup": "prompt_lookup decodes greedily only"})
    assert list(entry["kinds"]) == ["writing", "coding"]
    for cells in [entry["overall"], *entry["kinds"].values()]:
      assert list(cells) == names
      assert cells[names[0]]["tokens_per_pass"] == pytest.approx(1.0)
      assert cells[names[0]]["speedup"] == pytest.approx(1.0)
      for name in names[1:]:
        cell = cells[name]
        assert cell["speedup"] > 0 and cell["tokens_per_pass"] >= 1.0
        assert cell.get("identical_to_greedy", None) is (True if greedy else None), (key, name)
    for cells in entry["kinds"].values():
      assert cells["medusa"]["choices"] and "tree_choice" in cells["medusa"]["choices"][0]
    assert entry["overall"][names[0]]["steps"] == 4 * 2  # 4 tokens a row; 2 kinds, a group each

  write_results(results, str(tmp_path), spec_bench.STEM, spec_bench.plot, spec_bench.table)
  assert (tmp_path / "spec_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert json.loads((tmp_path / "spec_bench.json").read_text())["runs"].keys() == results[
      "runs"].keys()
  readme = spec_bench.readme(results)
  assert "| method | writing | coding | overall |" in readme and "## batch 2, T=0.7" in readme
  assert "stopped" not in readme
  del results["runs"]["batch 2, T=0.7"]  # a run stopped there: its README says so
  assert "stopped before it finished batch 2, T=0.7" in spec_bench.readme(results)


def test_cli_bad_method_is_one_error_line(tmp_path):
  done = subprocess.run([sys.executable, "-m", "experiments.bench.spec_bench", "--quick",
                         "--methods=nope", f"--out_dir={tmp_path}"],
                        cwd=REPO, timeout=600, capture_output=True, text=True)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1].startswith("error: unknown strategy 'nope'")
