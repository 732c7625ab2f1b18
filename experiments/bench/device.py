"""Decoding on the host's accelerators: per-token time, tokens/s and the memory-bandwidth
roofline, for every mesh shape the devices allow.

For each mesh shape (`--meshes`; default: one device as the baseline, then every
(data, tensor) factorisation of the device count, e.g. 1x8, 2x4, 4x2, 8x1 on 8 TPU
cores) the model is placed with `mdjax.shard` (`mdjax.sharding`) and, on random
prompts of `--prompt_len` tokens, each row generating `--new_tokens` tokens with no
early stop:

* greedy at every batch size of `--batches`: ms per token (per step of the batch,
  prefill included), the time to the first token, the decode ms per token after it
  (the same generation cut at one token, paired within a repetition), tokens/s
  (whole and decode), and the roofline: the bytes one decode step must read (the
  weights, the embedding rows it gathers, the K/V of the tokens it attends to;
  `common.step_bytes`) over the memory bandwidth, and `roofline_fraction` = roofline
  time / measured decode time per step (1.0 = at the bandwidth bound);
* at batch 1, prompt lookup and (with `--draft`) speculative decoding with a draft,
  and `multi_question` with `--questions` questions over one prompt, each beside
  greedy on the same rows (for multi_question: the prompt duplicated per question,
  i.e. batching): speedup, target passes, and whether the tokens equal greedy's.

Roofline on a mesh: an accelerator reads its own shard of each weight and of the KV
cache from its own HBM, so the bound is the most bytes one device reads over one
device's bandwidth (`bandwidth_scope` "per_device"). Simulated CPU devices
(`JAX_NUM_CPU_DEVICES=N`, read by JAX when it starts) share one memory, so there the
bound is the bytes all devices read together over the host's bandwidth ("shared"): a
replicated weight (data axis) is read once per device.

The bandwidth: `--bandwidth_gbps`, else the device kind's datasheet figure per JAX
device (`BANDWIDTH_GBPS`: H100 SXM 3350 GB/s, H200 4800, TPU v5e 819, v4 1200, ...),
else (an unknown accelerator) a read probe on the device; on CPU the higher of numpy's
read and copy bandwidths (`common.memory_bandwidth`: on a small or busy CPU the
summing read probe can be bound by its arithmetic, below what the memory delivers). On
an accelerator the on-device probe is recorded beside the datasheet figure.

The model: `--model` (anything `mdjax.load` takes), else a random llama of
`--preset` (`PRESETS`: "1b" = hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, vocab 32000 — the default on GPU/TPU; "small" on CPU; "tiny" for
the smoke test). dtype: bfloat16 on GPU/TPU, float32 on CPU (`--dtype`). Random
weights give noise, so speculative and prompt-lookup acceptance here measures the
machinery, not a real model's speedup; pass a real model and draft for that.

Contenders are interleaved over `--repeats` repetitions and timed by median
(`common.timed`). Writes `bench_device.json` and `bench_device.png` to `--out_dir`:

    python -m experiments.bench.device                      # GPU/TPU: the 1b preset
    JAX_NUM_CPU_DEVICES=4 python -m experiments.bench.device --preset=small --batches=1,8
    python -m experiments.bench.device --model=smollm2-135m-instruct --meshes=1x1,1x4
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import mdjax
from experiments.cli import one_line_errors
from experiments.bench.common import (DRAFT_TOKENS, LOOKUP, machine_info, machine_line,
                                      memory_bandwidth, plt, random_ids, random_llama, results_dir,
                                      run_mdjax, save_figure, step_bytes, summarize, timed,
                                      write_results)
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.models.layer_loop import default_layer_loop, with_layer_loop

PRESETS = {
    # A 1B-class llama (Llama-3.2-1B's shape, untied, a 32k vocabulary): 1.1B parameters.
    "1b": RANDOM_MODELS["random-llama-1b"],
    # 17M parameters: minutes on a small CPU.
    "small": mdjax.ModelConfig(family="llama", vocab_size=4096, hidden_size=512,
                               intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=4,
                               head_dim=64, max_position_embeddings=4096, bos_token_id=1,
                               eos_token_id=(2,)),
}
PRESETS["tiny"] = dataclasses.replace(  # random-llama-tiny's size, 4 KV heads (tensor <= 4)
    PRESETS["small"], vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=512)

# Memory bandwidth per JAX device, GB/s (datasheets), by device kind: the first pattern
# found (case-insensitive) in `jax.devices()[0].device_kind` wins. A TPU v2/v3 chip is
# two JAX devices (cores), each with half the chip's HBM bandwidth; v4 and later are one.
BANDWIDTH_GBPS = (
    (r"gh200", 4000), (r"h200", 4800), (r"h100.*pcie", 2000), (r"h100.*nvl", 3900),
    (r"h100|h800", 3350), (r"b200|b100", 8000),
    (r"a100.*sxm.*80", 2039), (r"a100.*80.*pcie", 1935), (r"a100", 1555),
    (r"l40", 864), (r"a10g?\b", 600), (r"\bl4\b", 300), (r"\bt4\b", 320), (r"v100", 900),
    (r"rtx 4090", 1008), (r"rtx 3090", 936),
    (r"tpu v6|tpu v6e|trillium", 1640), (r"tpu v5 ?lite|tpu v5e", 819), (r"tpu v5", 2765),
    (r"tpu v4 ?lite", 614), (r"tpu v4", 1200), (r"tpu v3", 450), (r"tpu v2", 300),
)

QUESTION_LEN = 4

_MODEL = flags.DEFINE_string("model", "", "Anything `mdjax.load` takes; empty: a random llama "
                             "of --preset.")
_PRESET = flags.DEFINE_enum("preset", None, list(PRESETS), "Random llama size (without "
                            "--model); default: 1b on GPU/TPU, small on CPU.")
_DRAFT = flags.DEFINE_string("draft", "", "Draft model for speculative decoding: a preset name "
                             "(a random llama with the target's vocabulary) or anything "
                             "`mdjax.load` takes; empty: no speculative contender.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Weights and KV cache; default: bfloat16 on GPU/TPU, float32 on CPU.")
_LAYER_LOOP = flags.DEFINE_enum("layer_loop", None, ["scan", "unrolled"],
                                "Default: mdjax's (`default_layer_loop`).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32", "128"], "Greedy batch sizes.")
_MESHES = flags.DEFINE_list("meshes", [], "Mesh shapes DATAxTENSOR, e.g. 1x1,1x4,2x2; empty: "
                            "1x1 and every factorisation of the device count.")
_QUESTIONS = flags.DEFINE_integer("questions", 8, "multi_question branches over one prompt.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per row.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per row (no early stop).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions of every contender (median).")
_BANDWIDTH = flags.DEFINE_float("bandwidth_gbps", 0.0, "Memory bandwidth per device, GB/s; 0: "
                                "the device kind's (BANDWIDTH_GBPS), else measured.")
_BANDWIDTH_MIB = flags.DEFINE_integer("bandwidth_mib", 1024, "Array size of the bandwidth probes.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights and prompts.")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("device"), "Where bench_device.json and .png "
                               "go.")
flags.DEFINE_alias("out", "out_dir")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: tiny model, short runs, one repeat.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """What to measure (from the flags, or `QUICK` for the smoke test)."""

  model: str  # empty: a random llama of `preset`
  preset: str
  draft: str
  dtype: str
  layer_loop: str
  batches: tuple[int, ...]
  meshes: tuple[tuple[int, int], ...]
  questions: int
  prompt_len: int
  new_tokens: int
  repeats: int
  bandwidth_gbps: float  # 0: by device kind, else measured
  bandwidth_mib: int
  seed: int


# The smoke test: a prompt of 12 tokens, so that greedy at batch 2 and the questions' batch
# (12 + `QUESTION_LEN` tokens) run one compiled program (prompt bucket 16) on each mesh; the
# layers scanned (one layer traced and compiled per program, not two: scan gives the
# unrolled loop's tokens on a mesh too, tests/test_layer_loop.py and tests/test_sharding.py).
QUICK = dict(model="", preset="tiny", draft="tiny", layer_loop="scan", batches=(1, 2),
             questions=2, prompt_len=12, new_tokens=8, repeats=1, bandwidth_mib=64)


def accelerator() -> bool:
  return jax.default_backend() != "cpu"


def all_meshes(count: int) -> tuple[tuple[int, int], ...]:
  """1x1 (the baseline), then every (data, tensor) with data x tensor = `count`,
  tensor-parallel first."""
  shapes = [(count // t, t) for t in range(count, 0, -1) if count % t == 0]
  return tuple(dict.fromkeys([(1, 1)] + shapes))


def parse_mesh(text: str) -> tuple[int, int]:
  match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
  if not match:
    raise app.UsageError(f"--meshes: {text!r} is not DATAxTENSOR (e.g. 2x4)")
  return int(match[1]), int(match[2])


def datasheet_bandwidth(device_kind: str) -> float | None:
  """GB/s of one device of `device_kind` by `BANDWIDTH_GBPS`; None when unknown."""
  for pattern, gbps in BANDWIDTH_GBPS:
    if re.search(pattern, device_kind, re.IGNORECASE):
      return float(gbps)
  return None


def device_read_bandwidth(mib: int, trials: int = 5) -> float:
  """Best-of-`trials` GB/s of a jitted sum over a bfloat16 array of `mib` MiB on the
  default device (a read-bound reduction)."""
  x = jnp.ones(mib * 2**20 // 2, jnp.bfloat16)
  total = jax.jit(lambda a: a.astype(jnp.float32).sum())
  total(x).block_until_ready()
  times = []
  for _ in range(trials):
    start = time.perf_counter()
    total(x).block_until_ready()
    times.append(time.perf_counter() - start)
  del x
  return mib * 2**20 / min(times) / 1e9


def device_info(settings: Settings) -> dict:
  """The devices and the bandwidth each roofline divides by (see the module docstring)."""
  devices = jax.devices()
  kind = devices[0].device_kind
  info = dict(platform=jax.default_backend(), device_kind=kind, device_count=len(devices),
              bandwidth_scope="per_device" if accelerator() else "shared")
  if accelerator():
    info["probe_read_gbps"] = device_read_bandwidth(settings.bandwidth_mib)
    datasheet = datasheet_bandwidth(kind)
    info["datasheet_gbps"] = datasheet
    measured, source = info["probe_read_gbps"], "device probe (unknown device kind)"
    if datasheet is not None:
      measured, source = datasheet, "datasheet"
  else:
    host = memory_bandwidth(settings.bandwidth_mib)
    info["host"] = host
    measured = max(host["read_gbps"], host["copy_gbps"])
    source = "numpy probes (best of read, copy)"
  if settings.bandwidth_gbps:
    measured, source = settings.bandwidth_gbps, "--bandwidth_gbps"
  info.update(bandwidth_gbps=measured, bandwidth_source=source)
  return info


def load_models(settings: Settings) -> tuple[mdjax.Model, mdjax.Model | None]:
  """The target and the draft (or None), on the default device, layers as a list (the
  layout `mdjax.shard` places before the layer loop restacks them)."""
  if settings.model:
    target = mdjax.load(settings.model, dtype=settings.dtype, seed=settings.seed,
                        layer_loop="unrolled")
  else:
    target = random_llama(PRESETS[settings.preset], settings.seed, settings.dtype,
                          f"random-llama-{settings.preset}")
  draft = None
  if settings.draft in PRESETS:
    config = dataclasses.replace(PRESETS[settings.draft], vocab_size=target.config.vocab_size)
    draft = random_llama(config, settings.seed + 1, settings.dtype,
                         f"random-llama-{settings.draft}-draft")
  elif settings.draft:
    draft = mdjax.load(settings.draft, dtype=settings.dtype, seed=settings.seed + 1,
                       layer_loop="unrolled")
  if draft is not None:
    draft = dataclasses.replace(draft, params=with_layer_loop(draft.params, settings.layer_loop))
  return target, draft


def on_mesh(model: mdjax.Model, shape: tuple[int, int], layer_loop: str) -> mdjax.Model:
  """`model` sharded over the first data x tensor devices, its layers laid out for
  `layer_loop` (as `mdjax.load(..., mesh=)` does)."""
  count = shape[0] * shape[1]
  mesh = jax.make_mesh(shape, ("data", "tensor"), devices=jax.devices()[:count])
  sharded = mdjax.shard(model, mesh)
  return dataclasses.replace(sharded, params=with_layer_loop(sharded.params, layer_loop))


def greedy_cell(model: mdjax.Model, result: dict, batch: int, settings: Settings,
                device: dict, devices: int) -> dict:
  """One greedy batch size's numbers; the roofline by `bandwidth_scope`."""
  n = settings.new_tokens
  cell = summarize(result, result, n, 1)
  del cell["speedup_vs_greedy"], cell["decode_speedup_vs_greedy"], cell["tokens"]
  cell.pop("passes_ratio_vs_greedy", None)
  keys = settings.prompt_len + n / 2  # the mean number of cached tokens a decode step attends to
  per_device = step_bytes(model, batch, keys, per_device=True)
  read = per_device if device["bandwidth_scope"] == "per_device" else per_device * devices
  roofline_ms = read / (device["bandwidth_gbps"] * 1e9) * 1e3
  cell.update(tokens_per_s=batch * n / result["seconds"],
              decode_tokens_per_s=batch / cell["decode_ms_per_token"] * 1e3,
              step_bytes_total=step_bytes(model, batch, keys),
              step_bytes_per_device=per_device, roofline_ms=roofline_ms,
              roofline_fraction=roofline_ms / cell["decode_ms_per_token"])
  return cell


