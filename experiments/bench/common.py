"""What the benchmarks (and `experiments.device_check`) share, so that each sets a
contender up the same way: where results go, random prompts and models, the options
every bench gives prompt lookup and speculative decoding, draft trees parsed from
"DEPTHxTOP_KxBUDGET", random heads shaped like the shipped ones and the strategy that
decodes them (by the head-family registry), `tree_budget="auto"`'s choice; then the
timing (interleaved repeats, the part after the first token), the bandwidth probe, the
bytes a decode step reads, the model in both libraries, token agreement, the machine
description and the writing of results."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import tqdm
from jax.sharding import NamedSharding

import mdjax
from mdjax import files, sharding, strategies
from mdjax.checkpoints import hf
from mdjax.errors import MdjaxError, require
from mdjax.heads import FAMILIES, HeadsConfig, get_family, init_heads, shipped_heads, store

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402 -- after choosing the headless backend


RESULTS = pathlib.Path("docs") / "results"  # relative to the repository root, where benches run
# held-out questions, two for each of 13 task kinds (written for the benchmarks, never trained on)
QUESTIONS = pathlib.Path(__file__).parent / "data" / "head_questions.jsonl"
FIRST_PROMPT_ID = 3  # random prompts avoid the low special ids (pad, bos, eos of random models)
# The options of the strategies every bench runs with the same settings (Hugging Face's
# defaults for prompt lookup; a chain of 4 drafted tokens).
LOOKUP = dict(prompt_lookup_num_tokens=10, max_ngram_size=2)
DRAFT_TOKENS = 4
# The array (MiB) of the bandwidth probe a bench records beside its results (`memory_bandwidth`)
PROBE_MIB = 256
# A smoke test's torch intra-op threads: it runs beside other processes (the test suite's
# other worker), where torch's default of one thread per core stalls at every op's
# barrier (10x slower transformers runs; their times are not read).
QUICK_TORCH_THREADS = 1


def results_dir(topic: str) -> str:
  """A bench's default `--out_dir`: `docs/results/<topic>`, where the results the docs
  cite lie."""
  return str(RESULTS / topic)


def random_ids(rng: np.random.Generator, vocab: int, *shape: int) -> np.ndarray:
  """int32 ids of `shape`, uniform over the vocabulary above the special ids."""
  return rng.integers(FIRST_PROMPT_ID, vocab, shape).astype(np.int32)


def random_llama(config: mdjax.ModelConfig, seed: int, dtype, name: str) -> mdjax.Model:
  """A model of `config` with random weights (layers as a list: lay them out with
  `mdjax.models.layer_loop.with_layer_loop` or `mdjax.shard`)."""
  params = mdjax.init_params(config, seed, mdjax.weight_dtype(dtype))
  return mdjax.Model(config=config, params=params, name=name, random_weights=True)


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A question's task kind and its chat-template token ids."""

  kind: str
  ids: list[int]


def read_questions(path: str | pathlib.Path) -> list[tuple[str, str]]:
  """(category, prompt) of every line of a JSON-lines file (blank lines skipped); a
  line that is not an object with non-empty string "category" and "prompt" is an
  `MdjaxError` naming the file and the line."""
  questions = []
  for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), start=1):
    if not line.strip():
      continue
    try:
      entry = json.loads(line)
    except json.JSONDecodeError as e:
      raise MdjaxError(f"{path} line {number}: not JSON ({e.msg})") from None
    if not (isinstance(entry, dict) and all(isinstance(entry.get(key), str) and entry[key].strip()
                                            for key in ("category", "prompt"))):
      raise MdjaxError(f'{path} line {number}: expected {{"category": <text>, "prompt": <text>}}, '
                       f"got {line.strip()[:80]!r}")
    questions.append((entry["category"], entry["prompt"]))
  if not questions:
    raise MdjaxError(f"{path} holds no questions")
  return questions


def selected(questions: list[tuple[str, str]], kinds: int, per_kind: int) -> list[tuple[str, str]]:
  """The first `per_kind` questions (0: all) of each of the first `kinds` kinds (0: all),
  in file order."""
  chosen = list(dict.fromkeys(kind for kind, _ in questions))[:kinds or None]
  taken = dict.fromkeys(chosen, 0)
  kept = []
  for kind, text in questions:
    if kind in taken and (not per_kind or taken[kind] < per_kind):
      taken[kind] += 1
      kept.append((kind, text))
  return kept


