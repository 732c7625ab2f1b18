"""What a decode step costs as the context grows, on this CPU: mdjax against transformers
on the same float32 weights, and against the bytes a step must read.

    python3 -m experiments.bench.context                       # SmolLM2, 256 to 6,144
    python3 -m experiments.bench.context --quick --out_dir=/tmp/context   # smoke test

Three measures, each context's contenders interleaved in every repeat (the median):

1. **Decode.** One token's step over a cache holding `context` tokens: mdjax's
   `decode_step` at T=1 in a jitted loop of `LOOP_STEPS` greedy steps, as `generate`
   runs it (each attention of `--attentions`, each layer loop of `--layer_loops`, each
   cache of `--kv_cache_dtypes`, in the layout `generate` gives the loop: per layer when
   unrolled, stacked when scanned, and with `--unrolled_stacked` the unrolled loop over a
   stacked cache too; the cache filled with random K/V, what a step costs does not depend
   on the values), and transformers' forward of one token over its
   `DynamicCache` after a prefill of `context` tokens. ms per step, and each one's
   growth from the first context.
2. **Prefill.** `generate` of one token after a prompt of each context in mdjax (its
   default attention and layer loop) and in transformers: seconds.
3. **The roofline.** Bytes a step must read (every weight, the tied embedding once as the
   head, plus K/V of `context` tokens; `common.step_bytes`) over numpy's measured read
   bandwidth: ms, the floor a memory-bound step approaches.

Writes `bench_context.json` and `bench_context.png` to `--out_dir`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import pathlib
import statistics
import sys
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import mdjax
from experiments.bench.common import (FIRST_PROMPT_ID, interleaved, load_pair, machine_info,
                                      machine_line, memory_bandwidth, plt, random_ids,
                                      results_dir, save_figure, set_torch_threads, step_bytes,
                                      torch_oracle, write_results)
from experiments.cli import check_argv, one_line_errors
from mdjax.cache import KVCache, split_layers
from mdjax.models.layer_loop import with_layer_loop

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Model (anything mdjax.load reads).")
_CONTEXTS = flags.DEFINE_list("contexts", ["256", "1024", "2048", "4096", "6144"],
                              "Cached tokens per step (the first: the growth's base).")
_ATTENTIONS = flags.DEFINE_list("attentions", ["block_sparse", "dense"], "mdjax's attentions.")
_LAYER_LOOPS = flags.DEFINE_list("layer_loops", ["unrolled", "scan"], "mdjax's layer loops.")
_KV_DTYPES = flags.DEFINE_list("kv_cache_dtypes", ["float32", "int8"], "mdjax's caches.")
_UNROLLED_STACKED = flags.DEFINE_bool("unrolled_stacked", True, "Also the unrolled loop over a "
                                      "stacked cache (the layout before the per-layer one).")
_PREFILL_CONTEXTS = flags.DEFINE_list("prefill_contexts", ["256", "6144"],
                                      "Contexts whose prefill is timed.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats (median).")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads (0: default).")
_BANDWIDTH_MIB = flags.DEFINE_integer("bandwidth_mib", 256, "Array size of the bandwidth probe.")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("context"), "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: random-llama-tiny at 32 and 96 tokens, "
                           "one repeat.")


@dataclasses.dataclass(frozen=True)
class Settings:
  model: str
  contexts: tuple[int, ...]
  attentions: tuple[str, ...]
  layer_loops: tuple[str, ...]
  kv_dtypes: tuple[str, ...]
  unrolled_stacked: bool
  prefill_contexts: tuple[int, ...]
  repeats: int
  bandwidth_mib: int


def settings() -> Settings:
  if _QUICK.value:
    return Settings(model="random-llama-tiny", contexts=(32, 96), attentions=("block_sparse",),
                    layer_loops=("unrolled", "scan"), kv_dtypes=("float32", "int8"),
                    unrolled_stacked=True, prefill_contexts=(96,), repeats=1, bandwidth_mib=64)
  return Settings(model=_MODEL.value, contexts=tuple(map(int, _CONTEXTS.value)),
                  attentions=tuple(_ATTENTIONS.value), layer_loops=tuple(_LAYER_LOOPS.value),
                  kv_dtypes=tuple(_KV_DTYPES.value), unrolled_stacked=_UNROLLED_STACKED.value,
                  prefill_contexts=tuple(map(int, _PREFILL_CONTEXTS.value)),
                  repeats=_REPEATS.value, bandwidth_mib=_BANDWIDTH_MIB.value)


def filled_cache(config, context: int, kv_dtype: str, rng: np.random.Generator) -> KVCache:
  """One row's stacked cache of `context` + 128 slots, its first `context` holding random
  K/V (int8: random integers and scales) at positions 0 to context - 1."""
  slots = context + 128
  cache = KVCache.create(config, 1, slots, kv_dtype)
  filled = np.arange(slots) < context
  if kv_dtype == "int8":
    k, v = (jnp.asarray(rng.integers(-127, 128, cache.k.shape), jnp.int8) for _ in range(2))
    scales = {name: jnp.full(getattr(cache, name).shape, 0.02, jnp.float32)
              for name in ("k_scale", "v_scale")}
  else:
    k, v = (jnp.asarray(rng.standard_normal(cache.k.shape), cache.k.dtype) for _ in range(2))
    scales = {}
  return cache.replace(k=k, v=v, **scales,
                       pos=jnp.asarray(np.where(filled, np.arange(slots), 0)[None], jnp.int32),
                       seg=jnp.asarray(np.where(filled, 0, -1)[None], jnp.int32),
                       length=jnp.full((1,), context, jnp.int32))


LOOP_STEPS = 8  # decode steps per timed device loop


def mdjax_steps(model: mdjax.Model, cache: KVCache, context: int, attention: str):
  """A timed call: `LOOP_STEPS` greedy decode steps of one token in one jitted device
  loop, as `generate`'s token loop runs them (a step dispatched alone from the host
  costs more at long contexts: its layers' K/V are sliced out of the cache outside any
  loop), from position `context` over a copy of `cache`; its seconds per step."""
  config = model.config
  topology = mdjax.Topology.causal(1)

  @functools.partial(jax.jit, donate_argnums=1)
  def loop(params, cache):
    def step(i, carry):
      cache, token = carry
      position = jnp.full((1, 1), context, jnp.int32) + i
      logits, _, cache = mdjax.decode_step(params, cache, token, position, jnp.zeros_like(token),
                                           topology, config=config, attention=attention)
      return cache, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    first = jnp.full((1, 1), FIRST_PROMPT_ID, jnp.int32)
    return jax.lax.fori_loop(0, LOOP_STEPS, step, (cache, first))

  def run() -> float:
    fresh = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
    start = time.perf_counter()
    jax.block_until_ready(loop(model.params, fresh))
    return (time.perf_counter() - start) / LOOP_STEPS
  return run


def torch_step(reference, prompt: np.ndarray):
  """A timed call: transformers' forward of one token over the cache of `prompt` (a
  prefill run once, the step's token cropped off again after each step); its seconds."""
  torch = torch_oracle()
  with torch.no_grad():
    cache = reference(torch.from_numpy(prompt[None].astype(np.int64)),
                      use_cache=True).past_key_values
  token = torch.tensor([[FIRST_PROMPT_ID]])

  def run() -> float:
    with torch.no_grad():
      start = time.perf_counter()
      reference(token, past_key_values=cache, use_cache=True)
      seconds = time.perf_counter() - start
    cache.crop(-1)  # the step's token off again
    return seconds
  return run


