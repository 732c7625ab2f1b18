"""Making a heads data directory (`mdjax.train.head_data.dataset`), resumably, inside a budget.

    grow prompts (self_instruct) ─> split by prompt ─> prompts.jsonl      once
    work items (seeded order) ─> capture (batched, one pass) ─> chunks/   until a budget

The prompts are mdjax's built-in set plus `grow_prompts` the model writes; a seeded
`heldout_fraction` of them is held out (`prompts.split_prompts`). Work item i
answers prompt `order[i % P]` (`work_order`), sample `i // P`: every prompt is
answered once before any twice, so a budget that stops early still covers the most
prompts. Rerun on the same directory, it checks the settings against `meta.json` and
answers only the items no chunk holds. The `max_tokens` budget (answer tokens)
stops new items and lets the rows in flight finish; `max_minutes` stops at once, the
rows in flight dropped (a rerun answers them): draining them would take up to
`max_new_tokens` steps at falling occupancy.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import numpy as np
from tqdm import tqdm

from mdjax import files
from mdjax.chat import chat_ids
from mdjax.errors import MdjaxError, check_count
from mdjax.heads.eagle3 import default_target_layers
from mdjax.models.model import Model
from mdjax.prompts import eos_ids
from mdjax.sampling import SamplingParams
from mdjax.train.head_data import prompts as head_prompts
from mdjax.train.head_data import self_instruct
from mdjax.train.head_data.capture import CaptureOptions, CaptureStats, capture
from mdjax.train.head_data.dataset import ChunkWriter, written_items


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """What a data run makes (`SAME_DATA`: fixed once a directory exists) and its budget."""

  out_dir: str
  grow_prompts: int = 4000
  heldout_fraction: float = 0.05
  samples_per_prompt: int = 2
  temperature: float = 0.7  # 0: greedy
  top_k: int = 64
  grow_temperature: float = 1.0
  max_new_tokens: int = 256
  max_prompt_tokens: int = 256
  aux_layers: tuple[int, ...] = ()  # () = EAGLE-3's
  seed: int = 0
  max_tokens: int = 1_000_000
  max_minutes: float = 0.0  # 0: no time budget
  batch: int = 256
  refill_rows: int = 0  # 0: batch // 8
  steps_per_call: int = 8
  chunk_tokens: int = 65536
  progress: bool = True

  SAME_DATA = ("grow_prompts", "heldout_fraction", "samples_per_prompt", "temperature", "top_k",
               "grow_temperature", "max_new_tokens", "max_prompt_tokens", "aux_layers", "seed")

  @property
  def rows_per_refill(self) -> int:
    return self.refill_rows or max(1, self.batch // 8)

  def __post_init__(self):
    for name in ("grow_prompts", "samples_per_prompt", "max_new_tokens", "max_prompt_tokens",
                 "max_tokens", "batch", "steps_per_call", "chunk_tokens"):
      check_count(name, getattr(self, name), 1 if name != "grow_prompts" else 0)


def work_order(prompt_count: int, samples: int, seed: int) -> np.ndarray:
  """int64 [samples * P]: the prompt index each work item answers."""
  return np.tile(np.random.default_rng(seed).permutation(prompt_count), samples)


def make(config: DataConfig, model: Model, given: list[str] | None = None) -> dict:
  """Grows and splits the prompts (first run; `given` prompts, when any, replace the
  built-in and grown ones), answers work items into chunks until the budget; returns
  a summary (this run's tokens, tokens/s, padding waste...)."""
  started = time.perf_counter()
  out = pathlib.Path(config.out_dir)
  aux_layers = config.aux_layers or default_target_layers(model.config.num_layers)
  meta = {"model": model.name or str(model.path), "hidden_size": model.config.hidden_size,
          "num_layers": model.config.num_layers, "dtype": "float16", "chat": True,
          **{name: getattr(config, name) for name in DataConfig.SAME_DATA},
          "aux_layers": list(aux_layers)}
  _check_or_write_meta(out, meta)
  if not (out / "prompts.jsonl").is_file():
    _write_prompts(config, model, out, given)
  prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
  order = work_order(len(prompts), config.samples_per_prompt, config.seed)
  done, answered = written_items(out)
  ids = {}  # prompt index -> chat ids, encoded when first needed

  def prompt_ids(index: int) -> list[int]:
    if index not in ids:
      ids[index] = chat_ids(model, prompts[index]["text"])
    return ids[index]

  items = ((int(i), prompt_ids(int(order[i]))) for i in range(len(order)) if i not in done)
  stats = CaptureStats()
  bar = tqdm(total=config.max_tokens, initial=min(answered, config.max_tokens), unit="tok",
             disable=not config.progress, desc="answer tokens", dynamic_ncols=True)
  options = CaptureOptions(config=model.config, aux_layers=aux_layers, eos=eos_ids(model, None),
                           sampling=SamplingParams(temperature=config.temperature,
                                                   top_k=0 if config.temperature == 0
                                                   else config.top_k),
                           max_new_tokens=config.max_new_tokens,
                           steps_per_call=config.steps_per_call)
  writer = ChunkWriter(out, lambda item: prompts[order[item]]["id"], config.chunk_tokens)

  def out_of_time() -> bool:
    return bool(config.max_minutes) and time.perf_counter() - started > 60 * config.max_minutes

  def keep_going() -> bool:
    return answered + stats.answer_tokens < config.max_tokens and not out_of_time()

  for row in capture(model, items, options, batch=config.batch,
                     refill_rows=config.rows_per_refill,
                     max_prompt_tokens=config.max_prompt_tokens, seed=config.seed,
                     keep_going=keep_going, stats=stats):
    writer.add(row)
    bar.update(row.answer_length)
    bar.set_postfix(tok_s=f"{(stats.prompt_tokens + stats.answer_tokens) / stats.seconds:.0f}")
    if out_of_time():  # draining the rows in flight would run at falling occupancy
      break
  writer.flush()
  bar.close()
  done, answered = written_items(out)
  return {"out_dir": str(out), "prompts": len(prompts), "rows": len(done),
          "answer_tokens_total": answered, "chunks": writer.next_index,
          "minutes": (time.perf_counter() - started) / 60, "batch": config.batch,
          **{f"run_{k}": v for k, v in stats.summary().items()}}


def _check_or_write_meta(out: pathlib.Path, meta: dict) -> None:
  """Writes `meta.json` into a new directory; in an existing one, every setting that
  shapes the data must match."""
  path = out / "meta.json"
  if path.is_file():
    old = json.loads(path.read_text())
    for name, value in meta.items():
      if old.get(name) != value:
        raise MdjaxError(f"the data directory {str(out)!r} was made with {name}={old.get(name)!r}, "
                         f"not {value!r}: use a new out_dir, or the same settings")
    return
  out.mkdir(parents=True, exist_ok=True)
  files.write_text(path, json.dumps(meta, indent=1) + "\n")


def _write_prompts(config: DataConfig, model: Model, out: pathlib.Path,
                   given: list[str] | None) -> None:
  """prompts.jsonl: the `given` prompts, or the built-in and the grown ones, each with
  its split; grown.json: what growing dropped."""
  if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
    raise MdjaxError(f"making heads data needs a model with a tokenizer and a chat template; "
                     f"{model.name!r} has none")
  if given is not None and not all(isinstance(p, str) for p in given):
    bad = next(p for p in given if not isinstance(p, str))
    raise MdjaxError(f"heads data prompts must be texts, got {bad!r}")
  builtin = head_prompts.builtin_prompts() if given is None else []
  grown = self_instruct.grow(
      model, config.grow_prompts, seed=config.seed, batch=config.batch,
      refill_rows=config.rows_per_refill, temperature=config.grow_temperature,
      top_k=config.top_k, known=builtin,
      progress=config.progress) if config.grow_prompts and given is None else None
  prompts = [{"kind": "builtin" if given is None else "given", "text": p}
             for p in (given or builtin)] + (grown.prompts if grown else [])
  prompts = [p for p in prompts if len(chat_ids(model, p["text"])) <= config.max_prompt_tokens]
  train, _ = head_prompts.split_prompts(list(range(len(prompts))), config.heldout_fraction,
                                        config.seed)
  train = set(train)
  lines = [json.dumps({"id": i, "kind": p["kind"], "split": "train" if i in train else "heldout",
                       "text": p["text"]}) for i, p in enumerate(prompts)]
  files.write_text(out / "grown.json", json.dumps(
      {"asked": grown.asked if grown else 0, "kept": len(grown.prompts) if grown else 0,
       "dropped": dict(grown.dropped) if grown else {}}, indent=1) + "\n")
  files.write_text(out / "prompts.jsonl", "\n".join(lines) + "\n")  # last: marks the stage done
