"""Training multi-token-prediction heads over a frozen model by self-distillation.

The model writes its own training text (`mdjax.generate` on a prompt set, through its
chat template), its final-norm hidden states over prompt + answer are computed once
and cached on disk, and the heads learn to guess, from those states alone, what the
model would write further ahead. The model's params are a frozen argument of the
training step: only the heads' params are differentiated.

One run lives in `run_dir`::

    run_dir/
      config.json
      cache/<key>/             the data, keyed by the model (name and a digest of its
        key.json               params) and everything that shapes the data; a rerun
        sequences.json         finds it and neither generates nor runs the model again
        features/{train,heldout}/
          tokens.npy           int32 [N, T]   prompt + answer, zero-padded
          lengths.npy          int32 [N]      tokens per row
          prompt_lengths.npy   int32 [N]
          greedy.npy           int32 [N, T]   the model's greedy guess of token t + 1
          hidden.npy           [N, T, F]      what the heads read at t, memory-mapped, float32
                                              or float16 (`feature_dtype`): the final-norm
                                              hidden state (F = D), or the residual stream
                                              after the family's target layers (eagle3: 3 D)
      checkpoints/<step>/      orbax: params + optimizer state, written atomically, last N kept
      metrics.jsonl            train loss, per-head top-1/top-5 accuracy, accepted length;
                               held-out top-1..top-10 accuracies, accepted length
      losses.png
      export/                  `mdjax.load_heads` reads it (+ heldout_prompts.json)

What each head learns at position p of a row (x: the tokens, h: the model's hidden
states, so that the model's own guess of x[p + 1] is lm_head(h[p])), each family's
`HeadFamily.loss` (`mdjax.heads.family`; its batch window: `HeadFamily.window`)::

    medusa head k   reads h[p]                        target x[p + 1 + k]  ("ce"), or the
                                                      law softmax(lm_head(h[p + k])) ("kl")
    eagle           reads (x[p + 1], h[p]), and the   h[p + 1] (smooth L1) and
                    heads' own features before p      x[p + 2] / lm_head(h[p + 1]) (weighted)
    mtp head k      reads h[0..p] (its attention)     as medusa head k
    eagle3          reads (x[p + 1], three of the     the model's greedy guesses of x[p + 2],
                    target's layers at p), unrolled   x[p + 3], ... (the training-time test,
                    on its own outputs                `mdjax.heads.eagle3`)

A data set written by `experiments/make_head_data.py` (`config.data_dir`: the model's
answers with their hidden states, `mdjax.train.head_data`) replaces the generation
and the model's passes: its rows become the run's cache, with the greedy guesses the
generation stored (on answers: a data set needs `mask_prompt`). Heads of a family that
takes one score a draft vocabulary (`config.draft_vocab_size`): the most frequent
tokens of the training answers (`mdjax.heads.vocab`), saved with the heads.

Accuracies compare a head's ranked guesses with the model's greedy choice of the same
token (`greedy`): what a verifier decoding greedily accepts. The simulated accepted
length is `1 + sum_k prod_{i <= k} acc_i` (acc_i: head i's top-1 accuracy; eagle:
unrolled step i's) -- tokens per model pass if heads were right independently.

Determinism: the split, the generation and the initial heads come from `config.seed`,
the batch of step i is a pure function of (seed, i), and the step is one jitted XLA
program without randomness. A run killed at any point (or stopped by `max_minutes`)
and restarted with the same `run_dir` resumes from its latest checkpoint and ends with
bitwise the parameters of an uninterrupted run.

Devices: `config.mesh = "data,tensor"` (e.g. "4,2"; "" = one device; `devices.device_mesh`)
puts the frozen model on a `("data", "tensor")` mesh (`mdjax.sharding`: it generates
and computes its features there), replicates the heads and their optimizer state,
splits each batch over "data", and traces the step under `sharding.active`. The heads'
checkpoints are the same arrays whatever the mesh, so a run resumes on any mesh.
A model passed to `train` already on a mesh trains there.

Many processes (`config.distributed`, `mdjax.distributed`; the same command on every
host, `run_dir` on a filesystem they share): the model lies on a mesh of every
process's devices, every process generates and runs the model's passes (they are
collective) but only process 0 writes the cache, the metrics, the plot and the export
(the others open the cache after a barrier), each process reads only its rows of
each batch (`devices.shard_batch`), and all of them save and restore the checkpoints
together: the losses are one process's, and a run resumes on any number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import platform
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int
from tqdm import tqdm

import mdjax
from mdjax import distributed, files, programs, sharding
from mdjax.chat import chat_ids
from mdjax.errors import MdjaxError, check_count, check_real
from mdjax.files import atomic_directory
from mdjax.generate import generate
from mdjax.heads import FAMILIES, Heads, HeadsConfig, get_family, init_heads, save_heads, vocab
from mdjax.heads.objective import LOSSES, Objective
from mdjax.models.config import ModelConfig, weight_dtype
from mdjax.models.model import Model
from mdjax.models.transformer import Params, forward_causal, lm_head
from mdjax.prompts import encode_prompts
from mdjax.train import devices, head_prompts, loop
from mdjax.train.config import HeadsTrainConfig, to_json, typed
from mdjax.train.head_data import HeadData
from mdjax.train.metrics import MetricsLog, plot_losses

FEATURE_DTYPES = ("float32", "float16")
BAR_TOP = (1, 5)  # the top-k accuracies a training step measures
EVAL_TOP = tuple(range(1, 11))  # the held-out ones (HeadsConfig.top_accuracy's columns)
HELDOUT_FILE = "heldout_prompts.json"
CACHE_FORMAT = 1  # part of every cache key: bump when the cache's layout changes


# --- Data: the model's own text and its hidden states, cached --------------------------


@dataclasses.dataclass(frozen=True)
class Features:
  """One split of the cache (layout: the module docstring)."""

  tokens: np.ndarray  # int32 [N, T]
  lengths: np.ndarray  # int32 [N]
  prompt_lengths: np.ndarray  # int32 [N]
  greedy: np.ndarray  # int32 [N, T]: argmax lm_head(hidden[:, t]), the guess of token t + 1
  hidden: np.ndarray  # [N, T, D] float32 / float16, memory-mapped

  FIELDS = ("tokens", "lengths", "prompt_lengths", "greedy", "hidden")

  @classmethod
  def open(cls, directory: pathlib.Path) -> "Features":
    return cls(**{name: np.load(directory / f"{name}.npy", mmap_mode="r" if name == "hidden"
                                else None) for name in cls.FIELDS})

  @property
  def rows(self) -> int:
    return len(self.lengths)

  @property
  def token_count(self) -> int:
    return int(self.lengths.sum())

  @property
  def answer_tokens(self) -> int:
    return int((self.lengths - self.prompt_lengths).sum())


@dataclasses.dataclass(frozen=True)
class RunData:
  """The cached splits and what the model card says about them."""

  train: Features
  heldout: Features
  heldout_prompts: list  # texts or token-id lists (text_file: the held-out rows' texts)
  description: dict  # where the data came from: "source"; "prompts" (how many), "chat"
  cache_dir: pathlib.Path


def prepare_data(config: HeadsTrainConfig, model: Model, run_dir: pathlib.Path,
                 layers: tuple[int, ...] = (), progress: bool = True) -> RunData:
  """The run's data from its cache, generating and computing what the cache lacks;
  the features are the target's `layers` concatenated ((): its final-norm states)."""
  if config.data_dir:
    return data_set_features(config, model, run_dir, layers)
  source, rows = _source(config, model)
  key = _cache_key(config, model, rows, layers)
  cache_dir = run_dir / "cache" / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
  sequences = _load_or_generate(config, model, source, rows, cache_dir, key, progress)
  features = cache_dir / "features"
  if not features.is_dir():  # the same answer on every process: none writes before all ask
    _cache_features(config, model, sequences, features, layers, progress)
  distributed.barrier("features")
  return RunData(train=Features.open(features / "train"),
                 heldout=Features.open(features / "heldout"),
                 heldout_prompts=sequences["heldout_prompts"],
                 description=source, cache_dir=cache_dir)


