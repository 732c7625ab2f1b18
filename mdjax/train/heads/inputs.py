"""A heads run's data: the target's own text and what the heads read of it, cached.

    run_dir/cache/<key>/       keyed by the target (name and a digest of its params) and
      key.json                 everything that shapes the data; a rerun finds it and
      sequences.json           neither generates nor runs the target again
      features/{train,heldout}/   `features.Features`
      features_teacher/...     the same with the final-norm states apart (`teacher`)

Three sources (`config.data`): prompts (a file, or the built-in set of `mdjax.train.head_data.prompts`) the
target answers (`mdjax.generate`, through its chat template), whose hidden states one
pass per batch then computes; a plain text cut into rows; or a data set
`experiments/make_head_data.py` wrote (`head_data`), whose rows bring their states and
greedy guesses along. Either way one writer (`features.FeatureWriter`) writes the
cache. The draft vocabulary (`draft_vocabulary`) is counted on the training answers.

Many processes: every process generates and runs the target's passes (they are
collective), only process 0 writes the cache, and the others open it after a barrier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import pathlib

import jax
import numpy as np
from tqdm import tqdm

from mdjax import distributed, files, sharding
from mdjax.chat import chat_ids
from mdjax.errors import MdjaxError
from mdjax.files import atomic_directory
from mdjax.generate import generate
from mdjax.heads import vocab
from mdjax.models.model import Model
from mdjax.prompts import encode_prompts
from mdjax.train.head_data import prompts as head_prompts
from mdjax.train.config import HeadsDataConfig
from mdjax.train.head_data.dataset import HeadData
from mdjax.train.heads.features import Features, write_stored_features, write_target_features

CACHE_FORMAT = 1  # part of every cache key: bump when the cache's layout changes


@dataclasses.dataclass(frozen=True)
class RunData:
  """The cached splits and what the model card says about them."""

  train: Features
  heldout: Features
  heldout_prompts: list  # texts or token-id lists (text_file: the held-out rows' texts)
  description: dict  # where the data came from: "source"; "prompts" (how many), "chat"
  cache_dir: pathlib.Path


def prepare_data(data: HeadsDataConfig, target: Model, run_dir: pathlib.Path, *, seed: int,
                 heldout_fraction: float, target_name: str, layers: tuple[int, ...] = (),
                 teacher: bool = False, progress: bool = True) -> RunData:
  """The run's data from its cache, generating and computing what the cache lacks;
  the features are the target's `layers` concatenated ((): its final-norm states), with
  its final-norm states apart too where `teacher` (heads that read other layers and
  learn the target's law). `seed`, `heldout_fraction`: the split and the generation's;
  `target_name`: the config's name of the target (a data set names the model that
  wrote it)."""
  if data.data_dir:
    return data_set_features(data, target_name, target, run_dir, layers, teacher)
  source, rows = _source(data, target, seed, heldout_fraction)
  key = _cache_key(data, seed, target, rows, layers)
  cache_dir = run_dir / "cache" / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
  sequences = _load_or_generate(data, seed, target, source, rows, cache_dir, key, progress)
  features = cache_dir / ("features_teacher" if teacher else "features")
  if not features.is_dir():  # the same answer on every process: none writes before all ask
    main = distributed.is_main_process()
    with atomic_directory(features) if main else contextlib.nullcontext() as staging:
      for name in ("train", "heldout"):
        write_target_features(target, sequences[name], staging and staging / name,
                              data.feature_dtype, data.feature_batch, progress, layers,
                              teacher)
  distributed.barrier("features")
  return RunData(train=Features.open(features / "train"),
                 heldout=Features.open(features / "heldout"),
                 heldout_prompts=sequences["heldout_prompts"],
                 description=source, cache_dir=cache_dir)


def data_set_features(data: HeadsDataConfig, model: str, target: Model, run_dir: pathlib.Path,
                      layers: tuple[int, ...], teacher: bool = False) -> RunData:
  """The run's data from `data.data_dir` (`mdjax.train.head_data.dataset`): its rows as the
  cache's `Features` (written once, by process 0), the features the stored states of
  `layers` (or the final-norm ones), with the stored greedy guesses (and final-norm
  states apart, where `teacher`). `model`: the config's name of the target."""
  data_set = HeadData(data.data_dir)
  if data_set.meta.get("model") not in (target.name, model):
    raise MdjaxError(f"the data set {data.data_dir!r} was written by the model "
                     f"{data_set.meta.get('model')!r}, not by {target.name or model!r}")
  stored = list(data_set.meta.get("aux_layers", ()))
  missing = [layer for layer in layers if layer not in stored]
  if missing:
    raise MdjaxError(f"the heads read target layers {list(layers)}; the data set "
                     f"{data.data_dir!r} stores the states of layers {stored} only")
  key = {"format": CACHE_FORMAT, "data_dir": str(pathlib.Path(data.data_dir).resolve()),
         "chunks": [c.name for c in data_set.chunks], "layers": list(layers),
         "feature_dtype": data.feature_dtype}
  if teacher:
    key["teacher"] = True
  cache_dir = run_dir / "cache" / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
  features = cache_dir / "features"
  if not features.is_dir() and distributed.is_main_process():
    with atomic_directory(features) as staging:
      for name in ("train", "heldout"):
        write_stored_features(list(data_set.rows(name)), staging / name, data.feature_dtype,
                              target.config.hidden_size, [stored.index(l) for l in layers],
                              teacher)
    files.write_text(cache_dir / "key.json", json.dumps({"key": key}, indent=1) + "\n")
  distributed.barrier("features")
  heldout = [p["text"] for p in data_set.prompts if p["split"] == "heldout"]
  kinds = sorted({p.get("kind", "") for p in data_set.prompts} - {""})
  source = {"source": f"the data set {data.data_dir} ({len(kinds)} kinds of task: "
                      f"{', '.join(kinds)})", "prompts": len(data_set.prompts), "chat": "yes"}
  return RunData(train=Features.open(features / "train"), heldout=Features.open(
      features / "heldout"), heldout_prompts=heldout, description=source, cache_dir=cache_dir)