def bench_mesh(model: mdjax.Model, draft: mdjax.Model | None, shape: tuple[int, int],
               settings: Settings, device: dict) -> dict:
  """Every number of one mesh shape."""
  rng = np.random.default_rng(settings.seed)
  vocab, n = model.config.vocab_size, settings.new_tokens
  rows = {b: random_ids(rng, vocab, 1, b, settings.prompt_len)
          for b in (1,) + settings.batches}  # [1, B, L]
  single = rows[1]
  context = single[0, 0].tolist()
  questions = random_ids(rng, vocab, settings.questions, QUESTION_LEN).tolist()
  duplicated = np.asarray([[context + q for q in questions]], np.int32)
  contenders = {f"greedy_{b}": (lambda r=r: run_mdjax(model, r, n, "greedy"))
                for b, r in rows.items()}
  contenders |= {
      "prompt_lookup": lambda: run_mdjax(model, single, n, "prompt_lookup", **LOOKUP),
      "multi_question": lambda: run_mdjax(model, np.asarray([[context]], np.int32), n,
                                          "multi_question", questions=questions),
      "greedy_questions": lambda: run_mdjax(model, duplicated, n, "greedy"),
  }
  if draft is not None:  # placed on the mesh once, not by every generate call
    draft = dataclasses.replace(draft, params=mdjax.sharding.on_layout(draft.params, model.layout))
    contenders["speculative"] = lambda: run_mdjax(model, single, n, "speculative", draft=draft,
                                                  num_draft_tokens=DRAFT_TOKENS)
  results = timed(contenders, settings.repeats, f"mesh {shape[0]}x{shape[1]}")
  devices = shape[0] * shape[1]
  cells = dict(devices=devices,
               greedy={str(b): greedy_cell(model, results[f"greedy_{b}"], b, settings, device,
                                           devices) for b in settings.batches})
  for name, baseline in (("prompt_lookup", "greedy_1"), ("speculative", "greedy_1"),
                         ("multi_question", "greedy_questions")):
    if name in results:
      cells[name] = summarize(results[name], results[baseline], n, 1)
  cells["multi_question"]["questions"] = settings.questions
  cells["greedy_sequences"] = results["greedy_1"]["sequences"]  # compared across meshes
  return cells


