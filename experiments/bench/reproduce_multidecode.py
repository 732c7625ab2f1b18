"""MultiDecode's own experiment, reproduced on a real model: N questions over one context.

The MultiDecode reference timed N questions (branches) over one ~1000-token context
with 2 new tokens per answer (the prefill regime) and with 199 (the decode regime),
on Llama-3.2-1B and one A100, and reported the shared cache 98.4x faster than asking
the questions one after another at N = 100 and 2 new tokens, 7.3x at N = 32 and 199
new tokens, and 0.52x batching at N = 15 (context 500, 199 new tokens). Here, for
every N in `--ns` and every count in `--new_tokens`, the same float32 weights:

  shared      mdjax `multi_question`: the context prefilled once, the N questions as
              branches of one cache, decoded in one pass per token
  sequential  mdjax greedy on context + question, one question at a time (the
              context prefilled again for every question)
  batching    mdjax greedy on N rows of context + question: one `generate`, the
              context duplicated per row
  hf          transformers `generate` (greedy) on the same N rows, left-padded

The context is an original gazetteer of invented islands, grown sentence by sentence
until the chat-templated context reaches `--context_tokens`; the questions ask about
the islands in it (six facts per island, in a fixed shuffled order; past those, the
same facts asked again with "Briefly: " first). Each question's chat is rendered by
the model's own template (`mdjax.chat.chat_questions`), so context + question j is
exactly the chat of question j alone. A model without a tokenizer (`--quick`'s
random model) gets random ids instead.

Per point: seconds (medians of `--repeats` interleaved repetitions; mdjax's exclude
compiling, which is reported apart per mode), speedups of `shared` over each
baseline, KV-cache bytes, and whether the answers are token-identical: `sequential`
and `batching` must equal `shared` exactly; transformers' agreement is reported
(float argmax may flip at near-ties between the libraries), never required.

A baseline too slow for the machine is not run, and the JSON says so with the reason:
`--skip_above_s` skips `batching` and `hf` where their estimated time (linear in N
from the largest smaller N measured at the same new-token count) exceeds it, and
`--sequential_questions=K` times `sequential` on the first K questions only and scales
its time by N / K (recorded as estimated: every question alone runs the same compiled
program on the same context, so their times differ only by question length and noise).
A contender whose estimate exceeds `--warmup_below_s` is run once, not warmed up first:
mdjax's own timing leaves its compile out either way.

    python -m experiments.bench.reproduce_multidecode [--model=smollm2-135m-instruct] \\
        [--ns=1,2,4,8,16,32,100] [--new_tokens=2,199] [--context_tokens=1000] [--repeats=3] \\
        [--baselines=sequential,batching,hf] [--skip_above_s=0] [--sequential_questions=0] \
        [--quick]

Writes `reproduce_multidecode.json` (also after every point, so a stopped run keeps
what it measured) and `reproduce_multidecode.png` (speedup vs N, one line per
baseline, one panel per new-token count, the reference's points as stars) to
`--out_dir`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib
import statistics
import tempfile
import time

from absl import app, flags
import numpy as np
import tqdm
import transformers

import mdjax
from experiments.cli import one_line_errors
from experiments.bench.common import (PROBE_MIB, agreement, load_pair,
                                      machine_info, machine_line, memory_bandwidth, plt, random_ids,
                                      results_dir, save_figure, set_torch_threads, torch_oracle,
                                      write_json, write_results)
from mdjax.chat import chat_questions

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Anything `mdjax.load` takes.")
_NS = flags.DEFINE_list("ns", ["1", "2", "4", "8", "16", "32", "100"], "Numbers of questions.")
_NEW_TOKENS = flags.DEFINE_list("new_tokens", ["2", "199"],
                                "New tokens per answer (no early stop).")
_CONTEXT_TOKENS = flags.DEFINE_integer("context_tokens", 1000,
                                       "Shared context length to reach (tokens, chat template "
                                       "included; the passage grows by whole sentences).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions of every contender (median).")
_BASELINES = flags.DEFINE_list("baselines", ["sequential", "batching", "hf"],
                               "Baselines to time against the shared cache.")
_SKIP_ABOVE_S = flags.DEFINE_float(
    "skip_above_s", 0, "Skip batching / hf where their estimated seconds exceed this (0: never).")
_SEQUENTIAL_QUESTIONS = flags.DEFINE_integer(
    "sequential_questions", 0, "Time sequential on this many questions and scale to N (0: all N).")
_WARMUP_BELOW_S = flags.DEFINE_float(
    "warmup_below_s", 30, "Warm up (one untimed call) only contenders estimated faster than this.")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads (0: default; "
                                      "--quick: 1).")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("reproduce_multidecode"), "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: random tiny model, N 1 and 3, few tokens.")

BASELINES = ("sequential", "batching", "hf")
# What the MultiDecode reference reported (Llama-3.2-1B, one A100): the shared cache's
# speedup over a baseline at one point of its grid.
REFERENCE = (dict(baseline="sequential", n=100, new_tokens=2, context=1000, speedup=98.4),
             dict(baseline="sequential", n=32, new_tokens=199, context=1000, speedup=7.3),
             dict(baseline="batching", n=15, new_tokens=199, context=500, speedup=0.52))
RANDOM_QUESTION_TOKENS = 12  # question length without a tokenizer (random ids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  model: str
  ns: tuple[int, ...]
  new_tokens: tuple[int, ...]
  context_tokens: int
  repeats: int
  baselines: tuple[str, ...]
  skip_above_s: float
  sequential_questions: int
  warmup_below_s: float
  bandwidth_mib: int = PROBE_MIB  # the array of the bandwidth probe (`common.memory_bandwidth`)


QUICK = dict(model="random-llama-tiny", ns=(1, 3), new_tokens=(2, 5), context_tokens=40,
             repeats=1, baselines=BASELINES, skip_above_s=0, sequential_questions=2,
             bandwidth_mib=64)


# --------------------------------------------------------------------------- workload

ISLANDS = (  # (island, its village): invented names
    ("Varrow", "Skellig Bay"), ("Quillane", "Portmorra"), ("Tessory", "Ardle"),
    ("Hobbin", "Nethercove"), ("Marl", "Goslin"), ("Oskerry", "Tullagh"), ("Dunfeld", "Brae"),
    ("Pellow", "Corran"), ("Skarra", "Helvik"), ("Wendle", "Mossgate"), ("Corrin", "Kilbarra"),
    ("Ashgrave", "Lowtown"), ("Lutha", "Sandwick"), ("Brennock", "Gullhaven"),
    ("Fallow Rock", "Easter Quay"), ("Ivra", "Rannoch"), ("Gannet Holm", "Strand"),
    ("Rusk", "Ollaberry"), ("Salten", "Vaila"), ("Moyle", "Crosskirk"),
    ("Kettleness", "Baltasound"), ("Orm", "Fethar"), ("Tavish", "Cullivoe"),
    ("Yarrowby", "Hamnavoe"), ("Elsk", "Burravoe"), ("Cobble Isle", "Sumburgh Quay"),
    ("Harth", "Lerrick"), ("Nettlesea", "Skaw"), ("Brora Minor", "Toab"), ("Quay Holm", "Voe"))
EXPORTS = ("dried cod", "sheep's wool", "kelp ash", "roofing slate", "heather honey",
           "hemp rope", "apple cider", "cut peat", "smoked oysters", "bobbin lace", "sea salt",
           "goat cheese")
HILLS = ("the Beacon", "Watch Knowe", "Grey Fell", "the Old Man", "Cairn Crag", "Raven Law",
         "Windy Tor", "the Ward", "Hoolie Hill", "Stack Fell")
INTRO = ("The Selkie Archipelago lies off a cold northern coast. This short gazetteer, written "
         "for visitors who arrive by ferry, describes its islands one by one.")
SENTENCES = (
    "{island} was settled in {year}. About {people} people live there, most of them in the "
    "harbour village of {village}. Its main export is {export}, and the ferry from the "
    "mainland takes {minutes} minutes. The highest point is {hill}, {height} metres above "
    "the sea.",
    "The first houses on {island} were built in {year}. Today the island has about {people} "
    "inhabitants, and its only village is {village}. The islanders sell {export} on the "
    "mainland, a crossing of {minutes} minutes. Its highest hill, {hill}, is {height} "
    "metres high.",
    "Settlers reached {island} in {year}. Its {people} people live around the harbour at "
    "{village} and make their living from {export}. The ferry needs {minutes} minutes to "
    "reach it, and {hill}, its highest point, rises {height} metres.")
QUESTIONS = ("In which year was {island} settled?", "How many people live on {island}?",
             "What is the main export of {island}?",
             "How long is the ferry crossing to {island}?",
             "What is the highest point of {island}?",
             "What is the name of the village on {island}?")
RESTATED = ("", "Briefly: ")  # the second round asks the same facts again, reworded
SEPARATOR = "\n\nQuestion: "


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """The shared context and every question's own tokens (question j's prompt alone is
  `context + questions[j]`), with the texts when the model has a tokenizer."""

  context: list[int]
  questions: list[list[int]]
  question_texts: list[str] | None
  passage: str | None


def passage(islands: int) -> str:
  """The gazetteer's intro and one sentence group per island, facts from a fixed seed."""
  rng = np.random.default_rng(1887)
  parts = [INTRO]
  for i, (island, village) in enumerate(ISLANDS[:islands]):
    parts.append(SENTENCES[i % len(SENTENCES)].format(
        island=island, village=village, year=int(rng.integers(1100, 1900)),
        people=int(rng.integers(4, 400)) * 10, export=EXPORTS[int(rng.integers(len(EXPORTS)))],
        minutes=int(rng.integers(3, 37)) * 5, hill=HILLS[int(rng.integers(len(HILLS)))],
        height=int(rng.integers(30, 420))))
  return "\n".join(parts)