def _source(data: HeadsDataConfig, target: Model, seed: int,
            heldout_fraction: float) -> tuple[dict, dict]:
  """What the data is made from: (its description, {"train", "heldout"} prompts or text
  rows). A prompt is a text or token ids; a text row is token ids."""
  if data.text_file:
    if target.tokenizer is None:
      raise MdjaxError(f"text_file needs a model with a tokenizer; {target.name!r} has none")
    ids = target.tokenizer.encode(head_prompts.read_text(data.text_file))
    size = data.text_row_tokens
    chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
    train, heldout = head_prompts.split_prompts(chunks, heldout_fraction, seed)
    return {"source": f"the text file {data.text_file}"}, {"train": train, "heldout": heldout}
  if data.prompts:
    prompts = head_prompts.read_prompts(data.prompts)
    source = f"the prompts file {data.prompts}"
  else:
    prompts, source = head_prompts.builtin_prompts(), "mdjax's built-in prompt set"
  if target.tokenizer is None and any(isinstance(p, str) for p in prompts):
    raise MdjaxError(f"the model {target.name!r} has no tokenizer, so the prompts must be token "
                     "ids: pass a .jsonl prompts file with one list of ids per line")
  train, heldout = head_prompts.split_prompts(prompts, heldout_fraction, seed)
  chat = "yes" if uses_chat_template(target, data.chat) else "no"
  return ({"source": source, "prompts": len(prompts), "chat": chat},
          {"train": train, "heldout": heldout})


def model_digest(model: Model) -> str:
  """sha256 of the model's config and every weight's bytes: the cache's notion of "the
  same model" (a name alone does not pin a random model's seed or a file's contents).
  A model on a mesh is digested in the one-device layout: the same model, the same cache."""
  digest = hashlib.sha256(repr(model.config).encode())
  params = model.params
  if model.layout is not None:  # on the host: fusing sharded parts would gather on devices
    params = sharding.one_device_layout(distributed.to_host(params), model.config)
  for leaf in jax.tree.leaves(params):
    digest.update(np.asarray(leaf).tobytes())
  return digest.hexdigest()


def _cache_key(data: HeadsDataConfig, seed: int, target: Model, rows: dict,
               layers: tuple[int, ...]) -> dict:
  """Everything the cached data depends on (the cache directory is named by its hash)."""
  key = {"format": CACHE_FORMAT, "model": target.name or str(target.path), "params":
         model_digest(target), "data": hashlib.sha256(json.dumps(rows).encode()).hexdigest(),
         "feature_dtype": data.feature_dtype}
  if layers:
    key["layers"] = list(layers)
  if not data.text_file:
    key.update(chat=data.chat, samples_per_prompt=data.samples_per_prompt,
               temperature=data.temperature, max_new_tokens=data.max_new_tokens, seed=seed)
  return key