def run(settings: Settings) -> dict:
  """The whole benchmark as one JSON-able dict."""
  device = device_info(settings)
  results = dict(machine=machine_info(device.get("host", {})), device=device,
                 settings=dataclasses.asdict(settings), meshes={})
  target, draft = load_models(settings)
  results["model"] = dict(name=target.name, description=target.description,
                          num_params=target.config.num_params,
                          param_bytes=sum(x.nbytes for x in jax.tree.leaves(target.params)),
                          config=dataclasses.asdict(target.config),
                          draft=None if draft is None else draft.name)
  first = None
  for shape in settings.meshes:
    model = on_mesh(target, shape, settings.layer_loop)
    cells = bench_mesh(model, draft, shape, settings, device)
    del model  # its shards, before the next mesh's
    sequences = cells.pop("greedy_sequences")
    first = sequences if first is None else first
    cells["greedy_same_tokens_as_first_mesh"] = sequences == first
    results["meshes"][f"{shape[0]}x{shape[1]}"] = cells
  return results


def table(results: dict) -> str:
  """One line per (mesh, batch): greedy's times and roofline; then the ratios."""
  header = ["mesh", "batch", "ms/tok", "decode ms/tok", "tok/s", "roofline ms", "roof frac"]
  lines = []
  for mesh, cells in results["meshes"].items():
    for batch, c in cells["greedy"].items():
      lines.append([mesh, batch, f"{c['ms_per_token']:.2f}", f"{c['decode_ms_per_token']:.2f}",
                    f"{c['tokens_per_s']:.0f}", f"{c['roofline_ms']:.3f}",
                    f"{c['roofline_fraction']:.0%}"])
  widths = [max(len(r[i]) for r in [header] + lines) for i in range(len(header))]
  out = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in [header] + lines]
  out.append("")
  for mesh, cells in results["meshes"].items():
    parts = []
    for name in ("prompt_lookup", "speculative", "multi_question"):
      if name in cells:
        c = cells[name]
        same = c["tokens"]["matching_tokens"] == c["tokens"]["total_tokens"]
        parts.append(f"{name} {c['speedup_vs_greedy']:.2f}x"
                     f" (greedy's passes / its {c['passes_ratio_vs_greedy']:.2f},"
                     f" {'same tokens' if same else 'TOKENS DIFFER'})")
    out.append(f"mesh {mesh}: " + "; ".join(parts))
  return "\n".join(out)