def prefill_calls(model: mdjax.Model, reference, prompt: np.ndarray) -> dict:
  """Timed calls: one token generated after `prompt`, in each library; their seconds."""
  torch = torch_oracle()
  ids = torch.from_numpy(prompt[None].astype(np.int64))

  def ours() -> float:
    return mdjax.generate(model, [prompt.tolist()], max_new_tokens=1,
                          eos_token_id=[]).stats["wall_s"]

  def theirs() -> float:
    start = time.perf_counter()
    with torch.no_grad():
      reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=1, pad_token_id=0)
    return time.perf_counter() - start
  return {"mdjax": ours, "transformers": theirs}


def medians(calls: dict, repeats: int, label: str) -> dict:
  """Each call once untimed (compiles, warms up), then `repeats` rounds in a rotated
  order: ms, the median of each."""
  _, samples = interleaved(calls, repeats, label)
  return {name: 1e3 * statistics.median(values) for name, values in samples.items()}


def run(s: Settings) -> dict:
  with tempfile.TemporaryDirectory() as scratch:
    model, reference = load_pair(s.model, 0, pathlib.Path(scratch))
  loops = {loop: dataclasses.replace(model, params=with_layer_loop(model.params, loop))
           for loop in s.layer_loops}
  bandwidth = memory_bandwidth(s.bandwidth_mib)
  rng = np.random.default_rng(0)
  points = []
  for context in tqdm.tqdm(s.contexts, desc="contexts"):
    prompt = random_ids(rng, model.config.vocab_size, context)
    calls = {"transformers": torch_step(reference, prompt)}
    for kv_dtype in s.kv_dtypes:
      cache = filled_cache(model.config, context, kv_dtype, rng)
      for loop, attention in itertools.product(s.layer_loops, s.attentions):
        name = f"mdjax {attention} {loop} {kv_dtype}"
        layout = split_layers(cache) if loop == "unrolled" else cache  # as `generate` has it
        calls[name] = mdjax_steps(loops[loop], layout, context, attention)
        if loop == "unrolled" and s.unrolled_stacked:
          calls[name + " stacked"] = mdjax_steps(loops[loop], cache, context, attention)
    step_ms = medians(calls, s.repeats, f"decode at {context}")
    point = dict(context=context, step_ms=step_ms,
                 roofline_ms=step_bytes(model, 1, context) / bandwidth["read_gbps"] / 1e6)
    if context in s.prefill_contexts:
      point["prefill_ms"] = medians(prefill_calls(model, reference, prompt), s.repeats,
                                    f"prefill at {context}")
    points.append(point)
    mdjax.clear_compiled()  # this context's programs: not the next one's
  return dict(model=model.description, machine=machine_info(bandwidth),
              settings=dataclasses.asdict(s), points=points)


