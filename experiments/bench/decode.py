"""Greedy decoding speed: mdjax vs transformers (PyTorch) on the same weights.

For each model and batch size, on random prompts of `--prompt_len` tokens:

* mdjax `generate(strategy="greedy")` for `--new_tokens` tokens and for 1 token
  (prefill alone). The first call of each program compiles; compile times are
  reported apart from run times: generate's two programs (`compile_s`,
  `prefill_compile_s`) and the bare T=1 step (`bare_step_compile_s`: its first call
  minus its median). mdjax unrolls the layers, so compiling grows with their number.
* transformers `generate(do_sample=False)` for the same two lengths.
* the jitted `decode_step` alone at T=1 on a cache of the size `generate` uses, so
  `loop_ratio` = (mdjax decode time per step) / (bare step time) measures what the
  on-device loop (sampling, stopping, bookkeeping) costs on top of the model.
* the memory-bandwidth roofline: bytes a decode step must read (weights, the
  embedding rows it gathers, the K/V it attends to) / numpy's read bandwidth.

Timings are medians over `--repeats` repetitions in which the contenders are
interleaved (rotating order), so machine noise hits them alike and ratios are
meaningful even when absolute times are not. Per-token times are per step of the
whole batch: `ms_per_token` = wall / new_tokens (prefill included);
`decode_ms_per_token` = (wall(new_tokens) - wall(1)) / (new_tokens - 1).

A random model name (`mdjax.checkpoints.registry.RANDOM_MODELS`) is created in mdjax and
exported with `save_hf` for transformers; anything else `mdjax.load` reads (a
directory, a shipped name, a GGUF model such as `smollm2-135m-instruct`, read through
its float32 Hugging Face copy) is loaded by both from the same directory. Writes
`bench_decode.json` and `bench_decode.png` to `--out_dir`:

    python -m experiments.bench.decode [--models=random-llama,DIR] [--batches=1,8] [--quick]
    python -m experiments.bench.decode --model=smollm2-135m-instruct  # --model: one name

On a shared machine, torch's default of one intra-op thread per core stalls at
every op's barrier whenever another process holds a core (10-50x slower decoding);
`--torch_threads=1` measures transformers without that effect, and the JSON records
the load average so a reader can tell which case a result is.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import tqdm
import transformers

import mdjax
from experiments.cli import one_line_errors
from mdjax import strategies
from mdjax.cache import KVCache
from experiments.bench.common import (FIRST_PROMPT_ID, agreement, load_pair, machine_info,
                                      machine_line, median_after_first_token, memory_bandwidth, plt,
                                      random_ids, results_dir, save_figure, set_torch_threads,
                                      step_bytes, torch_oracle, write_results)
from mdjax.generate import cache_size
from mdjax.prompts import bucket
from mdjax.strategies.base import ModelFn


_MODELS = flags.DEFINE_list("models", ["random-llama"],
                            "Anything `mdjax.load` takes, comma-separated: random, shipped or GGUF "
                            "model names (smollm2-135m-instruct), Hugging Face directories.")
flags.DEFINE_alias("model", "models")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per row.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per row (no early stop).")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed repetitions of every contender (median).")
_BANDWIDTH_MIB = flags.DEFINE_integer("bandwidth_mib", 1024, "Array size of the bandwidth probe.")
_TORCH_THREADS = flags.DEFINE_integer(
    "torch_threads", 0, "torch intra-op threads (0: torch's default, one per core, which "
    "stalls at every op's barrier when another process holds a core; 1 avoids that, and "
    "is --quick's).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights and prompts.")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("decode"), "Where the JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: tiny model, short runs, few repeats.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """What to measure (from the flags, or `QUICK` for the smoke test)."""

  models: tuple[str, ...]
  batches: tuple[int, ...]
  prompt_len: int
  new_tokens: int
  repeats: int
  bandwidth_mib: int
  seed: int


QUICK = dict(models=("random-llama-tiny",), batches=(2,), prompt_len=16, new_tokens=8,
             repeats=2, bandwidth_mib=64)


def run_mdjax(model: mdjax.Model, prompts: np.ndarray, new_tokens: int):
  """One greedy `mdjax.generate`: (seconds, sequences, compile seconds)."""
  out = mdjax.generate(model, prompts, strategy="greedy", max_new_tokens=new_tokens,
                       eos_token_id=[])
  expected = prompts.shape[0] * new_tokens
  if out.stats["generated_tokens"] != expected:
    raise RuntimeError(f"mdjax generated {out.stats['generated_tokens']} tokens, not {expected}")
  return out.stats["wall_s"], out.sequences, out.stats["compile_s"]


def run_transformers(reference, prompts, new_tokens: int):
  """One greedy transformers `generate` of the int64 tensor `prompts` `[B, L]`: (seconds,
  generated ids `[B, new_tokens]`)."""
  mask = torch_oracle().ones_like(prompts)
  start = time.perf_counter()
  out = reference.generate(prompts, attention_mask=mask, do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
  seconds = time.perf_counter() - start
  if out.shape != (prompts.shape[0], prompts.shape[1] + new_tokens):
    raise RuntimeError(f"transformers returned shape {tuple(out.shape)}")
  return seconds, out[:, prompts.shape[1]:].numpy()


class BareStep:
  """The jitted `decode_step` alone at T=1 (one token per row), on the cache
  `generate` would allocate, after a prefill of the prompts."""

  def __init__(self, model: mdjax.Model, prompts: np.ndarray, new_tokens: int):
    self.model = model
    config = model.config
    batch, prompt_len = prompts.shape
    slots = cache_size(strategies.get("greedy")(model=ModelFn(config=config)), bucket(prompt_len),
                       bucket(new_tokens), 1)
    self.topology = mdjax.Topology.causal(batch)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompts.shape)
    cache = KVCache.for_params(config, model.params, batch, slots,
                               model.params["embed"].dtype)
    _, _, self.prefilled = mdjax.decode_step(
        model.params, cache, jnp.asarray(prompts, jnp.int32), positions,
        jnp.zeros_like(positions), self.topology, config=config,
        logits_at=jnp.full((batch, 1), prompt_len - 1))
    self.tokens = jnp.full((batch, 1), FIRST_PROMPT_ID, jnp.int32)  # any id costs the same
    self.segments = jnp.zeros((batch, 1), jnp.int32)
    self.positions = [jnp.full((batch, 1), prompt_len + i, jnp.int32)
                      for i in range(new_tokens - 1)]

  def run(self) -> list[float]:
    """Seconds of each of the `new_tokens - 1` steps generate's loop makes (cache
    filling from the prompt on), each waited for on its own."""
    # A fresh copy: the step donates its cache, the prefilled one must survive.
    cache = jax.tree.map(jnp.copy, self.prefilled)
    times = []
    for positions in self.positions:
      start = time.perf_counter()
      logits, _, cache = mdjax.decode_step(self.model.params, cache, self.tokens, positions,
                                           self.segments, self.topology,
                                           config=self.model.config)
      jax.block_until_ready((logits, cache))
      times.append(time.perf_counter() - start)
    return times


def bench_batch(model: mdjax.Model, reference, batch: int, settings: Settings,
                bandwidth_gbps: float) -> dict:
  """Every number of one (model, batch) cell."""
  rng = np.random.default_rng(settings.seed)
  prompts = random_ids(rng, model.config.vocab_size, batch, settings.prompt_len)
  torch_prompts = torch_oracle().from_numpy(prompts.astype(np.int64))
  n = settings.new_tokens

  # First calls compile (mdjax) or warm up (transformers); they are not timed.
  _, ours, compile_s = run_mdjax(model, prompts, n)
  _, _, prefill_compile_s = run_mdjax(model, prompts, 1)
  _, theirs = run_transformers(reference, torch_prompts, n)
  run_transformers(reference, torch_prompts, 1)
  bare = BareStep(model, prompts, n)
  first_steps = bare.run()  # its first step compiles the T=1 program

  contenders = {
      "mdjax": lambda: run_mdjax(model, prompts, n)[0],
      "mdjax_prefill": lambda: run_mdjax(model, prompts, 1)[0],
      "transformers": lambda: run_transformers(reference, torch_prompts, n)[0],
      "transformers_prefill": lambda: run_transformers(reference, torch_prompts, 1)[0],
      "bare_step": bare.run,
  }
  times = {name: [] for name in contenders}
  names = list(contenders)
  for rep in tqdm.trange(settings.repeats, desc=f"{model.name} batch {batch}", leave=False):
    for name in names[rep % len(names):] + names[:rep % len(names)]:
      times[name].append(contenders[name]())

  def per_token(lib: str) -> dict:
    full, prefill = times[lib], times[f"{lib}_prefill"]
    return dict(ms_per_token=statistics.median(full) / n * 1e3,
                prefill_ms=statistics.median(prefill) * 1e3,
                decode_ms_per_token=median_after_first_token(full, prefill) / (n - 1) * 1e3,
                tokens_per_s=batch * n / statistics.median(full))

  ours_t, theirs_t = per_token("mdjax"), per_token("transformers")
  bare_ms = statistics.median(t for run in times["bare_step"] for t in run) * 1e3
  bare_compile_s = first_steps[0] - bare_ms / 1e3
  roofline_ms = step_bytes(model, batch, settings.prompt_len + n / 2) / (bandwidth_gbps * 1e9) * 1e3
  for numbers in (ours_t, theirs_t):
    numbers["roofline_fraction"] = roofline_ms / numbers["decode_ms_per_token"]
  return dict(
      mdjax=dict(ours_t, compile_s=compile_s, prefill_compile_s=prefill_compile_s),
      transformers=theirs_t,
      speedup=theirs_t["ms_per_token"] / ours_t["ms_per_token"],
      decode_speedup=theirs_t["decode_ms_per_token"] / ours_t["decode_ms_per_token"],
      bare_step_ms=bare_ms,
      bare_step_compile_s=bare_compile_s,
      loop_ratio=ours_t["decode_ms_per_token"] / bare_ms,
      roofline_ms=roofline_ms,
      tokens=agreement(ours, theirs),
  )


def run(settings: Settings) -> dict:
  """The whole benchmark as one JSON-able dict."""
  bandwidth = memory_bandwidth(settings.bandwidth_mib)
  results = dict(machine=machine_info(bandwidth), settings=dataclasses.asdict(settings), models={})
  with tempfile.TemporaryDirectory() as scratch:
    for name in dict.fromkeys(settings.models):
      model, reference = load_pair(name, settings.seed, pathlib.Path(scratch))
      results["models"][name] = dict(
          description=model.description, num_params=model.config.num_params,
          param_bytes=sum(x.nbytes for x in jax.tree.leaves(model.params)),
          transformers_class=type(reference).__name__,
          transformers_attention=reference.config._attn_implementation,
          batches={str(b): bench_batch(model, reference, b, settings, bandwidth["read_gbps"])
                   for b in settings.batches})
  return results


COLUMNS = [  # header, format, path into a batch cell
    ("mdjax ms/tok", "{:.2f}", ("mdjax", "ms_per_token")),
    ("hf ms/tok", "{:.2f}", ("transformers", "ms_per_token")),
    ("speedup", "{:.2f}x", ("speedup",)),
    ("mdjax dec", "{:.2f}", ("mdjax", "decode_ms_per_token")),
    ("hf dec", "{:.2f}", ("transformers", "decode_ms_per_token")),
    ("dec speedup", "{:.2f}x", ("decode_speedup",)),
    ("bare step", "{:.2f}", ("bare_step_ms",)),
    ("loop ratio", "{:.3f}", ("loop_ratio",)),
    ("roofline", "{:.2f}", ("roofline_ms",)),
    ("roof mdjax", "{:.0%}", ("mdjax", "roofline_fraction")),
    ("roof hf", "{:.0%}", ("transformers", "roofline_fraction")),
    ("compile s", "{:.1f}", ("mdjax", "compile_s")),
    ("prefill compile s", "{:.1f}", ("mdjax", "prefill_compile_s")),
    ("step compile s", "{:.1f}", ("bare_step_compile_s",)),
]


def table(results: dict) -> str:
  """A compact text table: one line per (model, batch); times in ms per step."""
  header = ["model", "batch"] + [c[0] for c in COLUMNS] + ["same tokens"]
  rows = []
  for name, entry in results["models"].items():
    for batch, cell in entry["batches"].items():
      values = []
      for _, fmt, path in COLUMNS:
        value = cell
        for key in path:
          value = value[key]
        values.append(fmt.format(value))
      same = f"{cell['tokens']['matching_tokens']}/{cell['tokens']['total_tokens']}"
      rows.append([name, batch] + values + [same])
  widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
  return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in [header] + rows)


def plot(results: dict, path: pathlib.Path) -> None:
  """Per model: ms per token (prefill included) of both libraries for each batch,
  decode-only time as a dot, the roofline as a dashed line, the speedup on top."""
  models = results["models"]
  fig, axes = plt.subplots(1, len(models), figsize=(max(6, 5 * len(models)), 5), squeeze=False)
  for ax, (name, entry) in zip(axes[0], models.items()):
    batches = list(entry["batches"])
    x = np.arange(len(batches))
    width = 0.38
    for offset, lib, color in ((-width / 2, "mdjax", "tab:blue"),
                               (width / 2, "transformers", "tab:orange")):
      cells = [entry["batches"][b][lib] for b in batches]
      ax.bar(x + offset, [c["ms_per_token"] for c in cells], width, color=color, label=lib)
      ax.plot(x + offset, [c["decode_ms_per_token"] for c in cells], "ko", ms=4,
              label="decode only" if lib == "mdjax" else None)
    for i, b in enumerate(batches):
      cell = entry["batches"][b]
      ax.hlines(cell["roofline_ms"], i - width, i + width, colors="red", linestyles="--",
                label="bandwidth roofline" if i == 0 else None)
      top = max(cell["mdjax"]["ms_per_token"], cell["transformers"]["ms_per_token"])
      ax.annotate(f"{cell['speedup']:.2f}x", (i, top), ha="center", va="bottom",
                  xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(x, [f"batch {b}" for b in batches])
    ax.set_ylabel("ms per token (per step of the batch)")
    ax.set_title(name, fontsize=10)
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
  machine = results["machine"]
  save_figure(fig, path, f"greedy decoding, mdjax vs transformers\n(speedup = transformers / "
              f"mdjax)\n{machine_line(machine)}, {machine['bandwidth']['read_gbps']:.1f} GB/s read, "
              f"torch threads {machine['torch_threads']}")


def settings_from_flags() -> Settings:
  settings = Settings(models=tuple(_MODELS.value), batches=tuple(int(b) for b in _BATCHES.value),
                      prompt_len=_PROMPT_LEN.value, new_tokens=_NEW_TOKENS.value,
                      repeats=_REPEATS.value, bandwidth_mib=_BANDWIDTH_MIB.value, seed=_SEED.value)
  return dataclasses.replace(settings, **QUICK) if _QUICK.value else settings


def main(argv):
  del argv
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  settings = settings_from_flags()
  if settings.new_tokens < 2:
    raise app.UsageError("--new_tokens must be >= 2 (decode time is measured against 1)")
  # before any work, and before machine_info records its threads
  set_torch_threads(_TORCH_THREADS.value, _QUICK.value)
  results = run(settings)
  results["machine"]["load_average_after"] = os.getloadavg()[0]
  write_results(results, _OUT_DIR.value, "bench_decode", plot, table)


if __name__ == "__main__":
  app.run(one_line_errors(main))