def question_texts(islands: int, n: int) -> list[str]:
  """n questions about the first `islands` islands, in a fixed shuffled order."""
  facts = [q.format(island=island) for island, _ in ISLANDS[:islands] for q in QUESTIONS]
  np.random.default_rng(0).shuffle(facts)
  asked = [style + q for style in RESTATED for q in facts]
  if n > len(asked):
    raise app.UsageError(f"{n} questions asked; {islands} islands give at most {len(asked)} "
                         f"(raise --context_tokens)")
  return asked[:n]


def workload(model: mdjax.Model, context_tokens: int, n: int) -> Workload:
  """The context (the passage's fewest islands that reach `context_tokens` once rendered
  by the chat template) and n questions about its islands."""
  if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
    rng = np.random.default_rng(context_tokens)
    vocab = model.config.vocab_size
    return Workload(context=random_ids(rng, vocab, context_tokens).tolist(),
                    questions=[random_ids(rng, vocab, RANDOM_QUESTION_TOKENS).tolist()
                               for _ in range(n)], question_texts=None, passage=None)
  for islands in range(1, len(ISLANDS) + 1):
    # Two questions suffice to find the shared context's length: the rest share it.
    context, _ = chat_questions(model, passage(islands), question_texts(islands, 2),
                                separator=SEPARATOR)
    if len(context) >= context_tokens:
      break
  texts = question_texts(islands, n)
  context, questions = chat_questions(model, passage(islands), texts, separator=SEPARATOR)
  return Workload(context=context, questions=questions, question_texts=texts,
                  passage=passage(islands))


