"""Spec-Bench's per-kind report (Xia et al. 2024): each speculative method's mean tokens per
target pass and speedup over plain decoding, per task kind, at every batch size and
temperature.

    python3 -m experiments.bench.spec_bench           # smollm2-135m-instruct (bfloat16), its heads
    python3 -m experiments.bench.spec_bench --prompts_per_kind=1 --max_new_tokens=64 \\
        --batches=1 --temperatures=0 --kinds=writing,coding
    python3 -m experiments.bench.spec_bench --methods=prompt_lookup \\
        --methods='mix=mixed:heads=eagle3,sources=prompt_lookup+heads'
    python3 -m experiments.bench.spec_bench --quick   # smoke test: a random model, random heads

The prompts are held out from every head's training (`common.QUESTIONS`: two questions of each
of 13 task kinds, or `--questions`), each one user turn of the model's chat template. Every
row generates `--max_new_tokens` tokens with no early stop.

**Methods** are strategy specs, one per `--methods` flag::

    [LABEL=]STRATEGY[:OPTION=VALUE,OPTION=VALUE,...]

any registered strategy with any of its options (`mdjax.generate`'s). A value is read as an
integer, a number, true/false, a list (items joined by '+') or else text; `heads=` names
heads (a family, `medusa`, `eagle` or `eagle3`, for the model's shipped heads of that
family, or anything `mdjax.load_heads` takes) and `draft=` a draft model (anything
`mdjax.load` takes, in the model's dtype). `prompt_lookup` takes `common.LOOKUP`'s options
unless given. The default: prompt lookup, the shipped Medusa heads and the shipped EAGLE-3
heads, both with `tree_budget="auto"` (the tree it picks per request, or plain decoding,
is recorded per kind).

**Timing**: at every (batch, temperature, kind) the baseline (`greedy` at temperature 0,
`sample` at the temperature otherwise) runs interleaved with every method on the same
prompts: each once untimed (compile), then `--repeats` timed rounds in turn, by median
(`common.timed`); a speedup is the baseline's seconds over the method's in the same
slice, so load on the machine slows both. At batch 1 each of a kind's prompts runs alone;
at batch B its prompts fill the B rows of one group (round again where there are fewer:
one kind per batch, as Spec-Bench's categories). Tokens per pass: a row's tokens over the
target passes, the prefill counted as one (`common.tokens_per_pass`; the baseline's is 1).
Overall: the slices summed (seconds, passes, tokens).

**Lossless check**: at temperature 0 every method's tokens are compared with greedy's
(`identical_to_greedy`, matching tokens); where a row parts, the gap between greedy's top-2
logits there (`common.divergence_gaps`: in bfloat16 a near-tie may round apart between
batch shapes). At temperature > 0 the methods sample the target's law with their own
random draws, so their tokens are not compared; a method that decodes greedily only
(`prompt_lookup`) is left out there, and the JSON says so (`left_out`).

Writes `spec_bench.json`, `spec_bench.png` (per kind: speedup and tokens per pass, one row
of plots per batch and temperature) and `README.md` (Spec-Bench's table: a row per method, a
column per kind, "speedup (tokens per pass)"; the command that made it) into `--out_dir`.
The JSON is rewritten after every kind, so a stopped run keeps what it measured;
`--redraw` draws the plot and writes the README from it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shlex
import sys

from absl import app, flags
import numpy as np
import tqdm

import mdjax
from experiments.cli import one_line_errors
from experiments.bench.common import (LOOKUP, PROBE_MIB, QUESTIONS, Prompt,
                                      agreement, bars, divergence_gaps, groups_of, machine_info,
                                      machine_line, memory_bandwidth, mismatch_line, plt,
                                      random_heads, random_ids, read_questions, results_dir,
                                      run_mdjax, save_figure, selected, timed, tokens_per_pass,
                                      write_json, write_results)
from mdjax import chat, files, strategies
from mdjax.errors import MdjaxError, check_count, check_real
from mdjax.heads import FAMILIES

DEFAULT_METHODS = ("prompt_lookup", "medusa=medusa:heads=medusa", "eagle3=eagle:heads=eagle3")

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Model (name, directory, .gguf).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"],
                           "Weights of the model, its heads and draft models.")
_METHODS = flags.DEFINE_multi_string(
    "methods", list(DEFAULT_METHODS),
    "A method: [LABEL=]STRATEGY[:OPTION=VALUE,...] (repeat the flag for more; see the module "
    "docstring).")
_QUESTIONS = flags.DEFINE_string("questions", str(QUESTIONS),
                                 'JSON lines {"category": ..., "prompt": ...}.')
_KINDS = flags.DEFINE_list("kinds", [], "Task kinds to run (names; empty: all).")
_PROMPTS_PER_KIND = flags.DEFINE_integer("prompts_per_kind", 0, "Prompts of each kind (0: all).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 128, "Generated tokens per row.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0", "0.7"], "Temperatures (0: greedy).")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Timed repetitions of every contender (median).")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("spec_bench"),
                               "Where the JSON, PNG and README go.")
_REDRAW = flags.DEFINE_bool("redraw", False,
                            "Run nothing: draw the plot and write the README (and the table) "
                            "from --out_dir's JSON, e.g. a stopped run's.")
_QUICK = flags.DEFINE_bool("quick", False,
                           "Smoke test: random-llama-tiny, random heads, 1 random prompt of each "
                           "of 2 kinds, 8 tokens, batches 1 and 2.")

STEM = "spec_bench"
OVERALL = "overall"
QUICK_PROMPT_LEN = 24


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  kinds: tuple[str, ...]  # empty: all
  prompts_per_kind: int
  max_new_tokens: int
  batches: tuple[int, ...]
  temperatures: tuple[float, ...]
  repeats: int


QUICK = dict(kinds=(), prompts_per_kind=1, max_new_tokens=8, batches=(1, 2), repeats=1)
QUICK_KINDS = 2


@dataclasses.dataclass(frozen=True)
class Method:
  """A contender: its `label`, the `strategy` it runs and the options as given (text:
  heads and draft models are loaded by `Method.options`)."""

  label: str
  strategy: str
  given: tuple[tuple[str, object], ...]

  @classmethod
  def parse(cls, spec: str) -> "Method":
    """From "[LABEL=]STRATEGY[:OPTION=VALUE,...]"; an unknown strategy or option, or a
    malformed spec, is an `MdjaxError` naming it."""
    head, _, rest = spec.partition(":")
    label, _, strategy = head.rpartition("=")
    strategy, label = strategy.strip(), label.strip() or strategy.strip()
    given = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
      name, equals, value = item.partition("=")
      if not equals or not name.strip():
        raise MdjaxError(f"method {spec!r}: options are OPTION=VALUE, got {item!r}")
      given.append((name.strip(), parse_value(value.strip())))
    strategies.get(strategy)  # names the valid strategies when it is not one
    strategies.check_options(strategy, dict(given))
    if label in ("greedy", "sample"):
      raise MdjaxError(f"method {spec!r}: {label!r} is the baseline's label; give another")
    if "temperature" in dict(given):
      raise MdjaxError(f"method {spec!r}: the temperature is the run's (--temperatures), not a "
                       "method's")
    return cls(label=label, strategy=strategy, given=tuple(given))

  def options(self, model: mdjax.Model, quick: bool) -> dict:
    """The options `generate` takes: `heads=` and `draft=` loaded for `model` (random
    heads of the family named, with `quick`), `common.LOOKUP` under prompt lookup's."""
    options = dict(LOOKUP) if self.strategy == "prompt_lookup" else {}
    for name, value in self.given:
      if name == "heads":
        value = load_heads(str(value), model, quick)
      elif name == "draft":
        value = mdjax.load(str(value), dtype=str(model.params["embed"].dtype))
      options[name] = value
    return options


