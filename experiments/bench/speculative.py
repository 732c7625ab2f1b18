"""Speculative decoding and prompt lookup: speed, target passes and acceptance vs theory.

On the shipped pair (code-tiny target, code-tiny-draft) and `--prompts` prompts cut
from the target's held-out files (never trained on), run in groups of the batch size
(so batch-1 numbers are totals or means over several prompts, not one prompt's luck),
each row generating `--new_tokens` tokens with no early stop:

* mdjax greedy, speculative with a constant chain of gamma = 1..8 tokens, the
  heuristic schedule, a draft tree (depth 4, top-4, 16 nodes), self-speculation
  (2 of 6 layers), lookahead (W 7, N 5, G 7) and prompt lookup, at every batch size: ms per token (per step
  of the batch, prefill included), the time to the first token and the decode time
  per token after it (what vLLM's benchmark calls TTFT and TPOT: the same generation
  cut at one token, paired within a repetition), target passes, tokens per target
  pass, and that the tokens equal greedy's;
* for each gamma: the measured acceptance alpha (the rate of the first drafted token,
  which is always verified) and the tokens per verify pass Leviathan et al.'s i.i.d.
  model predicts from it, (1 - alpha^(gamma+1)) / (1 - alpha), beside the measured
  value (plotted together);
* a copy-heavy task (a held-out code chunk, then the instruction to repeat it and its
  first tokens): greedy vs prompt lookup vs speculative, and how much of the chunk
  greedy actually copies (`copies_the_chunk`: a model that does not copy gains there
  only from loops in its own output);
* at batch 1 (transformers' assisted generation takes one row), transformers on the
  same float32 weights: greedy, assisted generation with the draft (the same gamma
  as mdjax's best, constant schedule) and prompt lookup.

Contenders are interleaved over `--repeats` repetitions and timed by median, so
ratios within one run are meaningful on a noisy machine. Writes
`bench_speculative.json` and `bench_speculative.png` to `--out_dir`:

    python -m experiments.bench.speculative [--batches=1,8] [--gammas=1,2,3,4,5,6,7,8] [--quick]
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

from absl import app, flags
import numpy as np
import transformers

import mdjax
from experiments.cli import one_line_errors
from experiments.bench.common import (DRAFT_TOKENS, LOOKUP, PROBE_MIB, agreement,
                                      load_pair, machine_info, machine_line, memory_bandwidth, plt,
                                      results_dir, run_mdjax, save_figure, set_torch_threads,
                                      summarize, timed, torch_oracle, write_results)
from mdjax.models.layer_loop import default_layer_loop, with_layer_loop
from mdjax.train import data


_TARGET = flags.DEFINE_string("target", "code-tiny", "Target model (name or directory).")
_DRAFT = flags.DEFINE_string("draft", "code-tiny-draft", "Draft model (same tokenizer).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
_GAMMAS = flags.DEFINE_list("gammas", [str(g) for g in range(1, 9)], "Draft chain lengths.")
_PROMPTS = flags.DEFINE_integer(
    "prompts", 4, "Held-out prompts per contender, run in groups of the batch size (at least "
    "one group): at batch 1 the numbers are sums or means over this many prompts.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 256, "Prompt tokens per row.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "Generated tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions of every contender (median).")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads (0: default; "
                                      "--quick: 1).")
_OUT_DIR = flags.DEFINE_string("out_dir", results_dir("speculative"), "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: 1 row, gamma 2, 4 tokens, 1 repeat, "
                           "smaller trees and windows, the layers scanned.")

COPY_INSTRUCTION = "\n# The code above, repeated exactly:\n"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  batches: tuple[int, ...]
  gammas: tuple[int, ...]
  prompts: int
  prompt_len: int
  new_tokens: int
  repeats: int
  options: dict  # the contenders' options but greedy's and the chains' (`OPTIONS`)
  layer_loop: str  # both models' (`mdjax.models.layer_loop`)
  bandwidth_mib: int = PROBE_MIB  # the array of the bandwidth probe (`common.memory_bandwidth`)


# The options of the contenders but greedy and the chains of gamma tokens; the smoke
# test's are smaller (the same strategies, each compiled in a second or two less), and
# its models' layers scanned (one layer compiled, not six: about half the compile time;
# scan gives the unrolled loop's tokens, tests/test_layer_loop.py).
OPTIONS = dict(prompt_lookup=LOOKUP,
               heuristic=dict(draft_schedule="heuristic", num_draft_tokens=DRAFT_TOKENS,
                              max_draft_tokens=8),
               tree=dict(tree_depth=4, tree_top_k=4, tree_budget=16),
               lookahead=dict(window=7, ngram=5, guess_set=7))
QUICK_OPTIONS = dict(prompt_lookup=dict(LOOKUP, prompt_lookup_num_tokens=4),
                     heuristic=dict(draft_schedule="heuristic", num_draft_tokens=2,
                                    max_draft_tokens=4),
                     tree=dict(tree_depth=2, tree_top_k=2, tree_budget=4),
                     lookahead=dict(window=3, ngram=3, guess_set=3))
QUICK = dict(batches=(1,), gammas=(2,), prompts=1, prompt_len=64, new_tokens=4, repeats=1,
             options=QUICK_OPTIONS, layer_loop="scan", bandwidth_mib=64)


def heldout_prompts(model: mdjax.Model, count: int, length: int) -> np.ndarray:
  """`[count, length]` windows of the held-out token stream, evenly spaced."""
  eos = model.tokenizer.convert_tokens_to_ids(model.tokenizer.eos_token)
  stream = data.token_stream(data.recorded_heldout_texts(model.path), model.tokenizer.backend_tokenizer, eos)
  starts = np.linspace(0, len(stream) - length - 1, count).astype(int)
  return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def copy_prompts(model: mdjax.Model, count: int, length: int) -> tuple[np.ndarray, np.ndarray]:
  """`[count, length]`: a held-out chunk, the repeat instruction, the chunk's first
  8 tokens; and `[count, chunk - 8]`, the rest of the chunk: the continuation that copies."""
  instruction = model.tokenizer.encode(COPY_INSTRUCTION)
  chunk = length - len(instruction) - 8
  chunks = heldout_prompts(model, count, chunk)
  prompts = np.stack([np.concatenate([c, instruction, c[:8]]) for c in chunks])
  return prompts.astype(np.int32), chunks[:, 8:]


def run_transformers(reference, groups: np.ndarray, new_tokens: int, **options) -> dict:
  """One transformers greedy `generate` per row of `groups` [G, 1, L] (assisted
  generation takes one row), then the same cut at one token: seconds of each."""
  torch = torch_oracle()

  def generate(ids, tokens):
    start = time.perf_counter()
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0,
                             **options)
    return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()
  rows = [torch.from_numpy(row[None].astype(np.int64))
          for row in groups.reshape(-1, groups.shape[-1])]
  runs = [generate(ids, new_tokens) for ids in rows]
  return dict(seconds=sum(seconds for seconds, _ in runs),
              first_token_seconds=sum(generate(ids, 1)[0] for ids in rows),
              sequences=[tokens for _, tokens in runs])


def predicted_tokens_per_pass(alpha: float, gamma: int) -> float:
  """Leviathan et al.: expected tokens per verify pass for i.i.d. acceptance alpha."""
  return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speculative_cell(result: dict, gamma: int) -> dict:
  """alpha, and tokens per verify pass measured vs predicted from alpha."""
  stats = result["stats"]
  alpha = stats["acceptance_rate_at"][0]
  return dict(alpha=alpha, measured_tokens_per_verify=1 + stats["mean_accepted_length"],
              predicted_tokens_per_verify=predicted_tokens_per_pass(alpha, gamma))


def bench_batch(target, draft, reference, batch: int, settings: Settings) -> dict:
  n = settings.new_tokens
  groups = -(-settings.prompts // batch)  # batch-1 numbers average several prompts
  prompts = heldout_prompts(target, groups * batch, settings.prompt_len).reshape(groups, batch, -1)
  copies, copy_of_chunk = copy_prompts(target, groups * batch, settings.prompt_len)
  copies = copies.reshape(groups, batch, -1)
  options = settings.options
  contenders = {"greedy": lambda: run_mdjax(target, prompts, n, "greedy"),
                "prompt_lookup": lambda: run_mdjax(target, prompts, n, "prompt_lookup",
                                                   **options["prompt_lookup"]),
                "heuristic": lambda: run_mdjax(target, prompts, n, "speculative", draft=draft,
                                               **options["heuristic"]),
                "tree": lambda: run_mdjax(target, prompts, n, "speculative_tree", draft=draft,
                                          **options["tree"]),
                "self_speculative": lambda: run_mdjax(target, prompts, n, "self_speculative",
                                                      draft_layers=2, num_draft_tokens=3),
                "lookahead": lambda: run_mdjax(target, prompts, n, "lookahead",
                                               **options["lookahead"]),
                "copy_greedy": lambda: run_mdjax(target, copies, n, "greedy"),
                "copy_prompt_lookup": lambda: run_mdjax(target, copies, n, "prompt_lookup",
                                                        **options["prompt_lookup"])}
  for gamma in settings.gammas:
    contenders[f"gamma_{gamma}"] = (lambda g=gamma: run_mdjax(
        target, prompts, n, "speculative", draft=draft, num_draft_tokens=g))
  contenders[f"copy_gamma_{max(settings.gammas)}"] = lambda: run_mdjax(
      target, copies, n, "speculative", draft=draft, num_draft_tokens=max(settings.gammas))
  if batch == 1:
    contenders["hf_greedy"] = lambda: run_transformers(reference, prompts, n)
    contenders["hf_copy_greedy"] = lambda: run_transformers(reference, copies, n)
    lookup = options["prompt_lookup"]
    contenders["hf_copy_prompt_lookup"] = lambda: run_transformers(
        reference, copies, n, prompt_lookup_num_tokens=lookup["prompt_lookup_num_tokens"],
        max_matching_ngram_size=lookup["max_ngram_size"])
  results = timed(contenders, settings.repeats, f"batch {batch}")
  if batch == 1:  # assisted generation at mdjax's best gamma, timed in a second round
    best = max(settings.gammas, key=lambda g: -results[f"gamma_{g}"]["seconds"])
    draft_torch = transformers.AutoModelForCausalLM.from_pretrained(
        str(draft.path), dtype=torch_oracle().float32).eval()
    draft_torch.generation_config.num_assistant_tokens = best
    draft_torch.generation_config.num_assistant_tokens_schedule = "constant"
    draft_torch.generation_config.assistant_confidence_threshold = 0.0
    second = timed({"hf_assisted": lambda: run_transformers(reference, prompts, n,
                                                            assistant_model=draft_torch),
                    "hf_greedy": lambda: run_transformers(reference, prompts, n),
                    f"gamma_{best}": contenders[f"gamma_{best}"]}, settings.repeats, "assisted")
    results["hf_assisted"] = second["hf_assisted"]
    results["hf_assisted"]["gamma"] = best
    ratio = second["hf_greedy"]["seconds"] / second["hf_assisted"]["seconds"]
    results["hf_assisted"]["speedup_vs_hf_greedy"] = ratio
    results["hf_assisted"]["mdjax_speedup_vs_hf_assisted"] = (
        second["hf_assisted"]["seconds"] / second[f"gamma_{best}"]["seconds"])
  cells = {}
  for name, result in results.items():
    base = results["copy_greedy" if "copy" in name else "greedy"]
    if name.startswith("hf_"):
      base = results["hf_copy_greedy" if "copy" in name else "hf_greedy"]
    cells[name] = summarize(result, base, n * groups, groups)
    for key in ("gamma", "speedup_vs_hf_greedy", "mdjax_speedup_vs_hf_assisted"):
      if key in result:
        cells[name][key] = result[key]
  for gamma in settings.gammas:
    cells[f"gamma_{gamma}"].update(speculative_cell(results[f"gamma_{gamma}"], gamma))
  compared = min(n, copy_of_chunk.shape[1])  # does greedy copy, or do drafts predict a loop?
  cells["copy_greedy"]["copies_the_chunk"] = agreement(
      [row[:compared] for row in results["copy_greedy"]["sequences"]], copy_of_chunk[:, :compared])
  if batch == 1:
    cells["hf_greedy"]["tokens_vs_mdjax"] = agreement(
        results["hf_greedy"]["sequences"], np.asarray(results["greedy"]["sequences"]))
  return cells


def run(settings: Settings) -> dict:
  target, reference = load_pair(_TARGET.value, 0, pathlib.Path("."))
  target = dataclasses.replace(target, params=with_layer_loop(target.params, settings.layer_loop))
  draft = mdjax.load(_DRAFT.value, layer_loop=settings.layer_loop)
  bandwidth = memory_bandwidth(settings.bandwidth_mib)
  results = dict(machine=machine_info(bandwidth), settings=dataclasses.asdict(settings),
                 target=target.description, draft=draft.description, batches={})
  for batch in settings.batches:
    results["batches"][str(batch)] = bench_batch(target, draft, reference, batch, settings)
  return results


def table(results: dict) -> str:
  lines = ["batch  contender               ms/tok  vs greedy  TTFT ms  decode ms/tok  vs greedy  "
           "passes  passes x  same tokens"]
  for batch, cells in results["batches"].items():
    for name, c in cells.items():
      if "ms_per_token" not in c:
        continue
      passes = c.get("target_passes", "")
      ratio = f"{c['passes_ratio_vs_greedy']:.2f}x" if "passes_ratio_vs_greedy" in c else ""
      same = f"{c['tokens']['matching_tokens']}/{c['tokens']['total_tokens']}"
      lines.append(f"{batch:>5}  {name:<22} {c['ms_per_token']:7.2f}  "
                   f"{c['speedup_vs_greedy']:8.2f}x  {c['first_token_ms']:7.1f}  "
                   f"{c['decode_ms_per_token']:13.2f}  {c['decode_speedup_vs_greedy']:8.2f}x  "
                   f"{passes!s:>6}  {ratio:>8}  {same}")
    copied = cells["copy_greedy"]["copies_the_chunk"]
    lines.append(f"{batch:>5}  copy prompts: greedy repeats {copied['matching_tokens']} of "
                 f"{copied['total_tokens']} chunk tokens in place")
  return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
  """Left: tokens per verify pass vs gamma, measured and predicted from alpha. Right:
  speedup per token vs mdjax greedy for every contender and batch size."""
  fig, (theory, speed) = plt.subplots(1, 2, figsize=(13, 5))
  gammas = results["settings"]["gammas"]
  for batch, cells in results["batches"].items():
    measured = [cells[f"gamma_{g}"]["measured_tokens_per_verify"] for g in gammas]
    predicted = [cells[f"gamma_{g}"]["predicted_tokens_per_verify"] for g in gammas]
    line, = theory.plot(gammas, measured, "o-", label=f"measured, batch {batch}")
    theory.plot(gammas, predicted, "x--", color=line.get_color(),
                label=f"(1-a^(g+1))/(1-a), batch {batch}")
  theory.set_xlabel("gamma (drafted tokens per step)")
  theory.set_ylabel("tokens per target verify pass")
  theory.set_title("speculative: measured vs predicted from the acceptance a", fontsize=10)
  theory.legend(fontsize=8)
  names = [n for n in next(iter(results["batches"].values())) if n not in ("greedy", "hf_greedy")]
  width = 0.8 / len(results["batches"])
  for i, (batch, cells) in enumerate(results["batches"].items()):
    x = np.arange(len(names)) + i * width
    speed.bar(x, [cells.get(n, {}).get("speedup_vs_greedy", 0.0) for n in names], width,
              label=f"batch {batch}, whole generation")
    speed.plot(x, [cells.get(n, {}).get("decode_speedup_vs_greedy", np.nan) for n in names],
               "k.", ms=5, label="after the first token" if i == 0 else None)
  speed.axhline(1.0, color="black", lw=0.8)
  speed.set_xticks(np.arange(len(names)) + width * (len(results["batches"]) - 1) / 2, names,
                   rotation=60, ha="right", fontsize=8)
  speed.set_ylabel("speedup per token vs greedy (same library)")
  speed.set_ylim(top=speed.get_ylim()[1] * 1.15)  # room above the bars for the legend
  speed.legend(fontsize=8, loc="upper center", ncol=3)
  machine = results["machine"]
  save_figure(fig, path, f"{results['target']} with draft {results['draft']}\n"
                         f"{machine_line(machine)}")


def main(argv):
  del argv
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  settings = Settings(batches=tuple(int(b) for b in _BATCHES.value),
                      gammas=tuple(int(g) for g in _GAMMAS.value), prompts=_PROMPTS.value,
                      prompt_len=_PROMPT_LEN.value,
                      new_tokens=_NEW_TOKENS.value, repeats=_REPEATS.value, options=OPTIONS,
                      layer_loop=default_layer_loop())
  if _QUICK.value:
    settings = dataclasses.replace(settings, **QUICK)
  if settings.new_tokens < 2:
    raise app.UsageError(f"--new_tokens must be >= 2 (decode time is measured after the first "
                         f"token), got {settings.new_tokens}")
  set_torch_threads(_TORCH_THREADS.value, _QUICK.value)  # before any work
  results = run(settings)
  write_results(results, _OUT_DIR.value, "bench_speculative", plot, table)


if __name__ == "__main__":
  app.run(one_line_errors(main))