def data_set_features(config: HeadsTrainConfig, model: Model, run_dir: pathlib.Path,
                      layers: tuple[int, ...]) -> RunData:
  """The run's data from `config.data_dir` (`mdjax.train.head_data`): its rows as the
  cache's `Features` (written once, by process 0), the features the stored states of
  `layers` (or the final-norm ones), with the stored greedy guesses."""
  if not config.mask_prompt:
    raise MdjaxError("a data set (data_dir) stores the model's greedy guesses on answers "
                     "only: train on it with mask_prompt=True")
  data = HeadData(config.data_dir)
  if data.meta.get("model") not in (model.name, config.model):
    raise MdjaxError(f"the data set {config.data_dir!r} was written by the model "
                     f"{data.meta.get('model')!r}, not by {model.name or config.model!r}")
  stored = list(data.meta.get("aux_layers", ()))
  missing = [layer for layer in layers if layer not in stored]
  if missing:
    raise MdjaxError(f"the heads read target layers {list(layers)}; the data set "
                     f"{config.data_dir!r} stores the states of layers {stored} only")
  key = {"format": CACHE_FORMAT, "data_dir": str(pathlib.Path(config.data_dir).resolve()),
         "chunks": [c.name for c in data.chunks], "layers": list(layers),
         "feature_dtype": config.feature_dtype}
  cache_dir = run_dir / "cache" / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
  features = cache_dir / "features"
  if not features.is_dir() and distributed.is_main_process():
    with atomic_directory(features) as staging:
      for split in ("train", "heldout"):
        rows = list(data.rows(split))
        write_stored_features(model, rows, staging / split, config.feature_dtype,
                              [stored.index(layer) for layer in layers])
    (cache_dir / "key.json").write_text(json.dumps({"key": key}, indent=1) + "\n")
  distributed.barrier("features")
  heldout = [p["text"] for p in data.prompts if p["split"] == "heldout"]
  kinds = sorted({p.get("kind", "") for p in data.prompts} - {""})
  source = {"source": f"the data set {config.data_dir} ({len(kinds)} kinds of task: "
                      f"{', '.join(kinds)})", "prompts": len(data.prompts), "chat": "yes"}
  return RunData(train=Features.open(features / "train"), heldout=Features.open(
      features / "heldout"), heldout_prompts=heldout, description=source, cache_dir=cache_dir)