# --------------------------------------------------------------------------- contenders


def mdjax_run(model, prompts, new_tokens: int, strategy: str = "greedy", **options) -> dict:
  """One `mdjax.generate`: seconds without compiling, compile seconds, answers."""
  out = mdjax.generate(model, prompts, strategy=strategy, max_new_tokens=new_tokens,
                       eos_token_id=[], **options)
  return dict(seconds=out.stats["wall_s"], compile_s=out.stats["compile_s"],
              sequences=out.sequences, kv_bytes=out.stats["kv_cache_bytes"])


def sequential_run(model, work: Workload, questions: int, new_tokens: int) -> dict:
  """The first `questions` questions, each alone on context + question."""
  runs = [mdjax_run(model, [work.context + q], new_tokens) for q in work.questions[:questions]]
  return dict(seconds=sum(r["seconds"] for r in runs), compile_s=sum(r["compile_s"] for r in runs),
              sequences=[r["sequences"][0] for r in runs])


def hf_run(reference, rows: list[list[int]], new_tokens: int) -> dict:
  """transformers greedy on the rows, left-padded to one length."""
  torch = torch_oracle()
  width = max(map(len, rows))
  ids = torch.zeros((len(rows), width), dtype=torch.int64)  # pad id 0: masked out
  mask = torch.zeros_like(ids)
  for i, row in enumerate(rows):
    ids[i, width - len(row):] = torch.tensor(row)
    mask[i, width - len(row):] = 1
  start = time.perf_counter()
  out = reference.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=0)
  return dict(seconds=time.perf_counter() - start, sequences=out[:, width:].numpy())


