"""What quantized weights cost in quality and what they save in bytes and time on this CPU.

    nice python3 -m experiments.bench.quantized          # SmolLM2 and Gemma 3 270M (an hour)
    python3 -m experiments.bench.quantized --quick       # smoke test: a tiny random llama

For each model of `--models`, one row per scheme: float32, bfloat16 (`mdjax.load(dtype=)`),
int8 (a scale per output column), int4 (groups of `--group` inputs with offsets, or the
largest power of two below it that divides every matrix's inputs; the embedding int8) and
gguf (the GGUF file's own blocks; `mdjax.load(quantize=)`, activations float32):

1. **Quality.** Perplexity of a held-out English passage (`passage`: the prose of
   docs/design.md at a pinned commit, code blocks and tables dropped, written after the
   models were trained), `causal_logits` (as its halves `forward_causal` and
   `lm_head`) over windows of `--window` tokens every `--stride`, each token scored
   once; greedy agreement with float32 (and its float32 cache) over `--new_tokens`
   tokens of 4 prompts (EOS off), with a bfloat16 and an int8 KV cache
   (`kv_cache_dtype`): the fraction of positions before each row's first divergence and
   the mean identical prefix; the shipped EAGLE and Medusa heads' tokens per target
   pass (greedy, the same prompts and tokens, a tree of 16 nodes) where the model has
   them; the weight bytes (every leaf's, a `QuantizedWeight`'s q, scales and offsets)
   against float32's.
2. **Speed.** Seconds per token after the first of greedy at each batch of `--batches`
   and of `mixed` (shipped EAGLE head and prompt lookup) at batch 1 where the model has a
   shipped head: the schemes interleaved in every repeat (rotated), the median of
   `--repeats`, each against float32's of the same run; `uptime` before and after.

Writes `bench_quantized.json` and `bench_quantized.png`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import functools
import gc
import hashlib
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags
import jax
import numpy as np
import tqdm

import mdjax
from experiments.bench.common import (bars, interleaved, machine_info, machine_line,
                                      memory_bandwidth, plt, results_dir, save_figure,
                                      write_results)
from experiments.bench.quality import (agreement, int4_group, nll_program, passage,
                                       passage_ids, perplexity, weight_bytes)
from experiments.cli import one_line_errors
from mdjax import chat
from mdjax.heads import shipped_heads
from mdjax.models.quantized import INT4_GROUP

_MODELS = flags.DEFINE_list("models", ["smollm2-135m-instruct", "gemma3-270m"], "Models.")
_SCHEMES = flags.DEFINE_list("schemes", ["float32", "bfloat16", "int8", "int4", "gguf"],
                             "Schemes (float32 first: the reference).")
_GROUP = flags.DEFINE_integer("group", INT4_GROUP, "int4's group (inputs per scale) where it "
                              "divides.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 256, "Greedy tokens per prompt (agreement).")
_PASSAGE_TOKENS = flags.DEFINE_integer("passage_tokens", 1024, "The passage's tokens at most.")
_WINDOW = flags.DEFINE_integer("window", 512, "Tokens per perplexity window.")
_STRIDE = flags.DEFINE_integer("stride", 256, "Tokens between perplexity windows' starts.")
_CORPUS = flags.DEFINE_string("corpus", "docs/design.md", "The passage's file (repository path).")
_CORPUS_COMMIT = flags.DEFINE_string("corpus_commit", "05f1f70",
                                     "The commit the file is read at ('': the working tree).")
_STEP_TOKENS = flags.DEFINE_integer("step_tokens", 64, "Tokens of each timed generation.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "Greedy's timed batches.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (median).")
_MIXED = flags.DEFINE_bool("mixed", True, "Time `mixed` at batch 1 where a head is shipped.")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("quantized"), "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: random-llama-tiny in float32, int8, "
                           "int4; 8 tokens of 2 prompts; 96 random ids in windows of 48; "
                           "greedy at batch 2, one repeat; no mixed.")

PROMPTS = ("Write a short story about a lighthouse keeper and a storm.",
           "Explain how a refrigerator keeps food cold.",
           "What are three good habits for learning a new language?",
           "Describe the water cycle to a ten-year-old.")
KV_CACHES = {"bfloat16": "bfloat16", "int8": "int8"}  # the caches of agreement
HEADS = ("eagle", "medusa")  # strategies whose shipped heads' acceptance is measured,
HEAD_OPTIONS = dict(tree_budget=16)  # on one fixed tree for every scheme
MIXED_OPTIONS = dict(prompt_lookup_num_tokens=4, tree_budget=16)  # as the controls bench's mix


@dataclasses.dataclass(frozen=True)
class Settings:
  models: tuple[str, ...]
  schemes: tuple[str, ...]
  group: int
  prompts: int
  new_tokens: int
  passage_tokens: int
  window: int
  stride: int
  step_tokens: int
  batches: tuple[int, ...]
  repeats: int
  mixed: bool


def settings() -> Settings:
  if _QUICK.value:
    return Settings(models=("random-llama-tiny",), schemes=("float32", "int8", "int4"),
                    group=_GROUP.value, prompts=2, new_tokens=8, passage_tokens=96, window=48,
                    stride=24, step_tokens=8, batches=(2,), repeats=1, mixed=False)
  s = Settings(models=tuple(_MODELS.value), schemes=tuple(_SCHEMES.value), group=_GROUP.value,
               prompts=len(PROMPTS), new_tokens=_NEW_TOKENS.value,
               passage_tokens=_PASSAGE_TOKENS.value, window=_WINDOW.value, stride=_STRIDE.value,
               step_tokens=_STEP_TOKENS.value, batches=tuple(int(b) for b in _BATCHES.value),
               repeats=_REPEATS.value, mixed=_MIXED.value)
  if s.schemes[0] != "float32":
    raise app.UsageError("--schemes must start with float32 (the reference)")
  if not 0 < s.stride <= s.window - 1 or s.step_tokens < 2:
    raise app.UsageError("need 0 < --stride < --window and --step_tokens >= 2")
  return s


def load(name: str, scheme: str, group: int) -> mdjax.Model:
  """The model under `scheme` (a float dtype, or a `quantize` with float32 activations)."""
  if scheme in ("float32", "bfloat16"):
    return mdjax.load(name, dtype=scheme)
  return mdjax.load(name, dtype="float32", quantize=scheme,
                    quantize_group=group if scheme == "int4" else None)


def prompt_ids(model: mdjax.Model, count: int) -> tuple[list[list[int]], str]:
  """The first `count` prompts: a chat turn where the model has a template, else the
  text itself; random ids without a tokenizer."""
  if model.tokenizer is None:
    rng = np.random.default_rng(1)
    return [rng.integers(3, model.config.vocab_size, 12).tolist() for _ in range(count)], "random"
  if getattr(model.tokenizer, "chat_template", None):
    return [chat.chat_ids(model, text) for text in PROMPTS[:count]], "chat"
  return [model.tokenizer(text).input_ids for text in PROMPTS[:count]], "plain"


def quality(models: dict, reference_name: str, text: str, s: Settings) -> dict:
  """Per scheme: bytes, perplexity, agreement with float32's greedy tokens (its own
  float32 cache) under each KV cache (`KV_CACHES`), and the shipped heads' tokens per
  target pass (`HEADS`, where `reference_name` has them; greedy, the weights' cache)."""
  reference = models["float32"]
  ids, lead = passage_ids(reference, text, s.passage_tokens)
  prompts, prompt_format = prompt_ids(reference, s.prompts)
  base = weight_bytes(reference.params)
  expected = mdjax.generate(reference, prompts, max_new_tokens=s.new_tokens,
                            eos_token_id=[]).sequences
  heads = {strategy: mdjax.load_heads(f"{reference_name}-{strategy}") for strategy in HEADS
           if f"{reference_name}-{strategy}" in shipped_heads()}
  rows = {}
  for scheme, model in tqdm.tqdm(models.items(), desc=f"quality {reference_name}", leave=False):
    cell = dict(label=model.quantization or scheme, dtype=str(model.params["embed"].dtype))
    held = weight_bytes(model.params)
    cell.update(weight_bytes=held["held"], weight_bytes_packed=held["packed"],
                weight_ratio=held["held"] / base["held"],
                weight_ratio_packed=held["packed"] / base["held"])
    cell.update(perplexity(model, ids, lead, s.window, s.stride))
    cell["agreement"], cell["kv_cache_bytes"], cell["heads"] = {}, {}, {}
    for cache, kv_dtype in KV_CACHES.items():
      out = mdjax.generate(model, prompts, max_new_tokens=s.new_tokens, eos_token_id=[],
                           kv_cache_dtype=kv_dtype)
      cell["agreement"][cache] = agreement(expected, [list(map(int, r)) for r in out.sequences])
      cell["kv_cache_bytes"][cache] = int(out.stats["kv_cache_bytes"])
    for strategy, head in heads.items():
      out = mdjax.generate(model, prompts, strategy=strategy, heads=head,
                           max_new_tokens=s.new_tokens, eos_token_id=[], **HEAD_OPTIONS)
      cell["heads"][strategy] = dict(tokens_per_pass=float(out.stats["tokens_per_pass"]),
                                     target_passes=int(out.stats["target_passes"]))
    rows[scheme] = cell
  return dict(passage_tokens=len(ids), lead_tokens=lead, prompt_format=prompt_format,
              prompt_tokens=[len(p) for p in prompts], heads=sorted(heads), schemes=rows)


def step_ms(model, rows, tokens: int, **options) -> float:
  """Milliseconds per token after the first: a run of `tokens` less one of 1, paired."""
  def run(n):
    return mdjax.generate(model, rows, max_new_tokens=n, eos_token_id=[], **options
                          ).stats["wall_s"]
  return 1e3 * (run(tokens) - run(1)) / (tokens - 1)


def timed(models: dict, rows, s: Settings, label: str, **options) -> dict:
  """ms per token of each scheme: one untimed run each (compiles), then `repeats`
  rounds over every scheme in a rotated order; the median, and its ratio to float32's."""
  calls = {name: functools.partial(step_ms, model, rows, s.step_tokens, **options)
           for name, model in models.items()}
  _, samples = interleaved(calls, s.repeats, label)
  medians = {name: statistics.median(values) for name, values in samples.items()}
  return {name: dict(ms_per_token=medians[name], ratio=medians[name] / medians["float32"],
                     samples_ms=samples[name]) for name in models}


def uptime() -> dict:
  """`uptime`'s line and the 1, 5 and 15 minute loads."""
  line = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
  return dict(uptime=line, load=list(os.getloadavg()))


def speed(models: dict, name: str, s: Settings) -> dict:
  """Greedy at each batch, then `mixed` at batch 1 (or why not), every scheme timed."""
  prompt = prompt_ids(models["float32"], 1)[0][0]
  out = dict(before=uptime(), rows=[], skipped=[])
  for batch in s.batches:
    cells = timed(models, [prompt] * batch, s, f"greedy b{batch} {name}")
    out["rows"] += [dict(strategy="greedy", batch=batch, scheme=k, **v) for k, v in cells.items()]
  if not s.mixed:
    out["skipped"].append("mixed: --nomixed")
  elif f"{name}-eagle" not in shipped_heads():
    out["skipped"].append(f"mixed: no shipped EAGLE head for {name} (shipped: "
                          f"{', '.join(shipped_heads())})")
  else:
    heads = mdjax.load_heads(f"{name}-eagle")
    cells = timed(models, [prompt], s, f"mixed b1 {name}", strategy="mixed", heads=heads,
                  **MIXED_OPTIONS)
    out["rows"] += [dict(strategy="mixed", batch=1, scheme=k, **v) for k, v in cells.items()]
  for reason in out["skipped"]:
    print(f"skipped {reason}")
  out["after"] = uptime()
  return out


def bench_model(name: str, text: str, s: Settings) -> dict:
  """Loads every scheme of `name` (float32 first: its shapes choose int4's group), then
  measures its quality and speed."""
  models = {"float32": load(name, "float32", s.group)}
  group, note = int4_group(models["float32"].config, s.group)
  skipped = []
  for scheme in tqdm.tqdm(s.schemes[1:], desc=f"loading {name}", leave=False):
    try:
      models[scheme] = load(name, scheme, group)
    except mdjax.MdjaxError as e:  # gguf of a model read from no GGUF file
      skipped.append(f"{scheme}: {e}")
      print(f"skipped {name} {scheme}: {e}")
  entry = dict(int4_group=group, int4_group_note=note, skipped_schemes=skipped,
               quality=quality(models, name, text, s))
  forget_programs()  # the quality's programs are not the speed's: their memory back
  entry["speed"] = speed(models, name, s)
  forget_programs()
  return entry


def forget_programs() -> None:
  """Drops every compiled program (mdjax's, the perplexity's, JAX's caches): a model's
  programs, a few hundred MB each for the mix, would otherwise pile up over the run."""
  mdjax.clear_compiled()
  nll_program.clear_cache()
  jax.clear_caches()
  gc.collect()
  if sys.platform == "linux":  # the freed heap back to the system (the compiler's mostly)
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def plot(results: dict, path) -> None:
  names = list(results["models"])
  fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.8 * len(names)), squeeze=False)
  for (left, right), name in zip(axes, names):
    entry = results["models"][name]
    schemes = list(entry["quality"]["schemes"])
    series = {}
    for row in entry["speed"]["rows"]:
      series.setdefault(f"{row['strategy']} b{row['batch']}", {})[row["scheme"]] = row["ratio"]
    bars(left, schemes, {k: [v.get(x, np.nan) for x in schemes] for k, v in series.items()},
         "ms per token / float32's")
    left.set_title(f"{name}: CPU step time", fontsize=9)
    ppl = [entry["quality"]["schemes"][x]["perplexity"] for x in schemes]
    right.bar(schemes, ppl)
    right.axhline(ppl[0], color="black", lw=0.8)
    right.set_ylim(min(ppl) * 0.9, max(ppl) * 1.05)
    right.set_ylabel("perplexity of the passage")
    right.set_title(f"{name}: perplexity ({entry['quality']['passage_tokens']} tokens)",
                    fontsize=9)
  save_figure(fig, path, f"quantized weights ({machine_line(results['machine'])})")