def plot(results: dict, path: pathlib.Path) -> None:
  """Decode ms per token vs batch per mesh (roofline dashed), the roofline fraction,
  and the speedups over greedy of the other strategies."""
  meshes = results["meshes"]
  fig, (time_ax, roof_ax, ratio_ax) = plt.subplots(1, 3, figsize=(16, 5))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (mesh, cells) in enumerate(meshes.items()):
    color = colors[i % len(colors)]
    batches = [int(b) for b in cells["greedy"]]
    greedy = list(cells["greedy"].values())
    time_ax.plot(batches, [c["decode_ms_per_token"] for c in greedy], "o-", color=color,
                 label=f"mesh {mesh}")
    time_ax.plot(batches, [c["roofline_ms"] for c in greedy], "--", color=color, lw=0.8)
    roof_ax.plot(batches, [c["roofline_fraction"] for c in greedy], "o-", color=color,
                 label=f"mesh {mesh}")
  batches = sorted({int(b) for cells in meshes.values() for b in cells["greedy"]})
  for ax in (time_ax, roof_ax):
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch")
    ax.legend(fontsize=8)
  time_ax.set_yscale("log")
  time_ax.set_ylabel("greedy decode ms per token (per step of the batch)\n"
                     "dashed: bandwidth roofline")
  roof_ax.set_ylabel("roofline time / measured step time")
  roof_ax.axhline(1, color="black", lw=0.8)
  names = [n for n in ("prompt_lookup", "speculative", "multi_question")
           if any(n in cells for cells in meshes.values())]
  width = 0.8 / max(1, len(names))
  x = np.arange(len(meshes))
  for j, name in enumerate(names):
    values = [cells[name]["speedup_vs_greedy"] if name in cells else 0
              for cells in meshes.values()]
    ratio_ax.bar(x + (j - (len(names) - 1) / 2) * width, values, width, label=name)
  ratio_ax.axhline(1, color="black", lw=0.8)
  ratio_ax.set_xticks(x, [f"mesh {m}" for m in meshes])
  ratio_ax.set_ylabel("speedup vs greedy (multi_question: vs the\nprompt duplicated per question)")
  ratio_ax.legend(fontsize=8)
  device, model = results["device"], results["model"]
  save_figure(fig, path, f"{model['name']} ({model['num_params'] / 1e6:.3g}M parameters, "
              f"{results['settings']['dtype']}) on {device['device_count']} x "
              f"{device['device_kind']}, {device['bandwidth_gbps']:.0f} GB/s "
              f"({device['bandwidth_source']}, {device['bandwidth_scope']})\n"
              f"{machine_line(results['machine'])}")