def parse_value(text: str):
  """An option's value: int, float, bool, a '+'-joined list of them, else the text."""
  if "+" in text:
    return [parse_value(item) for item in text.split("+")]
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def load_heads(name: str, model: mdjax.Model, quick: bool) -> mdjax.Heads:
  """Heads for `model`: a family names the model's shipped heads of it (`<model>-<family>`;
  random heads shaped like them with `quick`), anything else goes to `mdjax.load_heads`."""
  if name in FAMILIES:
    if quick:
      return random_heads(model, name)
    name = f"{model.name}-{name}"
  heads = mdjax.load_heads(name, dtype=model.params["embed"].dtype)
  heads.check_model(model.config)
  return heads


def baseline(temperature: float) -> tuple[str, dict]:
  """Plain decoding at `temperature`: (strategy, options)."""
  return ("greedy", {}) if temperature == 0 else ("sample", dict(temperature=temperature))


def by_kind(prompts: list[Prompt]) -> dict[str, list[list[int]]]:
  kinds: dict[str, list[list[int]]] = {}
  for prompt in prompts:
    kinds.setdefault(prompt.kind, []).append(prompt.ids)
  return kinds


def bench_slice(model, methods: dict[str, tuple[str, dict]], groups, settings: Settings,
                temperature: float, label: str) -> dict:
  """The baseline and every method on `groups`, interleaved; per contender its raw
  numbers (`seconds`, `target_passes`, `steps`, `groups`), tokens per pass, speedup over
  the baseline, `auto`'s choices and, at temperature 0, its agreement with greedy."""
  base, base_options = baseline(temperature)
  run = functools.partial(run_mdjax, model, groups, settings.max_new_tokens, first_token=False)
  contenders = {base: functools.partial(run, base, **base_options)}
  for name, (strategy, options) in methods.items():
    sampled = dict(temperature=temperature) if temperature else {}
    contenders[name] = functools.partial(run, strategy, **sampled, **options)
  results = timed(contenders, settings.repeats, label)
  steps, reference = settings.max_new_tokens * len(groups), results[base]
  cells = {}
  for name, result in results.items():
    cell = dict(seconds=result["seconds"], target_passes=result["stats"]["target_passes"],
                steps=steps, groups=len(groups),
                tokens_per_pass=tokens_per_pass(result, steps, len(groups)),
                speedup=reference["seconds"] / result["seconds"],
                ms_per_token=result["seconds"] / steps * 1e3,
                stats={k: v for k, v in result["stats"].items() if k != "target_passes"})
    if result["choices"]:
      cell["choices"] = result["choices"]
    if temperature == 0 and name != base:
      tokens = agreement(result["sequences"], np.asarray(reference["sequences"]))
      cell.update(tokens=tokens,
                  identical_to_greedy=tokens["matching_tokens"] == tokens["total_tokens"])
      if not cell["identical_to_greedy"]:
        cell["divergence_gaps"] = divergence_gaps(model, [r for g in groups for r in g],
                                                  reference["sequences"], result["sequences"])
    cells[name] = cell
  return cells