def groups_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
  """The prompts in groups of `batch` rows (the last group filled from the start, round
  again where there are fewer prompts than rows)."""
  rows = [prompts[i % len(prompts)] for i in range(-(-len(prompts) // batch) * batch)]
  return [rows[i:i + batch] for i in range(0, len(rows), batch)]


@dataclasses.dataclass(frozen=True)
class Tree:
  """A fixed draft tree of `budget` nodes; a tree strategy that takes a shape (EAGLE's)
  also fixes its `depth` and `top_k`."""

  budget: int
  depth: int | None = None
  top_k: int | None = None

  @classmethod
  def parse(cls, text: str) -> "Tree":
    """From "DEPTHxTOP_KxBUDGET" (e.g. "4x4x16")."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
      raise MdjaxError(f"a draft tree is DEPTHxTOP_KxBUDGET of positive integers (e.g. 4x4x16), "
                       f"got {text!r}")
    depth, top_k, budget = map(int, parts)
    return cls(budget=budget, depth=depth, top_k=top_k)

  def for_strategy(self, strategy: str) -> "Tree":
    """The tree as `strategy` takes it: the budget alone where it takes no shape."""
    return self if takes_tree_shape(strategy) else Tree(self.budget)

  @property
  def label(self) -> str:
    return str(self.budget) if self.depth is None else f"{self.depth}x{self.top_k}x{self.budget}"

  def options(self) -> dict:
    options = dict(tree_budget=self.budget)
    if self.depth is not None:
      options.update(tree_depth=self.depth, tree_top_k=self.top_k)
    return options


def takes_tree_shape(strategy: str) -> bool:
  """Whether `strategy`'s trees have a depth and top-k besides their budget."""
  return {"tree_depth", "tree_top_k"} <= set(strategies.option_names(strategy))


def head_strategy(family: str) -> str:
  """The strategy that decodes heads of `family` (the registry's first)."""
  return get_family(family).strategy


def shipped_configs() -> dict[str, tuple[str, HeadsConfig]]:
  """Family -> (name, config) of the shipped heads of that family (the first by name),
  in the registry's order; the configs alone are read, not the weights."""
  found = {}
  for name in shipped_heads():
    config = HeadsConfig.from_json(json.loads(
        (store.ASSETS_DIR / name / store.CONFIG_FILE).read_text()))
    found.setdefault(config.family, (name, config))
  return {family: found[family] for family in FAMILIES if family in found}


def random_heads(model: mdjax.Model, family: str, seed: int = 0) -> mdjax.Heads:
  """Random heads of `family` for `model` in its dtype, shaped like the shipped heads of
  that family (their heads, layers and draft vocabulary size, at most half the
  vocabulary: random ids) with their held-out acceptance profile, so that `auto` sizes
  trees as it would for them; the residual blocks of heads that have them random
  (`init_heads` leaves them zero, which would draft the target's own last token). Their
  drafts are rarely accepted: timed, they measure a step's cost, not a speedup."""
  _, shipped = shipped_configs()[family]
  c = model.config
  kind = get_family(family)
  draft = min(shipped.draft_vocab_size, c.vocab_size // 2)
  config = HeadsConfig(family=family, base_model=model.name, base_family=c.family,
                       hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                       num_heads=shipped.num_heads, num_layers=shipped.num_layers,
                       top_accuracy=shipped.top_accuracy, draft_vocab_size=draft,
                       target_layers=kind.layers_for(c))
  rng = np.random.default_rng(seed)
  ids = (np.sort(rng.choice(c.vocab_size, draft, replace=False)) if draft
         else np.arange(c.vocab_size)).astype(np.int32)
  dtype = model.params["embed"].dtype
  params = kind.restrict(init_heads(config, c, seed, dtype).params, ids, model.params)
  if draft:
    params = {**params, "draft_ids": jnp.asarray(ids)}
  if "blocks" in params:
    w = params["blocks"]["w"]  # [K, layers, D, D]
    noise = rng.normal(0, 0.3 / np.sqrt(w.shape[-1]), w.shape)
    params = {**params, "blocks": {**params["blocks"], "w": jnp.asarray(noise, w.dtype)}}
  return mdjax.Heads(config=config, params=params)


def auto_choice(model: mdjax.Model, rows, strategy: str, new_tokens: int, **options) -> dict:
  """What `tree_budget="auto"` chose for `strategy` at the batch of `rows` and
  `new_tokens` per row (the choice counts the tokens a row generates), as `out.stats`
  says it: the tree, its expected tokens per pass and speedup, and the t(n) it used."""
  out = mdjax.generate(model, rows, strategy=strategy, max_new_tokens=new_tokens,
                       eos_token_id=[], **options)
  return {k: v for k, v in out.stats.items() if k.startswith(("tree_", "expected_", "pass_cost_"))}


def memory_bandwidth(mib: int, trials: int = 5) -> dict:
  """Best-of-`trials` bandwidth (GB/s) of summing (read) and copying (read + write)
  a float32 array of `mib` MiB, split over one thread per CPU (numpy releases the GIL)."""
  source = np.ones(mib * 2**20 // 4, np.float32)
  target = np.empty_like(source)
  workers = os.cpu_count() or 1
  sources, targets = np.array_split(source, workers), np.array_split(target, workers)
  with ThreadPoolExecutor(workers) as pool:

    def best(work) -> float:
      times = []
      for _ in range(trials):
        start = time.perf_counter()
        list(pool.map(work, range(workers)))
        times.append(time.perf_counter() - start)
      return min(times)

    read_s = best(lambda i: sources[i].sum())
    copy_s = best(lambda i: np.copyto(targets[i], sources[i]))
  return dict(read_gbps=source.nbytes / read_s / 1e9, copy_gbps=2 * source.nbytes / copy_s / 1e9,
              array_mib=mib, threads=workers)


def step_bytes(model, batch: int, keys: float, per_device: bool = False) -> float:
  """Bytes one decode step must read: every weight except the embedding table, of
  which only the `batch` gathered rows (all of it when tied to the head), plus the
  K/V of `keys` cached tokens per row.

  `per_device`: what one device reads when the model lies on a mesh (`mdjax.shard`):
  its shard of each weight and of the KV cache (`mdjax.sharding.CACHE_AXES`); a
  replicated weight (data axis) is read whole by every device. Without a mesh, the same
  as the total."""
  params, config = model.params, model.config
  embed = params["embed"]
  itemsize = embed.dtype.itemsize

  def size(x) -> int:
    if not per_device:
      return x.nbytes
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize

  total = sum(size(x) for x in jax.tree.leaves(params))
  if "lm_head" in params:  # at most `batch` rows of the table (of a device's shard)
    total += batch * embed.shape[1] * itemsize - size(embed)
  kv_shape = (config.num_layers, batch, 1, config.num_kv_heads, config.head_dim)
  layout = getattr(model, "layout", None)
  if per_device and layout is not None:
    kv_spec = sharding.spec(layout.mesh, sharding.CACHE_AXES["k"], kv_shape)
    kv_shape = NamedSharding(layout.mesh, kv_spec).shard_shape(kv_shape)
  return total + 2 * math.prod(kv_shape) * keys * itemsize  # K and V


def torch_oracle():
  """The `torch` module, which the transformers oracle runs on: a development package
  (requirements-dev.txt), imported only by the scripts that compare against transformers
  so that the others run without it; missing, a `MissingPackageError` naming it."""
  return require("torch", "the transformers oracle", "torch==2.13.0")


def set_torch_threads(threads: int, quick: bool) -> None:
  """Imports torch (`torch_oracle`) and sets its intra-op threads to `threads` (0: torch's
  default, one per core), or in a smoke test (`quick`) to `QUICK_TORCH_THREADS`."""
  threads = threads or (QUICK_TORCH_THREADS if quick else 0)
  torch = torch_oracle()
  if threads:
    torch.set_num_threads(threads)


def load_pair(name: str, seed: int, scratch: pathlib.Path):
  """The model in mdjax and in transformers with identical float32 weights: anything
  `mdjax.load` takes. What it read from a Hugging Face directory (a shipped model, a
  hub id, a GGUF's converted copy such as `smollm2-135m-instruct`'s) transformers reads
  from the same directory (`model.path`); a random model is exported with `save_hf`
  into `scratch` first."""
  import transformers  # here, not at the top: a bench without the oracle starts faster
  model = mdjax.load(name, seed=seed, dtype="float32")  # not the accelerators' bfloat16
  directory = model.path
  if directory is None:
    directory = scratch / name
    hf.save_hf(model, directory)
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(directory),
                                                                dtype=torch_oracle().float32).eval()
  # No EOS: every row runs the full budget in both libraries and the logits are untouched.
  reference.generation_config.eos_token_id = None
  return model, reference


def agreement(ours: list[list[int]], theirs: np.ndarray) -> dict:
  """Matching tokens, position by position, and the shortest identical prefix."""
  ours = np.asarray(ours)
  same = ours == theirs
  prefix = [int(row.argmin()) if not row.all() else len(row) for row in same]
  return dict(matching_tokens=int(same.sum()), total_tokens=int(same.size),
              identical_prefix=min(prefix))


def divergence_gaps(model: mdjax.Model, rows: list[list[int]], greedy: list[list[int]],
                    ours: list[list[int]]) -> list[float]:
  """For each row whose tokens leave greedy's: the gap between the top two of greedy's
  logits where they part (mdjax's forward of the prompt and greedy's tokens so far). A
  gap within the dtype's rounding is a near-tie, where two batch shapes may round
  their sums apart and pick different tokens; a large gap is a bug."""
  gaps = []
  for prompt, reference, tokens in zip(rows, greedy, ours):
    parted = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if parted is not None:
      logits = mdjax.forward_logits(model, list(prompt) + list(reference[:parted]))[-1]  # [V]
      top2 = np.sort(logits)[-2:]
      gaps.append(float(top2[1] - top2[0]))
  return gaps


def mismatch_line(where: str, cell: dict) -> str:
  """"<where>: m/n tokens equal greedy's", with the widest gap between greedy's top-2
  logits where its rows parted (`divergence_gaps`), for a cell whose tokens are not greedy's."""
  gaps = cell.get("divergence_gaps")
  parted = (f", parted where greedy's top-2 logits were {max(gaps):.3g} apart at most"
            if gaps else "")
  return (f"{where}: {cell['tokens']['matching_tokens']}/{cell['tokens']['total_tokens']} tokens "
          f"equal greedy's{parted}")


def median_after_first_token(whole: list[float], first: list[float]) -> float:
  """The median over repetitions of a generation's seconds after its first token: each
  whole run minus the run cut at one token from the same repetition (paired, so a slow
  repetition slows both)."""
  return statistics.median(w - f for w, f in zip(whole, first, strict=True))


def machine_info(bandwidth: dict) -> dict:
  """Versions, threads and the bandwidth probe; `load_average` (1 min) tells how busy
  the machine was, i.e. how far to trust absolute times. torch's version and threads
  only when the script imported it (`torch_oracle`): it ran the transformers oracle."""
  torch = sys.modules.get("torch")
  oracle = {} if torch is None else dict(torch=torch.__version__,
                                         torch_threads=torch.get_num_threads())
  return dict(cpu_count=os.cpu_count(), load_average=os.getloadavg()[0],
              processor=platform.processor() or platform.machine(),
              python=platform.python_version(), jax=jax.__version__, numpy=np.__version__,
              transformers=importlib.metadata.version("transformers"), **oracle,
              jax_devices=[str(d) for d in jax.devices()], bandwidth=bandwidth)


def machine_line(machine: dict) -> str:
  """The part of a figure title that says how far to trust its times."""
  return f"{machine['cpu_count']} CPUs, load {machine['load_average']:.1f}"


def bars(ax, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
  """Grouped bars: one group per label, one bar per series; a line at 1 (greedy)."""
  width = 0.8 / max(len(series), 1)
  for i, (name, values) in enumerate(series.items()):
    ax.bar(np.arange(len(labels)) + i * width, values, width, label=name)
  ax.axhline(1.0, color="black", lw=0.8)
  ax.set_xticks(np.arange(len(labels)) + width * (len(series) - 1) / 2, labels, rotation=30,
                ha="right", fontsize=8)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=8)


def save_figure(fig, path: pathlib.Path, title: str) -> None:
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_json(path: pathlib.Path, results: dict) -> None:
  """`results` as JSON at `path`, written beside it and renamed into place, so a reader
  (or a run stopped mid-write) never sees half a file."""
  files.write_text(path, json.dumps(results, indent=2) + "\n")


def write_results(results: dict, out_dir: str, stem: str, plot, table) -> None:
  """`out_dir/stem.json` and `out_dir/stem.png` (drawn by `plot(results, path)`), each
  written atomically, then the table printed."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  write_json(out_dir / f"{stem}.json", results)
  with files.atomic_file(out_dir / f"{stem}.png") as partial:
    plot(results, partial)
  print(table(results))
  print(f"wrote {out_dir / (stem + '.json')} and {out_dir / (stem + '.png')}")


SUMMED_STATS = ("target_passes", "draft_passes", "drafted_at", "accepted_at")  # counts
# what a strategy drafting from several sources counts per source (`drafted_<source>`), summed too
SOURCE_STATS = ("drafted_", "accepted_")

RATE_STATS = ("mean_accepted_length", "acceptance_rate_at")
# what `tree_budget="auto"` chose for a request (`out.stats`), kept per group
CHOICE_STATS = ("tree_choice", "tree_budget", "tree_depth", "tree_top_k",
                "expected_tokens_per_pass", "expected_speedup", "sources", "left_out")


def run_mdjax(model, groups: np.ndarray, new_tokens: int, strategy: str, first_token: bool = True,
              **options) -> dict:
  """One `generate` per group of `groups` [G, batch, L], in turn, then (with `first_token`)
  the same cut at one token: the seconds of each (summed over the groups; 0 for the cut
  when not run), the pass counts summed (per-source counts too), the rates (acceptance)
  their mean, and each group's `auto` choice (`CHOICE_STATS`, where the strategy made one)."""
  def generate(rows, tokens):
    return mdjax.generate(model, rows, strategy=strategy, max_new_tokens=tokens,
                          eos_token_id=[], **options)
  runs = [generate(rows, new_tokens) for rows in groups]
  first = sum(generate(rows, 1).stats["wall_s"] for rows in groups) if first_token else 0.0
  summed = [k for k in runs[0].stats if k in SUMMED_STATS or k.startswith(SOURCE_STATS)]
  stats = {k: np.sum([r.stats[k] for r in runs], axis=0).tolist() for k in summed}
  stats |= {k: np.mean([r.stats[k] for r in runs], axis=0).tolist()
            for k in RATE_STATS if k in runs[0].stats}
  choices = [{k: r.stats[k] for k in CHOICE_STATS if k in r.stats} for r in runs]
  return dict(seconds=sum(r.stats["wall_s"] for r in runs), first_token_seconds=first,
              stats=stats, sequences=[s for r in runs for s in r.sequences],
              choices=choices if any(choices) else [])


def interleaved(calls: dict, repeats: int, label: str) -> tuple[dict, dict]:
  """Each call once untimed (compiles, warms up), then `repeats` rounds over all of them,
  the order rotated each round (so that no call always runs after the same one): what
  each untimed call returned, and each call's list of `repeats` results."""
  first = {name: call() for name, call in calls.items()}
  names = list(calls)
  samples = {name: [] for name in names}
  for rep in tqdm.trange(repeats, desc=label, leave=False):
    for name in names[rep % len(names):] + names[:rep % len(names)]:
      samples[name].append(calls[name]())
  return first, samples


def timed(contenders: dict, repeats: int, label: str) -> dict:
  """Each contender once untimed (compile, warm up), then `repeats` interleaved timed
  runs; returns per contender the last run's result with the median seconds, the
  median seconds to the first token, and the median of the paired differences
  (`decode_seconds`: everything after the first token)."""
  results, runs = interleaved(contenders, repeats, label)
  names = list(contenders)

  def seconds(name, key):
    return [run[key] for run in runs[name]]
  return {name: dict(results[name], seconds=statistics.median(seconds(name, "seconds")),
                     first_token_seconds=statistics.median(seconds(name, "first_token_seconds")),
                     decode_seconds=median_after_first_token(seconds(name, "seconds"),
                                                             seconds(name, "first_token_seconds")))
          for name in names}


def tokens_per_pass(result: dict, steps: int, groups: int) -> float:
  """Tokens a row generated per target pass of a run of `groups` generations of `steps`
  tokens in all, each one's prefill counted as a pass (greedy's: 1)."""
  return steps / (result["stats"]["target_passes"] + groups)


def summarize(result: dict, greedy: dict, steps: int, groups: int) -> dict:
  """The numbers of one contender beside greedy's (same prompts, same budget); `steps`:
  the tokens each row generated in all its `groups` (ms per token is per step of a
  batch; the decode part is the `steps - groups` steps after each first token)."""
  cell = dict(ms_per_token=result["seconds"] / steps * 1e3,
              speedup_vs_greedy=greedy["seconds"] / result["seconds"],
              first_token_ms=result["first_token_seconds"] / groups * 1e3,
              decode_ms_per_token=result["decode_seconds"] / (steps - groups) * 1e3,
              decode_speedup_vs_greedy=greedy["decode_seconds"] / result["decode_seconds"],
              tokens=agreement(result["sequences"], np.asarray(greedy["sequences"])))
  stats = result.get("stats")
  if stats:
    cell.update(target_passes=stats["target_passes"],
                passes_ratio_vs_greedy=greedy["stats"]["target_passes"] / stats["target_passes"])
    for key in ("draft_passes", "mean_accepted_length", "acceptance_rate_at"):
      if key in stats:
        cell[key] = stats[key]
  return cell