def settings_from_flags() -> Settings:
  if _MESHES.value:
    meshes = tuple(parse_mesh(m) for m in _MESHES.value)
  else:
    meshes = all_meshes(len(jax.devices()))
  for data, tensor in meshes:
    if data * tensor > len(jax.devices()):
      raise app.UsageError(f"mesh {data}x{tensor} needs {data * tensor} devices; there are "
                           f"{len(jax.devices())} (simulate CPU devices with "
                           f"JAX_NUM_CPU_DEVICES=N)")
  settings = Settings(
      model=_MODEL.value, preset=_PRESET.value or ("1b" if accelerator() else "small"),
      draft=_DRAFT.value, dtype=_DTYPE.value or ("bfloat16" if accelerator() else "float32"),
      layer_loop=_LAYER_LOOP.value or default_layer_loop(),
      batches=tuple(int(b) for b in _BATCHES.value), meshes=meshes, questions=_QUESTIONS.value,
      prompt_len=_PROMPT_LEN.value, new_tokens=_NEW_TOKENS.value, repeats=_REPEATS.value,
      bandwidth_gbps=_BANDWIDTH.value, bandwidth_mib=_BANDWIDTH_MIB.value, seed=_SEED.value)
  return dataclasses.replace(settings, **QUICK) if _QUICK.value else settings


def main(argv):
  del argv
  settings = settings_from_flags()
  if settings.new_tokens < 2:
    raise app.UsageError("--new_tokens must be >= 2 (decode time is measured against 1)")
  results = run(settings)
  results["machine"]["load_average_after"] = os.getloadavg()[0]
  write_results(results, _OUT_DIR.value, "bench_device", plot, table)


if __name__ == "__main__":
  app.run(one_line_errors(main))