class Estimates:
  """Seconds per contender, linear in N from the largest smaller N measured at the same
  new-token count (per question for sequential: it runs N identical programs)."""

  def __init__(self):
    self._last: dict[tuple[str, int], tuple[int, float]] = {}

  def record(self, name: str, new_tokens: int, n: int, seconds: float) -> None:
    self._last[name, new_tokens] = (n, seconds)

  def __call__(self, name: str, new_tokens: int, n: int) -> float | None:
    if (name, new_tokens) not in self._last:
      return None
    measured_n, seconds = self._last[name, new_tokens]
    return seconds * n / measured_n


def bench_point(model, reference, work: Workload, n: int, new_tokens: int, settings: Settings,
                estimates: Estimates) -> dict:
  """Every number of one (N, new tokens) point."""
  questions = work.questions[:n]
  rows = [work.context + q for q in questions]
  timed_questions = min(n, settings.sequential_questions or n)
  contenders = {
      "shared": lambda: mdjax_run(model, [work.context], new_tokens, "multi_question",
                                  questions=questions),
      "sequential": lambda: sequential_run(model, work, timed_questions, new_tokens),
      "batching": lambda: mdjax_run(model, rows, new_tokens),
      "hf": lambda: hf_run(reference, rows, new_tokens)}
  contenders = {k: v for k, v in contenders.items() if k == "shared" or k in settings.baselines}
  warmups = {"sequential": lambda: sequential_run(model, work, 1, new_tokens)}  # compiles it
  expected = {name: estimates(name, new_tokens, n) for name in contenders}
  expected["sequential"] = estimates("sequential", new_tokens, timed_questions)
  skipped = {}
  for name in {"batching", "hf"} & set(contenders):
    if settings.skip_above_s and (expected[name] or 0) > settings.skip_above_s:
      skipped[name] = (f"estimated {expected[name]:.0f} s > --skip_above_s="
                       f"{settings.skip_above_s:g}")
      del contenders[name]

  results, warmed, compile_s = {}, [], {}
  for name, run in contenders.items():
    if expected[name] is None or expected[name] <= settings.warmup_below_s:
      first = warmups.get(name, run)()
      warmed.append(name)
      if "compile_s" in first:
        compile_s[name] = first["compile_s"]
  times = {name: [] for name in contenders}
  names = list(contenders)
  for rep in range(settings.repeats):
    for name in names[rep % len(names):] + names[:rep % len(names)]:
      results[name] = contenders[name]()
      times[name].append(results[name]["seconds"])
      if "compile_s" in results[name]:
        compile_s.setdefault(name, results[name]["compile_s"])
  measured = {name: statistics.median(t) for name, t in times.items()}
  for name, seconds in measured.items():
    estimates.record(name, new_tokens, timed_questions if name == "sequential" else n, seconds)
  wall = dict(measured)
  if "sequential" in wall:
    wall["sequential"] *= n / timed_questions

  shared = results["shared"]["sequences"]
  point = dict(
      n=n, new_tokens=new_tokens, context_tokens=len(work.context),
      question_tokens=statistics.mean(map(len, questions)),
      wall_s=wall, speedup={k: wall[k] / wall["shared"] for k in BASELINES if k in wall},
      tokens_per_s={k: n * new_tokens / v for k, v in wall.items()},
      compile_s=compile_s, warmed_up=warmed, skipped=skipped,
      estimated={"sequential": f"{timed_questions} of {n} questions timed, scaled by "
                               f"{n / timed_questions:g}"}
      if "sequential" in wall and timed_questions < n else {},
      kv_bytes=dict(shared=results["shared"]["kv_bytes"],
                    **({"batching": results["batching"]["kv_bytes"]} if "batching" in results
                       else {})),
      same_tokens={name: results[name]["sequences"] == shared[:len(results[name]["sequences"])]
                   for name in ("sequential", "batching") if name in results})
  if "hf" in results:
    theirs = results["hf"]["sequences"]
    point["hf_agreement"] = dict(agreement(shared, theirs),
                                 identical_answers=sum(r == s for r, s in
                                                       zip(theirs.tolist(), shared)))
  if model.tokenizer is not None:  # a look at what was answered
    point["answers"] = [dict(question=q, shared=model.tokenizer.decode(s))
                        for q, s in zip(work.question_texts, shared[:3])]
  return point


