"""experiments.tpu_fit: its search for the most rows that fit (on made-up memory: a few
compiles whatever the line), its reading of the compiler's refusals, and its --quick
run end to end (the tiny shape compiled for a v5e, rows 1 and 2: libtpu from
requirements-compile-targets.txt, no skip without it)."""

import json
import pathlib
import subprocess
import sys

import pytest

from experiments import fit_search

REPO = pathlib.Path(__file__).resolve().parent.parent
GIB = 2**30


def search(total, usable=15.75 * GIB, max_rows=1024, says_needed=True):
  """`largest_rows` on a device that fits `total(rows)` bytes up to `usable` (a refusal
  saying what it needed, to XLA's 0.01 GiB, when `says_needed`): the most rows and the
  row counts tried, in order."""
  tried = []

  def measure(rows):
    tried.append(rows)
    need = total(rows)
    if need <= usable:
      return dict(fits=True, total=need)
    return dict(fits=False, needed=round(need / GIB, 2) * GIB if says_needed else None)

  return fit_search.largest_rows(measure, usable=lambda: usable, max_rows=max_rows), tried


def test_a_linear_total_takes_four_compiles():
  most, tried = search(lambda rows: 2.3 * GIB + rows * 0.125 * GIB)
  assert most == 107  # (15.75 - 2.3) / 0.125 = 107.6
  assert tried == [1, 2, 107, 108]


def test_what_does_not_fit_one_row_or_two():
  assert search(lambda rows: 16 * GIB) == (0, [1])
  assert search(lambda rows: 15 * GIB + rows * 0.5 * GIB) == (1, [1, 2])


@pytest.mark.parametrize("says_needed", [True, False])
@pytest.mark.parametrize("total", [
    lambda rows: GIB + rows * 0.1 * GIB + (rows > 40) * 3 * GIB,  # a step: a layout change
    lambda rows: GIB + rows ** 1.5 * 0.01 * GIB,  # grows faster than the line
    lambda rows: GIB * (2 if rows == 1 else 1) + rows * 0.05 * GIB,  # row 1 needs more
])
def test_a_total_off_the_line_still_finds_the_most_rows(total, says_needed):
  most, tried = search(total, says_needed=says_needed)
  assert total(most) <= 15.75 * GIB < total(most + 1)
  assert len(tried) == len(set(tried)) <= 16


def test_a_first_row_that_needs_more_costs_a_refusal_at_the_cap():
  """As int8 weights do at one row (a temporary the size of the embedding): the line
  runs from the second row to what the cap needed."""
  most, tried = search(lambda rows: (2.3 if rows == 1 else 1.0) * GIB + rows * 0.125 * GIB)
  assert most == 118 and tried[:3] == [1, 2, 1024] and len(tried) <= 6


def test_rows_are_capped():
  assert search(lambda rows: GIB + rows * 1000, max_rows=64) == (64, [1, 2, 64])
  assert search(lambda rows: GIB, max_rows=2) == (2, [1, 2])


def test_a_refusal_gives_what_was_needed_and_what_the_chip_has():
  message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
             "HLO temporaries (15.96G) exceeds available HBM (15.75G).")
  found = fit_search.refusal(message)
  assert (found["needed"], found["available"]) == (round(15.96 * GIB), round(15.75 * GIB))
  assert fit_search.refusal("RESOURCE_EXHAUSTED: out of memory")["needed"] is None
  assert fit_search.refusal("INVALID_ARGUMENT: bad shape") is None


def test_quick_run_writes_its_json(tmp_path):
  subprocess.run([sys.executable, "-m", "experiments.tpu_fit", "--quick",
                  f"--out_dir={tmp_path}"], cwd=REPO, check=True, timeout=300,
                 capture_output=True)
  report = json.loads((tmp_path / "tpu_fit.json").read_text())
  assert report["target"] == "v5e" and report["memory_bytes"] == 16 * GIB
  assert report["models"]["tiny"]["num_layers"] == 2
  results = report["results"]
  assert [(r["weights"], r["cache"]) for r in results] == [
      ("bf16", "bf16"), ("int8", "bf16"), ("int8", "int8"), ("int4", "int8")]
  for r in results:
    assert (r["model"], r["context"], r["max_rows"], r["capped"]) == ("tiny", 128, 2, True)
    assert r["fits_one_row"] and [p["rows"] for p in r["points"]] == [1, 2]
    for p in r["points"]:
      assert p["fits"] and 0 < p["total"] < GIB and p["total"] >= p["argument"]
    assert r["bytes_one_row"] == r["points"][0]["total"]
    assert r["weight_bytes"] > 0 and r["cache_bytes_per_row"] > 0
  bf16, int8, _, int4 = (r["weight_bytes"] for r in results)
  assert int4 < int8 < bf16
  assert results[2]["cache_bytes_per_row"] < results[1]["cache_bytes_per_row"]  # int8 cache