def write_stored_features(model: Model, rows: list, directory: pathlib.Path, dtype: str,
                          aux_index: list[int]) -> None:
  """`Features` files of data-set rows (`head_data.Row`) into `directory`: tokens
  zero-padded to a multiple of 16, the stored states (`aux_index`: which of the stored
  layers, concatenated; []: the final-norm states) and greedy guesses."""
  if not rows:
    raise MdjaxError(f"the data set has no {directory.name} rows")
  width = -(-max(len(r.tokens) for r in rows) // 16) * 16
  tokens = np.zeros((len(rows), width), np.int32)  # [N, T]
  for i, row in enumerate(rows):
    tokens[i, :len(row.tokens)] = row.tokens
  pairs = [[list(r.tokens[:r.prompt_length]), list(r.tokens[r.prompt_length:])] for r in rows]
  d = model.config.hidden_size
  files = _open_features(directory, pairs, tokens, dtype, d * max(1, len(aux_index)))
  for i, row in enumerate(rows):
    n = len(row.tokens)
    files["hidden"][i, :n] = row.aux[:, aux_index].reshape(n, -1) if aux_index else row.hidden
    files["greedy"][i, :n] = np.maximum(row.greedy, 0)  # -1 (inside the prompt): masked
  for array in files.values():
    array.flush()


def _cache_features(config: HeadsTrainConfig, model: Model, sequences: dict,
                    features: pathlib.Path, layers: tuple[int, ...], progress: bool) -> None:
  """Runs the model over both splits (on every process: its passes are collective);
  process 0 writes the `Features` into `features`, atomically."""
  main = distributed.is_main_process()
  with atomic_directory(features) if main else contextlib.nullcontext() as staging:
    for split in ("train", "heldout"):
      write_features(model, sequences[split], staging and staging / split,
                     config.feature_dtype, config.feature_batch, progress, layers)


def _source(config: HeadsTrainConfig, model: Model) -> tuple[dict, dict]:
  """What the data is made from: (its description, {"train", "heldout"} prompts or text
  rows). A prompt is a text or token ids; a text row is token ids."""
  if config.text_file:
    if model.tokenizer is None:
      raise MdjaxError(f"text_file needs a model with a tokenizer; {model.name!r} has none")
    ids = model.tokenizer.encode(head_prompts.read_text(config.text_file))
    chunks = [ids[i:i + config.text_row_tokens] for i in range(0, len(ids), config.text_row_tokens)]
    train, heldout = head_prompts.split_prompts(chunks, config.heldout_fraction, config.seed)
    return {"source": f"the text file {config.text_file}"}, {"train": train, "heldout": heldout}
  if config.prompts:
    prompts = head_prompts.read_prompts(config.prompts)
    source = f"the prompts file {config.prompts}"
  else:
    prompts, source = head_prompts.builtin_prompts(), "mdjax's built-in prompt set"
  if model.tokenizer is None and any(isinstance(p, str) for p in prompts):
    raise MdjaxError(f"the model {model.name!r} has no tokenizer, so the prompts must be token "
                     "ids: pass a .jsonl prompts file with one list of ids per line")
  train, heldout = head_prompts.split_prompts(prompts, config.heldout_fraction, config.seed)
  chat = "yes" if uses_chat_template(model, config.chat) else "no"
  return ({"source": source, "prompts": len(prompts), "chat": chat},
          {"train": train, "heldout": heldout})


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value).encode()).hexdigest()


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


def _cache_key(config: HeadsTrainConfig, model: Model, rows: dict,
               layers: tuple[int, ...]) -> dict:
  """Everything the cached data depends on (the cache directory is named by its hash)."""
  key = {"format": CACHE_FORMAT, "model": model.name or str(model.path), "params":
         model_digest(model), "data": _digest(rows), "feature_dtype": config.feature_dtype}
  if layers:
    key["layers"] = list(layers)
  if not config.text_file:
    key.update(chat=config.chat, samples_per_prompt=config.samples_per_prompt,
               temperature=config.temperature, max_new_tokens=config.max_new_tokens,
               seed=config.seed)
  return key


def _load_or_generate(config: HeadsTrainConfig, model: Model, source: dict, rows: dict,
                      cache_dir: pathlib.Path, key: dict, progress: bool) -> dict:
  """{"train", "heldout"}: [prompt ids, answer ids] per row, and "heldout_prompts";
  generated (prompts) or cut (text) once, then read from `sequences.json`."""
  path = cache_dir / "sequences.json"
  if path.is_file():
    return json.loads(path.read_text())
  if config.text_file:
    sequences = {split: [[[], chunk] for chunk in rows[split]] for split in rows}
    heldout_prompts = [model.tokenizer.decode(chunk) for chunk in rows["heldout"]]
  else:
    answered = _generate_rows(config, model, rows["train"] + rows["heldout"], progress)
    cut = len(rows["train"]) * config.samples_per_prompt
    sequences = {"train": answered[:cut], "heldout": answered[cut:]}
    heldout_prompts = rows["heldout"]
  if distributed.is_main_process():
    cache_dir.mkdir(parents=True, exist_ok=True)
    (cache_dir / "key.json").write_text(json.dumps({"key": key, "data": source}, indent=1) + "\n")
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


def _generate_rows(config: HeadsTrainConfig, model: Model, prompts: list,
                   progress: bool) -> list[list[list[int]]]:
  """[prompt ids, answer ids] for each of `samples_per_prompt` answers to each prompt
  (prompt-major), `generation_batch` prompts per `mdjax.generate` call."""
  ids = [p for p in prompt_ids(model, prompts, config.chat)
         for _ in range(config.samples_per_prompt)]
  size = config.generation_batch
  strategy, options = (("sample", {"temperature": config.temperature}) if config.temperature > 0
                       else ("greedy", {}))
  answers = []
  for index, start in enumerate(tqdm(range(0, len(ids), size), disable=not progress,
                                     desc="generating", dynamic_ncols=True)):
    chunk = ids[start:start + size]
    padded = chunk + [chunk[0]] * (size - len(chunk))  # every call the same batch shape
    out = generate(model, padded, strategy=strategy, max_new_tokens=config.max_new_tokens,
                   seed=config.seed + index, **options)
    answers += out.sequences[:len(chunk)]
  return [[prompt, answer] for prompt, answer in zip(ids, answers)]


