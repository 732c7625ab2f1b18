"""How int4 should group a model's weights: perplexity for each form, the measurement
behind `quantize="int4"`'s defaults (`mdjax.models.quantized.INT4_GROUP`, offsets, the
embedding int8).

    python3 -m experiments.bench.int4_groups          # SmolLM2 and Gemma 3 270M (~8 min)
    python3 -m experiments.bench.int4_groups --quick --out_dir=/tmp/int4   # smoke test

For each model, the float32 weights (the GGUF file dequantized) and, for each group size
of `--groups` that divides every matrix's inputs, every matrix quantized to int4:

- symmetric: absmax scales, q * scale (`quantize(..., offsets=False)`);
- offsets: each group's 16 levels span its own [min, max], q * scale + offset;

each then fit `--refits` times by least squares (`quantized.GROUP_REFITS` unless told;
`--refits=0`: the min-max grids alone),

with the embedding (and an untied head) int4 in the same form, or int8 (a scale per row,
what `quantize="int4"` keeps). Perplexity of the held-out passage of
`experiments.bench.quantized` (the same windows), and the bytes each form holds per weight
where int4 is packed (two values a byte; bfloat16 scales and offsets).

Writes `int4_groups.json` and `int4_groups.png` to `--out_dir`.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import sys
import time

from absl import app, flags
import jax
import tqdm

import mdjax
from mdjax.models.quantized import GROUP_REFITS
from experiments.bench.common import plt, results_dir, save_figure, write_results
from experiments.bench.quality import (input_widths, nll_program, packed_bytes_per_weight,
                                       passage, passage_ids, perplexity, with_int4)
from experiments.cli import check_argv, one_line_errors

_MODELS = flags.DEFINE_list("models", ["smollm2-135m-instruct", "gemma3-270m"], "Models.")
_GROUPS = flags.DEFINE_list("groups", ["32", "64", "128"], "int4 group sizes (inputs).")
_REFITS = flags.DEFINE_integer("refits", GROUP_REFITS, "Least-squares fits of each group's "
                               "grid after the min-max one (`quantized.quantize`).")
_PASSAGE_TOKENS = flags.DEFINE_integer("passage_tokens", 1024, "The passage's tokens at most.")
_WINDOW = flags.DEFINE_integer("window", 512, "Tokens per perplexity window.")
_STRIDE = flags.DEFINE_integer("stride", 256, "Tokens between perplexity windows' starts.")
_CORPUS = flags.DEFINE_string("corpus", "docs/design.md", "The passage's file (repository path).")
_CORPUS_COMMIT = flags.DEFINE_string("corpus_commit", "05f1f70", "The passage's commit.")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("quantized/int4_groups"),
                               "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: random-llama-tiny, groups of 16 and "
                           "32, 96 passage tokens.")

FORMS = ("symmetric", "offsets")
EMBEDDINGS = ("int4", "int8")


def bench_model(name: str, groups: list[int], refits: int, text: str, limit: int, window: int,
                stride: int) -> dict:
  model = mdjax.load(name, dtype="float32", layer_loop="unrolled")
  ids, lead = passage_ids(model, text, limit)
  usable = [g for g in groups if not any(size % g for size in input_widths(model.config))]

  def measure(params) -> float:
    return perplexity(dataclasses.replace(model, params=params), ids, lead, window,
                      stride)["perplexity"]

  rows = []
  for group, form, embedding in tqdm.tqdm(list(itertools.product(usable, FORMS, EMBEDDINGS)),
                                          desc=name, leave=False):
    offsets = form == "offsets"
    rows.append(dict(group=group, form=form, embedding=embedding,
                     perplexity=measure(with_int4(model.params, group, offsets, embedding,
                                                  refits)),
                     packed_bytes_per_weight=packed_bytes_per_weight(group, offsets)))
    nll_program.clear_cache()
    jax.clear_caches()
  return dict(float32_perplexity=measure(model.params), scored_tokens=len(ids) - 1,
              skipped_groups=[g for g in groups if g not in usable], rows=rows)


def plot(results: dict, path) -> None:
  names = list(results["models"])
  fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 3.8), squeeze=False)
  for ax, name in zip(axes[0], names):
    entry = results["models"][name]
    for form, embedding in itertools.product(FORMS, EMBEDDINGS):
      rows = [r for r in entry["rows"] if (r["form"], r["embedding"]) == (form, embedding)]
      ax.plot([r["group"] for r in rows], [r["perplexity"] for r in rows], marker="o",
              label=f"{form}, embedding {embedding}")
    ax.axhline(entry["float32_perplexity"], color="black", linestyle=":", label="float32")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("int4 group (inputs)")
    ax.set_ylabel("perplexity")
    ax.set_title(name, fontsize=9)
    ax.legend(fontsize=7)
  save_figure(fig, path, "int4: perplexity by group, form and embedding")


def table(results: dict) -> str:
  lines = []
  for name, entry in results["models"].items():
    lines += [f"{name}: float32 {entry['float32_perplexity']:.2f}",
              "| group | form | embedding | perplexity | packed bytes per weight |",
              "|--:|---|---|--:|--:|"]
    lines += [f"| {r['group']} | {r['form']} | {r['embedding']} | {r['perplexity']:.2f} | "
              f"{r['packed_bytes_per_weight']:.3f} |" for r in entry["rows"]]
  return "\n".join(lines)


@one_line_errors
def main(argv):
  check_argv(argv)
  quick = _QUICK.value
  models = ["random-llama-tiny"] if quick else _MODELS.value
  groups = [16, 32] if quick else [int(g) for g in _GROUPS.value]
  text = passage(_CORPUS.value, _CORPUS_COMMIT.value)
  limit, window, stride = (96, 48, 24) if quick else (_PASSAGE_TOKENS.value, _WINDOW.value,
                                                      _STRIDE.value)
  start = time.perf_counter()
  results = dict(refits=_REFITS.value,
                 models={name: bench_model(name, groups, _REFITS.value, text, limit, window,
                                           stride) for name in models})
  results.update(command="python3 -m experiments.bench.int4_groups " + " ".join(sys.argv[1:]),
                 date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 seconds=time.perf_counter() - start)
  write_results(results, _OUT_DIR.value, "int4_groups", plot, table)


if __name__ == "__main__":
  app.run(main)
