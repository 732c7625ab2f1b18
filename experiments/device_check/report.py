"""What the check writes to `--out_dir`: `device_check_<device kind>.json` (every
section's numbers, or its error and traceback) and `.png`, one panel per section with
numbers to draw (roofline, pass cost, variants, branches, heads, profile; the tests'
counts in the title), each rewritten atomically after every section.
"""

from __future__ import annotations

import pathlib
import traceback

import numpy as np

from experiments.bench.common import plt, save_figure, write_json
from mdjax import files


def panel_error(ax, section: dict | None, title: str) -> bool:
  """Writes why a section has no numbers into its panel; True when it has none."""
  if section is not None and "error" not in section:
    return False
  ax.text(0.5, 0.5, "not run" if section is None else section["error"][:120], ha="center",
          va="center", wrap=True, fontsize=8)
  ax.set_title(title, fontsize=9)
  ax.set_axis_off()
  return True


def plot_roofline(ax, section) -> None:
  if panel_error(ax, section, "roofline"):
    return
  batches = list(section["batches"])
  ax.plot([int(b) for b in batches],
          [section["batches"][b]["roofline_fraction"] for b in batches], "o-")
  ax.set_xscale("log", base=2)
  ax.set_xticks([int(b) for b in batches], batches)
  ax.axhline(1, color="black", lw=0.8)
  ax.set_xlabel("batch")
  ax.set_ylabel("roofline time / measured decode step")
  ax.set_title("greedy: fraction of the HBM roofline", fontsize=9)


def plot_pass_cost(ax, section) -> None:
  if panel_error(ax, section, "pass cost"):
    return
  for batch, cells in section["batches"].items():
    ax.plot([int(n) for n in cells], [cell["ratio_to_first"] for cell in cells.values()], "o-",
            label=f"batch {batch} (t(1) = {cells['1']['ms']:.2f} ms)")
  ax.set_xscale("log", base=2)
  ax.legend(fontsize=7)
  ax.set_xlabel(f"tokens per row per pass (after {section['prefix']} cached)")
  ax.set_ylabel("t(n) / t(1)")
  ax.set_title("the target's pass cost", fontsize=9)


def plot_variants(ax, section) -> None:
  if panel_error(ax, section, "variants"):
    return
  section = section["contexts"]
  names = list(next(iter(section.values())))
  width = 0.8 / len(section)
  for i, (context, cells) in enumerate(section.items()):
    ax.bar(np.arange(len(names)) + i * width, [cells[v]["decode_ms_per_token"] for v in names],
           width, label=f"context {context}")
  ax.set_xticks(np.arange(len(names)) + width * (len(section) - 1) / 2,
                [v + "\n" + ", ".join(f"{c[v]['compile_s']:.1f}s" for c in section.values())
                 for v in names], fontsize=7)
  ax.set_ylabel("greedy decode ms per token")
  ax.set_title("layer loop / attention (under each: compile s per context)", fontsize=9)
  ax.legend(fontsize=7)


def plot_branches(ax, section) -> None:
  if panel_error(ax, section, "branches"):
    return
  names = list(section["branches"]) + ["prompt_lookup"]
  base = section["branches"]["sequential"]["seconds"]
  speedups = [base / section["branches"][m]["seconds"] for m in section["branches"]]
  speedups.append(section["prompt_lookup"]["speedup_vs_greedy"])
  ax.bar(names, speedups, color=["tab:blue", "tab:gray", "tab:orange", "tab:green"])
  ax.axhline(1, color="black", lw=0.8)
  ax.set_ylabel("speedup (branches: vs sequential;\nprompt lookup: vs greedy)")
  ax.set_title(f"{section['questions']} questions over {section['context_len']} tokens; "
               "copy-heavy prompt", fontsize=9)


def plot_heads(ax, section) -> None:
  """Each head contender's speed over greedy's per batch; auto's bars hatched."""
  if panel_error(ax, section, "head strategies (random heads)"):
    return
  batches = list(section["batches"])
  names = list(section["batches"][batches[0]]["contenders"]) + ["mix@auto (copy)"]
  width = 0.8 / len(batches)
  for i, batch in enumerate(batches):
    cells = section["batches"][batch]["contenders"] | {
        "mix@auto (copy)": section["batches"][batch]["mix"]}
    bars = ax.bar(np.arange(len(names)) + i * width,
                  [cells[n]["speedup_vs_greedy"] for n in names], width, label=f"batch {batch}")
    for bar, name in zip(bars, names):
      bar.set_hatch("//" if "@auto" in name else "")
  ax.axhline(1, color="gray", lw=0.8)
  ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=45, ha="right",
                fontsize=7)
  ax.set_ylabel("speed vs greedy (random heads: ~no acceptance)")
  ax.set_title("head strategies: auto (hatched) and fixed trees")
  ax.legend(fontsize=8)


def plot_profile(ax, section) -> None:
  if panel_error(ax, section, "profile"):
    return
  top = section["top"][:12][::-1]
  ax.barh(range(len(top)), [100 * k["share"] for k in top])
  ax.set_yticks(range(len(top)), [f"{k['kernel'][:28]} x{k['runs_per_generation'] / section['new_tokens']:.3g}"
                                  for k in top], fontsize=6)
  for y, k in enumerate(top):
    if k["gbps"]:
      ax.text(100 * k["share"], y, f" {k['gbps']:,.0f} GB/s", va="center", fontsize=6)
  ax.set_xlabel("% of kernel time (x: runs per step)")
  ax.set_title(f"greedy, batch 1: {section['kernel_ms_per_step']:.3f} ms of kernels per step "
               f"in {section['wall_ms_per_step']:.3f} ms", fontsize=9)


def plot(results: dict, path: pathlib.Path) -> None:
  fig, axes = plt.subplots(3, 2, figsize=(13, 13))
  sections = results["sections"]
  for ax, (name, draw) in zip(axes.flat, (("roofline", plot_roofline),
                                          ("pass_cost", plot_pass_cost),
                                          ("variants", plot_variants),
                                          ("branches", plot_branches),
                                          ("heads", plot_heads),
                                          ("profile", plot_profile))):
    draw(ax, sections.get(name))
  tests = sections.get("tests")
  tested = ("tests not run" if tests is None else tests.get("error") or
            f"accelerator tests: {tests['passed']} passed, {tests['failures']} failed, "
            f"{tests['errors']} errors")
  model = results["model"]
  save_figure(fig, path, f"device check on {results['device']['device_kind']}: {model['name']} "
              f"({model['num_params'] / 1e6:.3g}M parameters, {model['dtype']})\n{tested}")


def write_outputs(results: dict, out_dir: pathlib.Path, stem: str) -> None:
  """The JSON, then the plot (each atomically); a plot that fails is recorded in the
  JSON rather than ending the run."""
  write_json(out_dir / f"{stem}.json", results)
  results.pop("plot_error", None)
  try:
    with files.atomic_file(out_dir / f"{stem}.png") as partial:
      plot(results, partial)
  except Exception:  # recorded; the numbers are in the JSON
    results["plot_error"] = traceback.format_exc()
    write_json(out_dir / f"{stem}.json", results)