def overall(kinds: dict[str, dict]) -> dict:
  """Every contender over all kinds: seconds, passes and tokens summed."""
  names = next(iter(kinds.values()))
  base = next(iter(names))
  total = lambda name, key: sum(cells[name][key] for cells in kinds.values())
  cells = {}
  for name in names:
    cell = dict(seconds=total(name, "seconds"), target_passes=total(name, "target_passes"),
                steps=total(name, "steps"), groups=total(name, "groups"))
    cell.update(tokens_per_pass=cell["steps"] / (cell["target_passes"] + cell["groups"]),
                speedup=total(base, "seconds") / cell["seconds"],
                ms_per_token=cell["seconds"] / cell["steps"] * 1e3)
    if "tokens" in kinds[next(iter(kinds))][name]:
      matching, count = (sum(c[name]["tokens"][k] for c in kinds.values())
                         for k in ("matching_tokens", "total_tokens"))
      cell["tokens"] = dict(matching_tokens=matching, total_tokens=count)
      cell["identical_to_greedy"] = matching == count
    cells[name] = cell
  return cells


def run(model: mdjax.Model, methods: dict[str, tuple[str, dict]], prompts: list[Prompt],
        settings: Settings, header: dict, out_dir: str | None = None) -> dict:
  """Every (batch, temperature) of `settings`: per kind and overall (`bench_slice`,
  `overall`); the results so far written to `out_dir` after every kind, when given."""
  results = dict(header, settings=dataclasses.asdict(settings), model=model.description,
                 methods={name: strategy for name, (strategy, _) in methods.items()},
                 kinds={kind: len(ids) for kind, ids in by_kind(prompts).items()}, runs={})
  kinds = by_kind(prompts)
  for batch in settings.batches:
    for temperature in settings.temperatures:
      key = run_key(batch, temperature)
      sampling = {name: method for name, method in methods.items()
                  if not temperature or "temperature" in strategies.option_names(method[0])}
      left_out = {name: f"{methods[name][0]} decodes greedily only"
                  for name in methods if name not in sampling}
      cells = {}
      for kind, ids in tqdm.tqdm(kinds.items(), desc=key, unit="kind"):
        cells[kind] = bench_slice(model, sampling, groups_of(ids, batch), settings, temperature,
                                  f"{key}, {kind}")
        results["runs"][key] = dict(batch=batch, temperature=temperature, kinds=cells,
                                    overall=overall(cells), left_out=left_out)
        if out_dir is not None:
          pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
          write_json(pathlib.Path(out_dir) / f"{STEM}.json", results)
  results["mismatches"] = mismatches(results["runs"])
  return results