def _load_or_generate(data: HeadsDataConfig, seed: int, target: Model, source: dict,
                      rows: dict, cache_dir: pathlib.Path, key: dict, progress: bool) -> dict:
  """{"train", "heldout"}: [prompt ids, answer ids] per row, and "heldout_prompts";
  generated (prompts) or cut (text) once, then read from `sequences.json`."""
  path = cache_dir / "sequences.json"
  if path.is_file():
    return json.loads(path.read_text())
  if data.text_file:
    sequences = {split: [[[], chunk] for chunk in rows[split]] for split in rows}
    heldout_prompts = [target.tokenizer.decode(chunk) for chunk in rows["heldout"]]
  else:
    answered = _generate_rows(data, seed, target, rows["train"] + rows["heldout"], progress)
    cut = len(rows["train"]) * data.samples_per_prompt
    sequences = {"train": answered[:cut], "heldout": answered[cut:]}
    heldout_prompts = rows["heldout"]
  if distributed.is_main_process():
    cache_dir.mkdir(parents=True, exist_ok=True)
    files.write_text(cache_dir / "key.json",
                     json.dumps({"key": key, "data": source}, indent=1) + "\n")
    files.write_text(path, json.dumps({**sequences, "heldout_prompts": heldout_prompts}))
  return {**sequences, "heldout_prompts": heldout_prompts}


def uses_chat_template(model: Model, chat: bool) -> bool:
  """Do text prompts go through the model's chat template? With `chat`, when it has one."""
  return bool(chat and getattr(model.tokenizer, "chat_template", None))


def prompt_ids(model: Model, prompts: list, chat: bool) -> list[list[int]]:
  """Token ids of each prompt: a text through the model's chat template
  (`uses_chat_template`), else its tokenizer; token ids as given (checked)."""
  templated = uses_chat_template(model, chat)
  return [chat_ids(model, p) if templated and isinstance(p, str) else encode_prompts(model, [p])[0]
          for p in prompts]


def _generate_rows(data: HeadsDataConfig, seed: int, target: Model, prompts: list,
                   progress: bool) -> list[list[list[int]]]:
  """[prompt ids, answer ids] for each of `samples_per_prompt` answers to each prompt
  (prompt-major), `generation_batch` prompts per `mdjax.generate` call."""
  ids = [p for p in prompt_ids(target, prompts, data.chat) for _ in range(data.samples_per_prompt)]
  size = data.generation_batch
  strategy, options = (("sample", {"temperature": data.temperature}) if data.temperature > 0
                       else ("greedy", {}))
  answers = []
  for index, start in enumerate(tqdm(range(0, len(ids), size), disable=not progress,
                                     desc="generating", dynamic_ncols=True)):
    chunk = ids[start:start + size]
    padded = chunk + [chunk[0]] * (size - len(chunk))  # every call the same batch shape
    out = generate(target, padded, strategy=strategy, max_new_tokens=data.max_new_tokens,
                   seed=seed + index, **options)
    answers += out.sequences[:len(chunk)]
  return [[prompt, answer] for prompt, answer in zip(ids, answers)]


def draft_vocabulary(size: int, data: RunData, vocab_size: int) -> np.ndarray:
  """The heads' draft vocabulary: the `size` most frequent tokens of the training
  answers (0: every id), ascending (`mdjax.heads.vocab.choose`)."""
  train = data.train
  answers = np.arange(train.tokens.shape[1]) >= train.prompt_lengths[:, None]  # [N, T]
  inside = answers & (np.arange(train.tokens.shape[1]) < train.lengths[:, None])
  counts = np.bincount(train.tokens[inside], minlength=vocab_size)
  return vocab.choose(counts, size)


def heldout_coverage(data: RunData, draft_ids: np.ndarray) -> float:
  """The fraction of the held-out answers' greedy guesses inside the draft vocabulary."""
  held = data.heldout
  column = np.arange(held.tokens.shape[1])
  answers = (column + 1 >= held.prompt_lengths[:, None]) & (column + 1 < held.lengths[:, None])
  return vocab.coverage(draft_ids, held.greedy[answers])