def table(results: dict) -> str:
  lines = []
  for name, entry in results["models"].items():
    q = entry["quality"]
    lines += [f"{name} (int4 groups of {entry['int4_group']}; {q['passage_tokens']} passage "
              f"tokens, {q['prompt_format']} prompts)", "",
              "| scheme | weight MB | vs float32 | perplexity | prefix frac., bf16 KV | mean "
              "prefix, bf16 KV | prefix frac., int8 KV | mean prefix, int8 KV | "
              + "".join(f"tokens/pass, {h} | " for h in q["heads"]),
              "|---" * (8 + len(q["heads"])) + "|"]
    for scheme, c in q["schemes"].items():
      a, k = c["agreement"]["bfloat16"], c["agreement"]["int8"]
      lines.append(f"| {scheme} | {c['weight_bytes'] / 1e6:.1f} | {c['weight_ratio']:.3f} | "
                   f"{c['perplexity']:.3f} | {a['prefix_fraction']:.3f} | {a['mean_prefix']:.1f} "
                   f"| {k['prefix_fraction']:.3f} | {k['mean_prefix']:.1f} | "
                   + "".join(f"{c['heads'][h]['tokens_per_pass']:.2f} | " for h in q["heads"]))
    lines += ["", "| strategy | batch | scheme | ms per token | vs float32 |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['strategy']} | {r['batch']} | {r['scheme']} | {r['ms_per_token']:.2f} | "
              f"{r['ratio']:.3f} |" for r in entry["speed"]["rows"]]
    lines.append("")
  return "\n".join(lines)


@one_line_errors
def main(argv):
  del argv
  s = settings()
  start = time.perf_counter()
  commit = "" if _QUICK.value else _CORPUS_COMMIT.value  # a shallow clone has no history
  text = passage(_CORPUS.value, commit)
  results = dict(command="python3 -m experiments.bench.quantized " + " ".join(sys.argv[1:]),
                 date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 settings=dataclasses.asdict(s), before=uptime(),
                 corpus=dict(path=_CORPUS.value, commit=commit,
                             characters=len(text), words=len(text.split()),
                             sha256=hashlib.sha256(text.encode()).hexdigest()),
                 models={})
  for name in s.models:  # written after each model: a run stopped later keeps it
    results["models"][name] = bench_model(name, text, s)
    results["after"] = uptime()
    results["machine"] = machine_info(memory_bandwidth(64))
    results["machine"]["load_average_after"] = os.getloadavg()[0]
    results["seconds"] = time.perf_counter() - start
    write_results(results, _OUT_DIR.value, "bench_quantized", plot, table)


if __name__ == "__main__":
  app.run(main)