def run_key(batch: int, temperature: float) -> str:
  return f"batch {batch}, T={temperature:g}"


def mismatches(runs: dict) -> list[str]:
  """"<run>, <kind>, <method>: m/n tokens ..." for every temperature-0 cell whose tokens
  are not greedy's."""
  found = []
  for key, entry in runs.items():
    for kind, cells in entry["kinds"].items():
      for name, cell in cells.items():
        if cell.get("identical_to_greedy") is False:
          found.append(mismatch_line(f"{key}, {kind}, {name}", cell))
  return found


def spec_table(entry: dict) -> list[str]:
  """Spec-Bench's table of one run as markdown: a row per method, a column per kind and
  overall; a cell is "speedup (tokens per pass)", marked * where the tokens part from greedy's."""
  kinds = list(entry["kinds"])
  methods = list(entry["overall"])[1:]
  lines = ["| method | " + " | ".join(kinds + [OVERALL]) + " |",
           "|---" * (len(kinds) + 2) + "|"]
  for name in methods:
    cells = [entry["kinds"][kind][name] for kind in kinds] + [entry["overall"][name]]
    text = [f"{c['speedup']:.2f}x ({c['tokens_per_pass']:.2f})"
            + ("*" if c.get("identical_to_greedy") is False else "") for c in cells]
    lines.append(f"| {name} | " + " | ".join(text) + " |")
  return lines


def choices_line(entry: dict) -> str | None:
  """What `auto` chose, per method, over the kinds: "medusa: tree 2 (11), plain (2)"."""
  said = []
  for name in list(entry["overall"])[1:]:
    counts: dict[str, int] = {}
    for cells in entry["kinds"].values():
      for choice in cells[name].get("choices", []):
        what = ("plain decoding" if choice.get("tree_choice") in ("greedy", "sample")
                else f"{choice.get('tree_budget')} nodes, depth {choice.get('tree_depth')}")
        counts[what] = counts.get(what, 0) + 1
    if counts:
      said.append(f"{name}: " + ", ".join(f"{what} ({n})" for what, n in counts.items()))
  return "; ".join(said) or None


def table(results: dict) -> str:
  lines = []
  for key, entry in results["runs"].items():
    lines += [f"{key}: speedup over {next(iter(entry['overall']))} (tokens per pass)"]
    lines += spec_table(entry)
    lines += [f"{name} left out: {why}" for name, why in entry["left_out"].items()]
    choices = choices_line(entry)
    if choices:
      lines.append(f"auto chose: {choices}")
    lines.append("")
  if results["mismatches"]:
    lines += ["tokens parting from greedy's (temperature 0):"]
    lines += [f"  {m}" for m in results["mismatches"]]
  return "\n".join(lines)


def readme(results: dict) -> str:
  """The README beside the results: how they were made, then every run's table."""
  lines = [f"# Spec-Bench per kind: {results['model']}", "",
           f"Written by `{results['command']}` ({machine_line(results['machine'])}; "
           f"{results['settings']['max_new_tokens']} tokens per row, prompts per kind: "
           f"{', '.join(f'{k} {n}' for k, n in results['kinds'].items())}). "
           "A cell is the speedup over plain decoding at the same batch and temperature "
           "(greedy at T=0, sampling at T>0), timed interleaved on the same prompts, and the "
           "mean tokens per target pass (prefill counted); * where the tokens part from "
           "greedy's at T=0 (`mismatches` in the JSON: with the gap between greedy's top-2 "
           "logits where each row parted). "
           "[JSON](spec_bench.json), [plot](spec_bench.png).", ""]
  missing = [key for key in (run_key(b, t) for b in results["settings"]["batches"]
                              for t in results["settings"]["temperatures"])
             if len(results["runs"].get(key, {}).get("kinds", ())) < len(results["kinds"])]
  if missing:
    lines += [f"The run was stopped before it finished {'; '.join(missing)} (what it measured "
              "there is below, if anything).", ""]
  for key, entry in results["runs"].items():
    lines += [f"## {key}", ""] + spec_table(entry)
    if entry["left_out"]:
      lines += ["", "Left out: " + "; ".join(f"{name} ({why})"
                                             for name, why in entry["left_out"].items()) + "."]
    choices = choices_line(entry)
    if choices:
      lines += ["", f"`auto` chose, per kind: {choices}."]
    lines.append("")
  return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
  """One row per (batch, temperature): speedup and tokens per pass per kind, per method
  (each method its colour in every row; one left out of a row has no bars there)."""
  runs = results["runs"]
  fig, axes = plt.subplots(len(runs), 2, figsize=(16, 4.5 * len(runs)), squeeze=False)
  for (title, entry), (speed, passes) in zip(runs.items(), axes):
    columns = list(entry["kinds"]) + [OVERALL]

    def value(kind, name, key):
      cells = entry["overall"] if kind == OVERALL else entry["kinds"][kind]
      return cells[name][key] if name in cells else float("nan")
    for ax, key, label in ((speed, "speedup", "speedup vs plain decoding"),
                           (passes, "tokens_per_pass", "tokens per target pass")):
      bars(ax, columns, {name: [value(kind, name, key) for kind in columns]
                         for name in results["methods"]}, label)
      ax.set_title(title, fontsize=10)
  save_figure(fig, path, f"{results['model']}\n{machine_line(results['machine'])}")