@functools.partial(programs.jit, static_argnames=("config", "layers"))
def base_features(params: Params, tokens: Int[Array, "B T"], *, config: ModelConfig,
                  layers: tuple[int, ...] = ()) -> tuple[Float[Array, "B T F"], Int[Array, "B T"]]:
  """What heads read, the model's final-norm hidden states (F = D) or the residual
  stream after `layers` concatenated (F = A D), and its greedy guess of each next token."""
  if not layers:
    hidden = forward_causal(params, tokens, config=config)
    return hidden, greedy_guesses(params, hidden, config=config)
  hidden, aux = forward_causal(params, tokens, config=config, aux_layers=layers)  # aux [B, T, A, D]
  return aux.reshape(*aux.shape[:2], -1), greedy_guesses(params, hidden, config=config)


def greedy_guesses(params: Params, hidden: Float[Array, "B T D"], *,
                   config: ModelConfig) -> Int[Array, "B T"]:
  """The model's greedy guess of each next token from its final-norm hidden states."""
  return jnp.argmax(lm_head(params, hidden, config=config), axis=-1).astype(jnp.int32)


def write_features(model: Model, rows: list[list[list[int]]], directory: pathlib.Path | None,
                   dtype: str, batch_size: int, progress: bool = True,
                   layers: tuple[int, ...] = ()) -> None:
  """The `Features` files of `rows` ([prompt ids, answer ids] each) into `directory`:
  one pass of the model per `batch_size` rows, zero-padded to a multiple of 16 tokens;
  `hidden` holds the final-norm states, or the residual stream after `layers`.
  `directory` None: the passes alone, nothing written (a process other than 0 under
  `jax.distributed`, where the passes are collective)."""
  sequences = [prompt + answer for prompt, answer in rows]
  width = -(-max(map(len, sequences)) // 16) * 16
  tokens = np.zeros((len(rows), width), np.int32)  # [N, T]
  for i, sequence in enumerate(sequences):
    tokens[i, :len(sequence)] = sequence
  features_width = model.config.hidden_size * max(1, len(layers))  # F
  files = directory and _open_features(directory, rows, tokens, dtype, features_width)
  for start in tqdm(range(0, len(rows), batch_size), disable=not progress,
                    desc=f"hidden states ({getattr(directory, 'name', '')})", dynamic_ncols=True):
    chunk = tokens[start:start + batch_size]
    padded = np.zeros((batch_size, width), np.int32)  # every call the same shape
    padded[:len(chunk)] = chunk
    with sharding.active(model.layout):
      h, g = distributed.to_host(base_features(model.params, jnp.asarray(padded),
                                               config=model.config, layers=layers))
    if files:
      files["hidden"][start:start + len(chunk)] = h[:len(chunk)].astype(dtype)
      files["greedy"][start:start + len(chunk)] = g[:len(chunk)]
  for array in (files or {}).values():
    array.flush()


def _open_features(directory: pathlib.Path, rows: list[list[list[int]]], tokens: np.ndarray,
                   dtype: str, width: int) -> dict[str, np.ndarray]:
  """Writes the token files of `write_features` into a new `directory`; returns its
  "hidden" and "greedy" files, memory-mapped, for the model's passes to fill."""
  directory.mkdir(parents=True)
  np.save(directory / "tokens.npy", tokens)
  np.save(directory / "lengths.npy", np.array([len(p) + len(a) for p, a in rows], np.int32))
  np.save(directory / "prompt_lengths.npy", np.array([len(p) for p, _ in rows], np.int32))
  return {"hidden": np.lib.format.open_memmap(directory / "hidden.npy", "w+", np.dtype(dtype),
                                              (*tokens.shape, width)),
          "greedy": np.lib.format.open_memmap(directory / "greedy.npy", "w+", np.int32,
                                              tokens.shape)}


def draft_vocabulary(config: HeadsTrainConfig, data: RunData, vocab_size: int) -> np.ndarray:
  """The heads' draft vocabulary: the `config.draft_vocab_size` most frequent tokens of
  the training answers (0: every id), ascending (`mdjax.heads.vocab.choose`)."""
  train = data.train
  answers = np.arange(train.tokens.shape[1]) >= train.prompt_lengths[:, None]  # [N, T]
  inside = answers & (np.arange(train.tokens.shape[1]) < train.lengths[:, None])
  counts = np.bincount(train.tokens[inside], minlength=vocab_size)
  return vocab.choose(counts, config.draft_vocab_size)


def heldout_coverage(data: RunData, draft_ids: np.ndarray) -> float:
  """The fraction of the held-out answers' greedy guesses inside the draft vocabulary."""
  held = data.heldout
  column = np.arange(held.tokens.shape[1])
  answers = (column + 1 >= held.prompt_lengths[:, None]) & (column + 1 < held.lengths[:, None])
  return vocab.coverage(draft_ids, held.greedy[answers])


# --- Batches ----------------------------------------------------------------------------


ROW_WIDTH_STEP = 64  # whole-row batches: widths 64, 128, ...: few compiled steps


class Reader:
  """Batches of one split. A unit is a (row, first position) pair: a window of `window`
  tokens per source position p (x[p..p + window - 1], h[p..p + window - 2]: medusa's,
  `HeadFamily.window`), or whole rows (`window` None: heads that attend to the whole
  prefix). Whole rows are kept in length order and a batch is `size` neighbours in it,
  cropped to its longest row (rounded up to `ROW_WIDTH_STEP`): rows of 60 to 500
  tokens padded to the longest of the data set would spend most of a step on padding.
  A batch (numpy, the step's input)::

      tokens  int32 [B, n]         x[p], x[p + 1], ...
      ok      bool  [B, n]         may token j be a target (inside the row, past the
                                   prompt when `mask_prompt`, not padding)?
      hidden  [B, n - 1, D]        h[p], h[p + 1], ...
      greedy  int32 [B, n - 1]     the model's greedy guesses of x[p + 1], x[p + 2], ...
  """

  def __init__(self, features: Features, window: int | None, mask_prompt: bool):
    self.features, self.mask_prompt = features, mask_prompt
    if window is not None:
      self.rows, self.starts = window_sources(features, mask_prompt)
      self.width = window
    else:
      self.rows = np.argsort(features.lengths, kind="stable")
      self.starts = np.zeros(features.rows, np.int64)
      self.width = None
    if not len(self.rows):
      raise MdjaxError("the data has no position to train on: every row is too short "
                       "(or all prompt, with mask_prompt)")

  def __len__(self) -> int:
    return len(self.rows)

  def batch(self, seed: int, step: int, size: int,
            rows: slice = slice(None)) -> dict[str, np.ndarray]:
    """Batch `step`: `size` units drawn by (seed, step) alone; or only its `rows` (a
    process's part of it: `devices.shard_batch`; its width is the whole batch's)."""
    rng = np.random.default_rng([seed, step])
    if self.width is None:  # neighbours in length order
      picked = (rng.integers(0, len(self)) + np.arange(size)) % len(self)
    else:
      picked = rng.integers(0, len(self), size)
    width = self.batch_width(picked)
    return self.read(picked[rows], np.ones(len(picked[rows]), bool), width)

  def batch_width(self, picked: np.ndarray) -> int:
    """n: the window, or the longest picked row rounded up to `ROW_WIDTH_STEP`."""
    if self.width is not None:
      return self.width
    longest = int(self.features.lengths[self.rows[picked]].max())
    return min(-(-longest // ROW_WIDTH_STEP) * ROW_WIDTH_STEP, self.features.tokens.shape[1])

  def chunks(self, size: int):
    """Every unit once, `size` at a time; the last chunk is padded with dead units."""
    for start in range(0, len(self), size):
      picked = np.arange(start, start + size)
      live = picked < len(self)
      picked = np.where(live, picked, start)
      yield self.read(picked, live, self.batch_width(picked))

  def read(self, picked: np.ndarray, live: np.ndarray, width: int) -> dict[str, np.ndarray]:
    f = self.features
    rows = self.rows[picked][:, None]  # [B, 1]
    index = self.starts[picked][:, None] + np.arange(width)  # [B, n]
    ok = (index < f.lengths[rows]) & live[:, None]
    if self.mask_prompt:
      ok &= index >= f.prompt_lengths[rows]
    index = np.minimum(index, f.tokens.shape[1] - 1)
    return {"tokens": f.tokens[rows, index], "ok": ok, "hidden": f.hidden[rows, index[:, :-1]],
            "greedy": f.greedy[rows, index[:, :-1]]}


def window_sources(features: Features, mask_prompt: bool) -> tuple[np.ndarray, np.ndarray]:
  """(rows, positions) of every position p whose head-1 target x[p + 2] exists (and is
  past the prompt, with `mask_prompt`): where windows start (medusa's)."""
  first = np.maximum(features.prompt_lengths - 2, 0) if mask_prompt else np.zeros_like(
      features.lengths)
  counts = np.maximum(features.lengths - 2 - first, 0)
  rows = np.repeat(np.arange(features.rows), counts)
  offsets = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
  return rows, first[rows] + offsets


# --- Losses -----------------------------------------------------------------------------


def accepted_length(top1: list[float]) -> float:
  """`1 + sum_k prod_{i <= k} top1[i]`: tokens per model pass when each guess is right
  with its own accuracy, independently (the model's own token always counts)."""
  return float(1 + np.sum(np.cumprod(top1)))


# --- Training ---------------------------------------------------------------------------


def make_optimizer(config: HeadsTrainConfig) -> optax.GradientTransformation:
  """`loop.make_optimizer`: weight decay on the heads' matrices only."""
  return loop.make_optimizer(config, lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))


def make_train_step(objective: Objective, optimizer: optax.GradientTransformation,
                    shardings=None):
  """`loop.make_train_step` of `objective`: `step(state, batch, base)`, base the model's
  unembedding (frozen); metrics: also each head's (step's) top-1 / top-5 hits."""
  loss_fn = lambda params, batch, base: objective(params, batch, base, BAR_TOP)
  return loop.make_train_step(loss_fn, optimizer, shardings)


@functools.partial(programs.jit, static_argnames="objective")
def _scores(params, batch, base, *, objective: Objective):
  return objective(params, batch, base, EVAL_TOP)


def evaluate(params: Params, reader: Reader, objective: Objective, base: Params,
             batch_size: int) -> dict:
  """Held-out record: the mean loss, each head's (step's) cumulative top-1..top-10
  accuracy against the model's greedy tokens, and the simulated accepted length."""
  loss, weight, hits, count = 0.0, 0, 0, 0
  for batch in reader.chunks(batch_size):
    batch_loss, scores = distributed.to_host(_scores(params, batch, base, objective=objective))
    loss += float(batch_loss) * int(scores["count"].sum())
    weight += int(scores["count"].sum())
    hits, count = hits + scores["hits"], count + scores["count"]
  accuracy = hits / np.maximum(count, 1)[:, None]  # [depth, 10]
  return {"heldout_loss": loss / max(weight, 1), "heldout_topk": accuracy.tolist(),
          "heldout_top1": accuracy[:, 0].tolist(),
          "heldout_accepted_length": accepted_length(accuracy[:, 0])}


def objective_of(config: HeadsTrainConfig, model_config: ModelConfig) -> Objective:
  """The run's training objective: its family's loss with the config's weights."""
  depth = config.unroll if get_family(config.family).sequential else config.num_heads
  return Objective(family=config.family, model_config=model_config, depth=depth,
                   num_layers=config.num_layers, loss=config.loss, decay=config.head_decay,
                   regression_weight=config.regression_weight, token_weight=config.token_weight)


def unembedding(model: Model) -> Params:
  """The only weights of the model the heads' losses read: embedding and lm_head."""
  return {k: model.params[k] for k in ("embed", "lm_head") if k in model.params}


def heads_config(config: HeadsTrainConfig, model: Model) -> HeadsConfig:
  """The trained heads' config, before any accuracy is measured."""
  c = model.config
  return HeadsConfig(family=config.family, base_model=model.name or config.model,
                     base_family=c.family, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                     num_heads=config.num_heads, num_layers=config.num_layers,
                     own_unembedding=(get_family(config.family).owns_unembedding
                                      and config.own_unembedding),
                     draft_vocab_size=config.draft_vocab_size,
                     target_layers=get_family(config.family).layers_for(c))


def validate(config: ml_collections.ConfigDict | HeadsTrainConfig) -> HeadsTrainConfig:
  """`config` typed (`mdjax.train.config.typed`), its values checked: rejects those the
  run cannot work with, naming them, before any model is loaded."""
  config = typed(HeadsTrainConfig, config)
  if not config.run_dir:
    raise MdjaxError("config.run_dir is required (where the cache, checkpoints and export go)")
  family = get_family(config.family)
  if config.loss not in LOSSES:
    raise MdjaxError(f"config.loss must be one of {', '.join(LOSSES)}, got {config.loss!r}")
  weight_dtype(config.export_dtype)  # fails now, not at the export after training
  if config.feature_dtype not in FEATURE_DTYPES:
    raise MdjaxError(f"config.feature_dtype must be one of {', '.join(FEATURE_DTYPES)}, "
                     f"got {config.feature_dtype!r}")
  for name in ("num_heads", "num_layers", "samples_per_prompt", "max_new_tokens",
               "generation_batch", "text_row_tokens", "feature_batch", "unroll", "steps",
               "batch_size", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
    check_count(f"config.{name}", getattr(config, name), 1)
  if family.sequential and config.num_heads != 1:
    raise MdjaxError(f"an {config.family} head drafts one token at a time: config.num_heads must "
                     f"be 1, got {config.num_heads} (config.unroll trains deeper drafts)")
  if not family.sequential and config.unroll != 1:
    sequential = " and ".join(name for name, f in FAMILIES.items() if f.sequential)
    raise MdjaxError(f"config.unroll is {sequential}'s; {config.family} needs 1, got "
                     f"{config.unroll}")

  check_count("config.eval_unroll", config.eval_unroll, 0)
  if not family.sequential and config.eval_unroll:
    raise MdjaxError(f"config.eval_unroll is for heads that draft one token at a time; "
                     f"{config.family} needs 0, got {config.eval_unroll}")
  check_count("config.draft_vocab_size", config.draft_vocab_size, 0)
  if config.draft_vocab_size and not family.draft_vocabulary:
    takers = ", ".join(name for name, f in FAMILIES.items() if f.draft_vocabulary)
    raise MdjaxError(f"config.draft_vocab_size: {config.family} heads score the whole vocabulary "
                     f"(a draft vocabulary is for {takers} heads); set it to 0")
  if config.data_dir and (config.prompts or config.text_file):
    raise MdjaxError("config.data_dir is the data: leave config.prompts and config.text_file "
                     "empty")
  if config.prompts and config.text_file:
    raise MdjaxError("config.prompts and config.text_file are exclusive: prompts make the model "
                     "write the data, a text file is the data")
  if not 0 < config.heldout_fraction < 1:
    raise MdjaxError(f"config.heldout_fraction must be in (0, 1), got {config.heldout_fraction}")
  check_real("config.temperature", config.temperature, 0.0)
  check_real("config.max_minutes", config.max_minutes, 0.0)
  for name in ("head_decay", "regression_weight", "token_weight"):
    check_real(f"config.{name}", getattr(config, name), 0.0)
  devices.device_mesh(config.mesh, config.batch_size)
  return config


@dataclasses.dataclass(frozen=True)
class Run:
  """What a finished `train` hands back."""

  heads: Heads  # as exported: held-out accuracies in its config, the card
  step: int
  heldout: dict  # the final `evaluate` record
  export_dir: pathlib.Path
  data: RunData
  stopped_early: bool  # by `max_minutes`
  train_seconds: float  # every session's, summed


def train(config: ml_collections.ConfigDict | HeadsTrainConfig, *, model: Model | None = None,
          progress: bool = True) -> Run:
  """Prepares the data (or finds it cached), trains or resumes the heads up to
  `config.steps` (or `max_minutes`), evaluates them on the held-out prompts and exports
  them. `config`: a user's ConfigDict (`configs/heads_common.py`), typed and checked here
  (`validate`). `model`: the base, already loaded (default: `mdjax.load(config.model)`);
  put on `config.mesh` when it names one."""
  session_start = time.perf_counter()
  config = validate(config)
  progress = progress and distributed.is_main_process()
  run_dir = pathlib.Path(config.run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  if distributed.is_main_process():
    (run_dir / "config.json").write_text(to_json(config))
  mesh = devices.device_mesh(config.mesh, config.batch_size)
  model = (on_mesh(model, mesh) if model is not None else
           mdjax.load(config.model, dtype=config.model_dtype, mesh=mesh))
  layout = model.layout
  if layout is not None and config.batch_size % layout.mesh.shape["data"]:
    raise MdjaxError(f"config.batch_size ({config.batch_size}) must be a multiple of the "
                     f"model's mesh's data axis ({layout.mesh.shape['data']})")
  spec = heads_config(config, model)
  family = get_family(spec.family)
  run_data = prepare_data(config, model, run_dir, family.target_layers(spec), progress)
  draft_ids = (draft_vocabulary(config, run_data, model.config.vocab_size)
               if config.draft_vocab_size else None)
  objective = objective_of(config, model.config)
  optimizer = make_optimizer(config)
  manager = loop.checkpoint_manager(config, run_dir)
  start, state = _restore(config, spec, model, optimizer, manager, layout, draft_ids)
  log = MetricsLog(run_dir / "metrics.jsonl")
  log.truncate_after(start)
  base = unembedding(model)
  if draft_ids is not None:  # frozen beside the model's: not trained
    base["draft_ids"] = jnp.asarray(draft_ids)
    base["draft_unembedding"] = vocab.unembedding_columns(base, base["draft_ids"])
  window = get_family(config.family).window(config.num_heads)
  train_reader, heldout_reader = (Reader(f, window, config.mask_prompt)
                                  for f in (run_data.train, run_data.heldout))
  scored = dataclasses.replace(objective, depth=config.eval_unroll or objective.depth)
  evaluation = lambda params: evaluate(params, heldout_reader, scored, base, config.batch_size)
  hooks = loop.Hooks(
      step=make_train_step(objective, optimizer, devices.state_shardings(state, layout)),
      extra=base, evaluate=evaluation,
      batch=lambda i, rows: train_reader.batch(config.seed, i, config.batch_size, rows),
      plot=functools.partial(plot_losses, path=run_dir / "losses.png", title=run_dir.name,
                             loss_label="loss", accuracy_title="held-out",
                             accuracy_label="accuracy vs the model's greedy token"),
      fields=_accuracies, summed=("loss", "hits", "count"))
  outcome = loop.run(config, hooks, state, start=start, end=config.steps, manager=manager,
                     log=log, layout=layout, name=run_dir.name, progress=progress,
                     max_minutes=config.max_minutes, session_start=session_start)
  with sharding.active(layout):
    heldout = _final_evaluation(log, outcome.step, outcome.state["params"], evaluation)
  directory = pathlib.Path(config.export_dir or run_dir / "export")
  params = outcome.state["params"]
  if draft_ids is not None:
    params = {**params, "draft_ids": jnp.asarray(draft_ids)}
  heads = export(Heads(config=spec, params=params), directory, config=config,
                 run_data=run_data, heldout=heldout, step=outcome.step,
                 train_seconds=outcome.train_seconds, stopped_early=outcome.stopped_early)
  return Run(heads=heads, step=outcome.step, heldout=heldout, export_dir=directory,
             data=run_data, stopped_early=outcome.stopped_early,
             train_seconds=outcome.train_seconds)


def _restore(config: HeadsTrainConfig, spec: HeadsConfig, model: Model,
             optimizer: optax.GradientTransformation, manager: ocp.CheckpointManager,
             layout: sharding.Layout | None, draft_ids: np.ndarray | None) -> tuple[int, dict]:
  """(step, state) of the latest checkpoint, or (0, the seeded initial state) before any;
  the initial state is also the template restored into. With a `layout`, replicated
  on its mesh (restored straight there: abstract arrays with that sharding). The
  params trained are the heads' floats: a draft vocabulary (`draft_ids`) stays out."""
  ids = np.arange(model.config.vocab_size) if draft_ids is None else draft_ids
  params = get_family(spec.family).restrict(init_heads(spec, model.config, seed=config.seed).params,
                                            ids, distributed.to_host(model.params))
  state = {"params": params, "opt_state": optimizer.init(params)}
  target = None if layout is None else jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
          layout.mesh, PartitionSpec())), state)
  start, state = loop.restore(manager, state, target)
  return start, sharding.on_layout(state, layout)


def on_mesh(model: Model, mesh) -> Model:
  """`model` on `mesh` (`mdjax.shard`); as it is without a mesh, or when it lies there
  already. `MdjaxError` when it lies on another mesh."""
  if mesh is None:
    return model
  if model.layout is None:
    return sharding.shard(model, mesh)
  if model.layout.mesh != sharding.layout_mesh(mesh, model.config.num_kv_heads):
    raise MdjaxError(f"the model lies on a mesh of {dict(model.layout.mesh.shape)}, not on "
                     f"config.mesh's {dict(mesh.shape)}: pass it on one device, or set "
                     "config.mesh to '' to train on its own mesh")
  return model


def _final_evaluation(log: MetricsLog, step: int, params: Params,
                      evaluation: Callable[[Params], dict]) -> dict:
  """The held-out record at `step`: logged already (by `loop.run`, or by an earlier
  session of a finished run), else measured now and logged."""
  for record in log.records():
    if record["step"] == step and "heldout_topk" in record:
      return record
  record = {"step": step, **evaluation(params)}
  log.write(record)
  return record


def _accuracies(sums: dict, step: int, steps: int, seconds: float) -> tuple[dict, dict]:
  """`loop.Hooks.fields`: each head's top-1 / top-5 accuracy and the simulated accepted
  length since the previous record."""
  accuracy = sums["hits"] / np.maximum(sums["count"], 1)[:, None]  # [depth, len(BAR_TOP)]
  record = {"top1": accuracy[:, 0].tolist(), "top5": accuracy[:, 1].tolist(),
            "accepted_length": accepted_length(accuracy[:, 0])}
  return record, {"top1": "/".join(f"{a:.2f}" for a in record["top1"]),
                  "top5": "/".join(f"{a:.2f}" for a in record["top5"]),
                  "accepted": f"{record['accepted_length']:.2f}"}


# --- Card, export -------------------------------------------------------------------------


def model_card(name: str, spec: HeadsConfig, config: HeadsTrainConfig,
               run_data: RunData, heldout: dict, step: int, train_seconds: float,
               stopped_early: bool, draft_ids: np.ndarray | None = None) -> str:
  """README.md of an export: base model, data, training, held-out numbers, usage."""
  family = get_family(spec.family)
  kind, label, strategy = family.describe(spec), family.step_label, family.strategy
  table = "\n".join(f"| {i + 1} | " + " | ".join(f"{a:.3f}" for a in (*acc[:5], acc[9])) + " |"
                    for i, acc in enumerate(heldout["heldout_topk"]))
  return f"""# {name}

{kind} for `{spec.base_model}`, trained by self-distillation with `mdjax.train.heads`
(`python -m experiments.train_heads`): the base wrote its own training text, and the
heads learned to guess, from its hidden states, what it writes further ahead.

## Data

{_card_data(config, run_data)}

## Training

{_card_training(spec, config, step, train_seconds, stopped_early)}
{_card_vocabulary(spec, run_data, draft_ids)}
## Held-out accuracy

Each {label}'s guesses against the base's greedy choice of the same token, on the
held-out answers ({run_data.heldout.rows} rows), cumulative top-k:

| {label} | top-1 | top-2 | top-3 | top-4 | top-5 | top-10 |
|---|---|---|---|---|---|---|
{table}

Simulated accepted length, 1 + sum_k prod_(i <= k) top-1_i:
**{heldout["heldout_accepted_length"]:.3f}** tokens per base pass. Held-out loss
{heldout["heldout_loss"]:.4f}.

## Use

```python
import mdjax
model = mdjax.load({spec.base_model!r})
heads = mdjax.load_heads("path/to/{name}")
out = mdjax.generate(model, prompts, strategy={strategy!r}, heads=heads)
```
"""


def _card_vocabulary(spec: HeadsConfig, run_data: RunData, draft_ids: np.ndarray | None) -> str:
  """The draft vocabulary's size and held-out coverage, when the heads have one."""
  if draft_ids is None:
    return ""
  coverage = heldout_coverage(run_data, np.asarray(draft_ids))
  return f"""
## Draft vocabulary

The heads score {len(draft_ids)} of the base's {spec.vocab_size} tokens (the most frequent
in the training answers; `draft_ids`, `mdjax.heads.vocab`). They cover
**{coverage:.1%}** of the base's greedy tokens in the held-out answers: a token outside
is never drafted (the base's own verify still writes it, so decoding stays exact).
"""


def _card_data(config: HeadsTrainConfig, run_data: RunData) -> str:
  d, train, held = run_data.description, run_data.train, run_data.heldout
  if config.data_dir:
    lines = [f"- {d['source']}: {d['prompts']} prompts, held out by prompt as the data set "
             f"splits them (`{HELDOUT_FILE}`); the base's own answers and hidden states"]
  elif config.text_file:
    lines = [f"- {d['source']}, cut into rows of {config.text_row_tokens} tokens, a seeded "
             f"{config.heldout_fraction:.0%} of the rows held out (`{HELDOUT_FILE}`)"]
  else:
    how = f"sampled at temperature {config.temperature}" if config.temperature > 0 else "greedy"
    lines = [f"- prompts: {d['source']} ({d['prompts']} prompts), a seeded "
             f"{config.heldout_fraction:.0%} held out by prompt (`{HELDOUT_FILE}`)",
             f"- answers written by the base itself: {how}, at most {config.max_new_tokens} new "
             f"tokens, {config.samples_per_prompt} per prompt, chat template: {d['chat']}"]
  lines.append(f"- train: {train.rows} rows, {train.token_count} tokens ({train.answer_tokens} "
               f"answer tokens); held-out: {held.rows} rows, {held.token_count} tokens")
  return "\n".join(lines)


def _card_training(spec: HeadsConfig, config: HeadsTrainConfig, step: int,
                   train_seconds: float, stopped_early: bool) -> str:
  device = jax.devices()[0]
  unit = "rows" if get_family(spec.family).window(spec.num_heads) is None else "positions"
  unrolled = f", unrolled {config.unroll} steps" if config.unroll > 1 else ""
  return "\n".join([
      f"- {step} steps{' (stopped by the time budget)' if stopped_early else ''} of "
      f"{config.batch_size} {unit}; AdamW, lr {config.optim.lr} (warmup "
      f"{config.optim.warmup_steps}, cosine); loss `{config.loss}`, weights "
      f"{config.head_decay}^(k-1){unrolled}",
      f"- {train_seconds / 60:.1f} minutes on {device.platform} ({device.device_kind}, "
      f"{os.cpu_count()} CPU cores), Python {platform.python_version()}, seed {config.seed}"])


def export(heads: Heads, directory: pathlib.Path, *, config: HeadsTrainConfig,
           run_data: RunData, heldout: dict, step: int, train_seconds: float,
           stopped_early: bool) -> Heads:
  """Writes the heads with their held-out accuracies (`HeadsConfig.top_accuracy`), the
  model card and `heldout_prompts.json` into `directory`, replaced atomically (process 0
  writes; every process returns the heads once they are written)."""
  spec = dataclasses.replace(heads.config, top_accuracy=heldout["heldout_topk"])
  card = model_card(directory.name, spec, config, run_data, heldout, step, train_seconds,
                    stopped_early, heads.params.get("draft_ids"))
  heads = Heads(config=spec, params=heads.params, card=card, name=str(directory))
  if distributed.is_main_process():
    with atomic_directory(directory) as staging:
      save_heads(heads, staging, dtype=config.export_dtype)
      (staging / HELDOUT_FILE).write_text(json.dumps(run_data.heldout_prompts, indent=1) + "\n")
  distributed.barrier("heads export")
  return heads