# --------------------------------------------------------------------------- the run


def run(settings: Settings, partial: pathlib.Path | None = None) -> dict:
  """Every point, new-token counts outer and N ascending inner (so each estimate comes
  from the point before); after each point the results so far go to `partial`."""
  with tempfile.TemporaryDirectory() as scratch:
    model, reference = load_pair(settings.model, 0, pathlib.Path(scratch))
  work = workload(model, settings.context_tokens, max(settings.ns))
  bandwidth = memory_bandwidth(settings.bandwidth_mib)
  results = dict(machine=machine_info(bandwidth), settings=dataclasses.asdict(settings),
                 model=model.description, transformers_class=type(reference).__name__,
                 reference=dict(points=list(REFERENCE), setup="Llama-3.2-1B, one A100"),
                 context=dict(tokens=len(work.context), passage=work.passage),
                 questions=work.question_texts, points=[])
  estimates = Estimates()
  start = time.perf_counter()
  grid = list(itertools.product(settings.new_tokens, sorted(settings.ns)))
  for new_tokens, n in tqdm.tqdm(grid, desc="grid"):
    results["points"].append(bench_point(model, reference, work, n, new_tokens, settings,
                                         estimates))
    results["run_s"] = time.perf_counter() - start
    if partial is not None:
      write_json(partial, results)
  results["goals"] = goals(results["points"])
  return results


def goals(points: list[dict]) -> dict:
  """The issue's goals where this run measured them: at least the reference's speedup
  over sequential at its points, and at least 1.0x batching everywhere."""
  by_point = {(p["n"], p["new_tokens"]): p for p in points}
  versus_reference = []
  for ref in REFERENCE:
    ours = by_point.get((ref["n"], ref["new_tokens"]), {}).get("speedup", {}).get(ref["baseline"])
    versus_reference.append(dict(ref, ours=ours, met=None if ours is None else
                                 ours >= max(ref["speedup"], 1.0)))
  batching = [p["speedup"]["batching"] for p in points if "batching" in p["speedup"]]
  return dict(versus_reference=versus_reference,
              min_speedup_vs_batching=min(batching) if batching else None,
              batching_met=bool(batching) and min(batching) >= 1.0)