def growth(results: dict) -> dict:
  """Each contender's step ms at the last context over the first's."""
  first, last = results["points"][0], results["points"][-1]
  return {name: last["step_ms"][name] / first["step_ms"][name] for name in first["step_ms"]}


def plot(results: dict, path) -> None:
  points = results["points"]
  contexts = [p["context"] for p in points]
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  colors = plt.get_cmap("tab20").colors  # one color per contender (the default cycles at 10)
  for index, name in enumerate(points[0]["step_ms"]):
    style = "-" if name == "transformers" or "float32" in name else "--"
    left.plot(contexts, [p["step_ms"][name] for p in points], style, marker="o", label=name,
              color=colors[index % len(colors)])
  left.plot(contexts, [p["roofline_ms"] for p in points], "k:", label="bytes / bandwidth")
  left.set_xlabel("cached tokens")
  left.set_ylabel("ms per decode step (batch 1)")
  left.legend(fontsize=7)
  prefill = [p for p in points if "prefill_ms" in p]
  for name in ("mdjax", "transformers"):
    right.plot([p["context"] for p in prefill], [p["prefill_ms"][name] / 1e3 for p in prefill],
               marker="o", label=name)
  right.set_xlabel("prompt tokens")
  right.set_ylabel("prefill seconds")
  right.legend(fontsize=8)
  save_figure(fig, path, f"{results['model']}: decode and prefill by context "
                         f"({machine_line(results['machine'])})")


def table(results: dict) -> str:
  points, grown = results["points"], growth(results)
  head = "| contender | " + " | ".join(str(p["context"]) for p in points) + " | growth |"
  lines = [head, "|---" * (len(points) + 2) + "|"]
  for name in points[0]["step_ms"]:
    lines.append(f"| {name} | " + " | ".join(f"{p['step_ms'][name]:.1f}" for p in points)
                 + f" | {grown[name]:.2f}x |")
  lines.append("| bytes / bandwidth | " + " | ".join(f"{p['roofline_ms']:.1f}" for p in points)
               + f" | {points[-1]['roofline_ms'] / points[0]['roofline_ms']:.2f}x |")
  for p in points:
    if "prefill_ms" in p:
      lines.append(f"prefill of {p['context']}: mdjax {p['prefill_ms']['mdjax'] / 1e3:.3f} s, "
                   f"transformers {p['prefill_ms']['transformers'] / 1e3:.3f} s")
  return "\n".join(lines)


@one_line_errors
def main(argv):
  check_argv(argv)
  s = settings()
  set_torch_threads(_TORCH_THREADS.value, _QUICK.value)
  start = time.perf_counter()
  results = run(s)
  results.update(command="python3 -m experiments.bench.context " + " ".join(sys.argv[1:]),
                 date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 seconds=time.perf_counter() - start)
  results["growth"] = growth(results)
  write_results(results, _OUT_DIR.value, "bench_context", plot, table)


if __name__ == "__main__":
  app.run(main)