def setup(settings: Settings, quick: bool) -> tuple[mdjax.Model, list[Prompt]]:
  """The model and the prompts (random ids labelled by kind with `quick`)."""
  questions = selected(read_questions(_QUESTIONS.value), QUICK_KINDS if quick else 0,
                       settings.prompts_per_kind)
  if settings.kinds:
    known = dict.fromkeys(kind for kind, _ in questions)
    unknown = [kind for kind in settings.kinds if kind not in known]
    if unknown:
      raise MdjaxError(f"unknown task kind(s) {', '.join(map(repr, unknown))}; the questions "
                       f"hold {', '.join(known)}")
    questions = [(kind, text) for kind, text in questions if kind in settings.kinds]
  if quick:  # random-llama-tiny has no tokenizer: random prompts, labelled by kind
    model = mdjax.load("random-llama-tiny")
    rng = np.random.default_rng(0)
    return model, [Prompt(kind, random_ids(rng, model.config.vocab_size, QUICK_PROMPT_LEN).tolist())
                   for kind, _ in questions]
  model = mdjax.load(_MODEL.value, dtype=_DTYPE.value)
  return model, [Prompt(kind, chat.chat_ids(model, text)) for kind, text in questions]


def write_report(results: dict, out_dir: str) -> None:
  """The JSON (with its `mismatches`), the plot, the table printed, and the README."""
  results["mismatches"] = mismatches(results["runs"])
  write_results(results, out_dir, STEM, plot, table)
  files.write_text(pathlib.Path(out_dir) / "README.md", readme(results))


def main(argv):
  del argv
  if _REDRAW.value:
    path = pathlib.Path(_OUT_DIR.value) / f"{STEM}.json"
    if not path.is_file():
      raise MdjaxError(f"--redraw reads {str(path)!r}, which does not exist")
    write_report(json.loads(path.read_text()), _OUT_DIR.value)
    return
  settings = Settings(kinds=tuple(_KINDS.value), prompts_per_kind=_PROMPTS_PER_KIND.value,
                      max_new_tokens=_MAX_NEW_TOKENS.value,
                      batches=tuple(int(b) for b in _BATCHES.value),
                      temperatures=tuple(float(t) for t in _TEMPERATURES.value),
                      repeats=_REPEATS.value)
  if _QUICK.value:
    settings = dataclasses.replace(settings, **QUICK)
  for batch in settings.batches:
    check_count("batch size", batch, 1)
  for temperature in settings.temperatures:
    check_real("temperature", temperature, minimum=0)
  check_count("max_new_tokens", settings.max_new_tokens, 1)
  check_count("repeats", settings.repeats, 1)
  parsed = [Method.parse(spec) for spec in _METHODS.value]
  labels = [m.label for m in parsed]
  if len(set(labels)) < len(labels):
    raise MdjaxError(f"two methods share a label ({', '.join(labels)}): give LABEL=...")
  model, prompts = setup(settings, _QUICK.value)
  methods = {m.label: (m.strategy, m.options(model, _QUICK.value)) for m in parsed}
  bandwidth = memory_bandwidth(PROBE_MIB)
  header = dict(machine=machine_info(bandwidth),
                command=" ".join(["python3 -m experiments.bench.spec_bench"]
                                 + [shlex.quote(a) for a in sys.argv[1:]]),
                questions="random ids" if _QUICK.value else _QUESTIONS.value,
                method_specs=dict(zip(labels, _METHODS.value)))
  write_report(run(model, methods, prompts, settings, header, _OUT_DIR.value), _OUT_DIR.value)


if __name__ == "__main__":
  app.run(one_line_errors(main))