def table(results: dict) -> str:
  lines = ["    N  new  ctx  shared s  sequential s  batching s      hf s  vs seq  vs batch"
           "   vs hf  same seq/batch  hf tokens  compile s shared"]

  def cell(p, name, fmt):
    if name not in p["wall_s"]:
      return "skip" if name in p["skipped"] else "-"
    return fmt.format(p["wall_s"][name]) + ("*" if name in p["estimated"] else "")

  def ratio(p, name):
    return f"{p['speedup'][name]:.2f}x" if name in p["speedup"] else "-"

  for p in results["points"]:
    same = "/".join(str(p["same_tokens"].get(k, "-")) for k in ("sequential", "batching"))
    hf = p.get("hf_agreement")
    hf = f"{hf['matching_tokens']}/{hf['total_tokens']}" if hf else "-"
    lines.append(f"{p['n']:>5} {p['new_tokens']:>4} {p['context_tokens']:>4}"
                 f"  {p['wall_s']['shared']:8.2f}  {cell(p, 'sequential', '{:.2f}'):>12}"
                 f"  {cell(p, 'batching', '{:.2f}'):>10}  {cell(p, 'hf', '{:.2f}'):>8}"
                 f"  {ratio(p, 'sequential'):>6}  {ratio(p, 'batching'):>8}  {ratio(p, 'hf'):>6}"
                 f"  {same:>14}  {hf:>9}  {p['compile_s']['shared']:.1f}")
  lines.append("* estimated: sequential timed on fewer questions and scaled to N")
  for g in results["goals"]["versus_reference"]:
    ours = "not measured" if g["ours"] is None else f"{g['ours']:.2f}x"
    lines.append(f"reference {g['speedup']}x vs {g['baseline']} at N={g['n']}, "
                 f"{g['new_tokens']} new: ours {ours}")
  lines.append(f"lowest speedup vs batching: {results['goals']['min_speedup_vs_batching']}")
  return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
  """One panel per new-token count: the shared cache's speedup over each baseline vs N
  (hollow markers: estimated), the reference's reported points as stars."""
  counts = results["settings"]["new_tokens"]
  fig, axes = plt.subplots(1, len(counts), figsize=(max(9, 6 * len(counts)), 5.5), squeeze=False)
  colors = {"sequential": "tab:green", "batching": "tab:blue", "hf": "tab:orange"}
  labels = {"sequential": "vs sequential (mdjax)", "batching": "vs batching (mdjax)",
            "hf": "vs transformers batching"}
  for ax, new_tokens in zip(axes[0], counts):
    points = [p for p in results["points"] if p["new_tokens"] == new_tokens]
    for name, color in colors.items():
      shown = [p for p in points if name in p["speedup"]]
      ax.plot([p["n"] for p in shown], [p["speedup"][name] for p in shown], "-", color=color,
              label=labels[name])
      for p in shown:
        ax.plot(p["n"], p["speedup"][name], "o", color=color,
                mfc="white" if name in p["estimated"] else color)
    for ref in results["reference"]["points"]:
      if ref["new_tokens"] == new_tokens:
        ax.plot(ref["n"], ref["speedup"], "*", ms=13, color=colors[ref["baseline"]], mec="black")
        ax.annotate(f"reference {ref['speedup']}x vs {ref['baseline']}"
                    + (f" (ctx {ref['context']})" if ref["context"] != 1000 else ""),
                    (ref["n"], ref["speedup"]), fontsize=7, xytext=(-8, 6), ha="right",
                    textcoords="offset points")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("N questions (branches)")
    ax.set_ylabel("speedup of the shared cache (x)")
    context = points[0]["context_tokens"] if points else "-"
    ax.set_title(f"{new_tokens} new tokens, context {context}", fontsize=10)
    ax.legend(fontsize=7)
  save_figure(fig, path, f"MultiDecode reproduced: multi_question vs the alternatives\n"
                         f"{results['model']}, {machine_line(results['machine'])}\nhollow: "
                         f"sequential timed on fewer questions and scaled; stars: the reference "
                         f"({results['reference']['setup']})")


def main(argv):
  del argv
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  settings = Settings(model=_MODEL.value, ns=tuple(int(n) for n in _NS.value),
                      new_tokens=tuple(int(t) for t in _NEW_TOKENS.value),
                      context_tokens=_CONTEXT_TOKENS.value, repeats=_REPEATS.value,
                      baselines=tuple(dict.fromkeys(_BASELINES.value)),
                      skip_above_s=_SKIP_ABOVE_S.value,
                      sequential_questions=_SEQUENTIAL_QUESTIONS.value,
                      warmup_below_s=_WARMUP_BELOW_S.value)
  if _QUICK.value:
    settings = dataclasses.replace(settings, **QUICK)
  if min(settings.ns) < 1 or min(settings.new_tokens) < 1 or settings.repeats < 1:
    raise app.UsageError("--ns, --new_tokens and --repeats must be >= 1")
  if not set(settings.baselines) <= set(BASELINES):
    raise app.UsageError(f"--baselines: choose among {', '.join(BASELINES)}")
  set_torch_threads(_TORCH_THREADS.value, _QUICK.value)  # before any work
  out_dir = pathlib.Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  results = run(settings, partial=out_dir / "reproduce_multidecode.json")
  results["machine"]["load_average_after"] = os.getloadavg()[0]
  write_results(results, out_dir, "reproduce_multidecode", plot, table)


if __name__ == "__main__":
  app.run(one_line_errors(main))
