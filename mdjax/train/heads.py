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
          hidden.npy           [N, T, D]      its final-norm hidden state at t, memory-mapped,
                                              float32 or float16 (`feature_dtype`)
      checkpoints/<step>/      orbax: params + optimizer state, written atomically, last N kept
      metrics.jsonl            train loss, per-head top-1/top-5 accuracy, accepted length;
                               held-out top-1..top-10 accuracies, accepted length
      losses.png
      export/                  `mdjax.load_heads` reads it (+ heldout_prompts.json)

What each head learns at position p of a row (x: the tokens, h: the model's hidden
states, so that the model's own guess of x[p + 1] is lm_head(h[p]))::

    medusa head k   reads h[p]                        target x[p + 1 + k]  ("ce"), or the
                                                      law softmax(lm_head(h[p + k])) ("kl")
    eagle           reads (x[p + 1], h[p]), and the   h[p + 1] (smooth L1) and
                    heads' own features before p      x[p + 2] / lm_head(h[p + 1]) (weighted)
    mtp head k      reads h[0..p] (its attention)     as medusa head k

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

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int
from tqdm import tqdm

import mdjax
from mdjax import distributed, programs, sharding
from mdjax.chat import chat_ids
from mdjax.errors import MdjaxError, check_count, check_real, require
from mdjax.files import atomic_directory
from mdjax.generate import generate
from mdjax.heads import (FAMILIES, Heads, HeadsConfig, eagle_causal, init_heads, medusa_logits,
                         mtp_causal)
from mdjax.heads.base import save_heads
from mdjax.models.config import ModelConfig, weight_dtype
from mdjax.models.model import Model
from mdjax.models.transformer import Params, forward_causal, lm_head
from mdjax.prompts import encode_prompts
from mdjax.train import devices, distill, head_prompts, lm
from mdjax.train.metrics import MetricsLog

LOSSES = ("ce", "kl")
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


def prepare_data(config: ml_collections.ConfigDict, model: Model, run_dir: pathlib.Path,
                 progress: bool = True) -> RunData:
  """The run's data from its cache, generating and computing what the cache lacks."""
  source, rows = _source(config, model)
  key = _cache_key(config, model, rows)
  cache_dir = run_dir / "cache" / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
  sequences = _load_or_generate(config, model, source, rows, cache_dir, key, progress)
  features = cache_dir / "features"
  if not features.is_dir():  # the same answer on every process: none writes before all ask
    _cache_features(config, model, sequences, features, progress)
  distributed.barrier("features")
  return RunData(train=Features.open(features / "train"),
                 heldout=Features.open(features / "heldout"),
                 heldout_prompts=sequences["heldout_prompts"],
                 description=source, cache_dir=cache_dir)


def _cache_features(config: ml_collections.ConfigDict, model: Model, sequences: dict,
                    features: pathlib.Path, progress: bool) -> None:
  """Runs the model over both splits (on every process: its passes are collective);
  process 0 writes the `Features` into `features`, atomically."""
  main = distributed.is_main_process()
  with atomic_directory(features) if main else contextlib.nullcontext() as staging:
    for split in ("train", "heldout"):
      write_features(model, sequences[split], staging and staging / split,
                     config.feature_dtype, config.feature_batch, progress)


def _source(config: ml_collections.ConfigDict, model: Model) -> tuple[dict, dict]:
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


def _cache_key(config: ml_collections.ConfigDict, model: Model, rows: dict) -> dict:
  """Everything the cached data depends on (the cache directory is named by its hash)."""
  key = {"format": CACHE_FORMAT, "model": model.name or str(model.path), "params":
         model_digest(model), "data": _digest(rows), "feature_dtype": config.feature_dtype}
  if not config.text_file:
    key.update(chat=config.chat, samples_per_prompt=config.samples_per_prompt,
               temperature=config.temperature, max_new_tokens=config.max_new_tokens,
               seed=config.seed)
  return key


def _load_or_generate(config, model: Model, source: dict, rows: dict, cache_dir: pathlib.Path,
                      key: dict, progress: bool) -> dict:
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
    _write_atomically(path, json.dumps({**sequences, "heldout_prompts": heldout_prompts}))
  return {**sequences, "heldout_prompts": heldout_prompts}


def _write_atomically(path: pathlib.Path, text: str) -> None:
  partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
  partial.write_text(text)
  os.replace(partial, path)


def uses_chat_template(model: Model, chat: bool) -> bool:
  """Do text prompts go through the model's chat template? With `chat`, when it has one."""
  return bool(chat and getattr(model.tokenizer, "chat_template", None))


def prompt_ids(model: Model, prompts: list, chat: bool) -> list[list[int]]:
  """Token ids of each prompt: a text through the model's chat template
  (`uses_chat_template`), else its tokenizer; token ids as given (checked)."""
  templated = uses_chat_template(model, chat)
  return [chat_ids(model, p) if templated and isinstance(p, str) else encode_prompts(model, [p])[0]
          for p in prompts]


def _generate_rows(config, model: Model, prompts: list, progress: bool) -> list[list[list[int]]]:
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


@functools.partial(programs.jit, static_argnames="config")
def base_features(params: Params, tokens: Int[Array, "B T"], *, config: ModelConfig
                  ) -> tuple[Float[Array, "B T D"], Int[Array, "B T"]]:
  """The model's final-norm hidden states and its greedy guess of each next token."""
  hidden = forward_causal(params, tokens, config=config)
  return hidden, jnp.argmax(lm_head(params, hidden, config=config), axis=-1).astype(jnp.int32)


def write_features(model: Model, rows: list[list[list[int]]], directory: pathlib.Path | None,
                   dtype: str, batch_size: int, progress: bool = True) -> None:
  """The `Features` files of `rows` ([prompt ids, answer ids] each) into `directory`:
  one pass of the model per `batch_size` rows, zero-padded to a multiple of 16 tokens.
  `directory` None: the passes alone, nothing written (a process other than 0 under
  `jax.distributed`, where the passes are collective)."""
  sequences = [prompt + answer for prompt, answer in rows]
  width = -(-max(map(len, sequences)) // 16) * 16
  tokens = np.zeros((len(rows), width), np.int32)  # [N, T]
  for i, sequence in enumerate(sequences):
    tokens[i, :len(sequence)] = sequence
  files = directory and _open_features(directory, rows, tokens, dtype, model.config.hidden_size)
  for start in tqdm(range(0, len(rows), batch_size), disable=not progress,
                    desc=f"hidden states ({getattr(directory, 'name', '')})", dynamic_ncols=True):
    chunk = tokens[start:start + batch_size]
    padded = np.zeros((batch_size, width), np.int32)  # every call the same shape
    padded[:len(chunk)] = chunk
    with sharding.active(model.layout):
      h, g = distributed.to_host(base_features(model.params, jnp.asarray(padded),
                                               config=model.config))
    if files:
      files["hidden"][start:start + len(chunk)] = h[:len(chunk)].astype(dtype)
      files["greedy"][start:start + len(chunk)] = g[:len(chunk)]
  for array in (files or {}).values():
    array.flush()


def _open_features(directory: pathlib.Path, rows: list[list[list[int]]], tokens: np.ndarray,
                   dtype: str, hidden_size: int) -> dict[str, np.ndarray]:
  """Writes the token files of `write_features` into a new `directory`; returns its
  "hidden" and "greedy" files, memory-mapped, for the model's passes to fill."""
  directory.mkdir(parents=True)
  np.save(directory / "tokens.npy", tokens)
  np.save(directory / "lengths.npy", np.array([len(p) + len(a) for p, a in rows], np.int32))
  np.save(directory / "prompt_lengths.npy", np.array([len(p) for p, _ in rows], np.int32))
  return {"hidden": np.lib.format.open_memmap(directory / "hidden.npy", "w+", np.dtype(dtype),
                                              (*tokens.shape, hidden_size)),
          "greedy": np.lib.format.open_memmap(directory / "greedy.npy", "w+", np.int32,
                                              tokens.shape)}


# --- Batches ----------------------------------------------------------------------------


class Reader:
  """Batches of one split. A unit is a (row, first position) pair: medusa reads one
  window of `K + 2` tokens per source position p (x[p..p + 1 + K], h[p..p + K]), eagle
  and mtp (whose heads attend to the whole prefix) read whole rows. A batch (numpy, the
  step's input)::

      tokens  int32 [B, n]         x[p], x[p + 1], ...
      ok      bool  [B, n]         may token j be a target (inside the row, past the
                                   prompt when `mask_prompt`, not padding)?
      hidden  [B, n - 1, D]        h[p], h[p + 1], ...
      greedy  int32 [B, n - 1]     the model's greedy guesses of x[p + 1], x[p + 2], ...
  """

  def __init__(self, features: Features, family: str, num_heads: int, mask_prompt: bool):
    self.features, self.mask_prompt = features, mask_prompt
    if family == "medusa":
      self.rows, self.starts = medusa_sources(features, mask_prompt)
      self.width = num_heads + 2
    else:
      self.rows = np.arange(features.rows)
      self.starts = np.zeros(features.rows, np.int64)
      self.width = features.tokens.shape[1]
    if not len(self.rows):
      raise MdjaxError("the data has no position to train on: every row is too short "
                       "(or all prompt, with mask_prompt)")

  def __len__(self) -> int:
    return len(self.rows)

  def batch(self, seed: int, step: int, size: int,
            rows: slice = slice(None)) -> dict[str, np.ndarray]:
    """Batch `step`: `size` units drawn by (seed, step) alone; or only its `rows` (a
    process's part of it: `devices.shard_batch`)."""
    picked = np.random.default_rng([seed, step]).integers(0, len(self), size)[rows]
    return self.read(picked, np.ones(len(picked), bool))

  def chunks(self, size: int):
    """Every unit once, `size` at a time; the last chunk is padded with dead units."""
    for start in range(0, len(self), size):
      picked = np.arange(start, start + size)
      live = picked < len(self)
      yield self.read(np.where(live, picked, 0), live)

  def read(self, picked: np.ndarray, live: np.ndarray) -> dict[str, np.ndarray]:
    f = self.features
    rows = self.rows[picked][:, None]  # [B, 1]
    index = self.starts[picked][:, None] + np.arange(self.width)  # [B, n]
    ok = (index < f.lengths[rows]) & live[:, None]
    if self.mask_prompt:
      ok &= index >= f.prompt_lengths[rows]
    index = np.minimum(index, f.tokens.shape[1] - 1)
    return {"tokens": f.tokens[rows, index], "ok": ok, "hidden": f.hidden[rows, index[:, :-1]],
            "greedy": f.greedy[rows, index[:, :-1]]}


def medusa_sources(features: Features, mask_prompt: bool) -> tuple[np.ndarray, np.ndarray]:
  """(rows, positions) of every position p whose head-1 target x[p + 2] exists (and is
  past the prompt, with `mask_prompt`): what Medusa trains and evaluates on."""
  first = np.maximum(features.prompt_lengths - 2, 0) if mask_prompt else np.zeros_like(
      features.lengths)
  counts = np.maximum(features.lengths - 2 - first, 0)
  rows = np.repeat(np.arange(features.rows), counts)
  offsets = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
  return rows, first[rows] + offsets


# --- Losses -----------------------------------------------------------------------------


def ahead(x: jax.Array, depth: int) -> jax.Array:
  """`x` `[B, W + depth, ...]` -> `[B, W, depth, ...]`: entry (t, k - 1) is x[t + k],
  for k = 1..depth."""
  width = x.shape[1] - depth
  return jnp.stack([x[:, k:k + width] for k in range(1, depth + 1)], axis=2)


def medusa_targets(tokens: Int[Array, "B n"], ok: Bool[Array, "B n"], num_heads: int
                   ) -> tuple[Int[Array, "B W K"], Bool[Array, "B W K"]]:
  """Head k's target at position t of a window (n = W + K + 1) is token t + 1 + k."""
  return ahead(tokens[:, 1:], num_heads), ahead(ok[:, 1:], num_heads)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  return jnp.sum(x * mask, axis=axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1)


def top_k_hits(logits: Float[Array, "B W V"], targets: Int[Array, "B W"],
               mask: Bool[Array, "B W"], ks: tuple[int, ...]) -> jax.Array:
  """`[len(ks)]`: how many unmasked targets are among the top-k logits, for each k in
  `ks` (a target tied with others counts at its best rank)."""
  target = jnp.take_along_axis(logits, targets[..., None], axis=-1)  # [B, W, 1]
  rank = jnp.sum(logits > target, axis=-1)  # [B, W]
  return jnp.stack([jnp.sum((rank < k) & mask) for k in ks])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Objective:
  """The loss of a family (static: a jit argument), and the accuracies it measures."""

  family: str
  model_config: ModelConfig
  depth: int  # predictions scored per position: K heads (medusa, mtp), eagle's unrolled steps
  num_layers: int
  loss: str  # "ce" | "kl"
  decay: float  # weight of prediction k: decay^(k - 1)
  regression_weight: float = 1.0  # eagle
  token_weight: float = 0.1  # eagle

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, model_config: ModelConfig):
    depth = config.unroll if config.family == "eagle" else config.num_heads
    return cls(family=config.family, model_config=model_config, depth=depth,
               num_layers=config.num_layers, loss=config.loss, decay=config.head_decay,
               regression_weight=config.regression_weight, token_weight=config.token_weight)

  def __call__(self, params: Params, batch: dict, base: Params, ks: tuple[int, ...]):
    """(loss, {"hits": [depth, len(ks)] top-k hits, "count": [depth] targets})."""
    fn = eagle_loss if self.family == "eagle" else parallel_loss
    return fn(self, params, batch, base, ks)

  def head_logits(self, params: Params, hidden: Float[Array, "B T D"],
                  base: Params) -> Float[Array, "B T K V"]:
    """Every head's logits at every position of `hidden` (medusa, mtp): head k's of
    token t + 1 + k."""
    if self.family == "medusa":
      return medusa_logits(params, base, hidden, model_config=self.model_config)
    features = mtp_causal(params, hidden, model_config=self.model_config)  # [B, T, K, D]
    return lm_head(base, features, config=self.model_config)

  def token_losses(self, logits: Float[Array, "... V"], targets: Int[Array, "..."],
                   teacher_hidden: Float[Array, "... D"], base: Params) -> Float[Array, "..."]:
    """Cross-entropy to the data's tokens ("ce"), or the KL from the model's law of them,
    softmax(lm_head(teacher_hidden)) ("kl")."""
    if self.loss == "ce":
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    teacher = lm_head(base, teacher_hidden, config=self.model_config)
    return distill.kl_to_teacher(logits, jax.lax.stop_gradient(teacher), 1.0)


def parallel_loss(objective: Objective, params: Params, batch: dict, base: Params,
                  ks: tuple[int, ...]):
  """`sum_k decay^(k-1) * mean loss of head k` over n = W + K + 1 tokens: medusa's
  windows, mtp's whole rows (its heads read h[0..t], causally, so the last K hidden
  states, which have no target, are left out)."""
  k = objective.depth
  hidden = batch["hidden"].astype(jnp.float32)  # [B, W + K, D]
  width = hidden.shape[1] - k
  logits = objective.head_logits(params, hidden[:, :width], base)  # [B, W, K, V]
  targets, mask = medusa_targets(batch["tokens"], batch["ok"], k)  # [B, W, K]
  losses = objective.token_losses(logits, targets, ahead(hidden, k), base)  # [B, W, K]
  weights = objective.decay ** jnp.arange(k)  # [K]
  loss = jnp.sum(weights * masked_mean(losses, mask, axis=(0, 1)))
  greedy = ahead(batch["greedy"], k)  # [B, W, K]: the model's guesses of the same tokens
  hits = jnp.stack([top_k_hits(logits[:, :, i], greedy[:, :, i], mask[:, :, i], ks)
                    for i in range(k)])  # [K, len(ks)]
  return loss, {"hits": hits, "count": jnp.sum(mask, axis=(0, 1))}


def eagle_targets(batch: dict) -> dict[str, jax.Array]:
  """What the head reads and learns at p = 0..n - 3 of rows of n tokens (W = n - 2)::

      tokens    x[p + 1]    [B, W]     read, with
      features  h[p]        [B, W, D]
      wanted    h[p + 1]    [B, W, D]  the feature to predict
      targets   x[p + 2]    [B, W]     the token lm_head(wanted) guesses, and its
      mask                  [B, W]     may x[p + 2] be a target?
      greedy                [B, W]     the model's greedy guess of x[p + 2]
  """
  hidden = batch["hidden"].astype(jnp.float32)  # [B, n - 1, D]
  return {"tokens": batch["tokens"][:, 1:-1], "features": hidden[:, :-1], "wanted": hidden[:, 1:],
          "targets": batch["tokens"][:, 2:], "mask": batch["ok"][:, 2:],
          "greedy": batch["greedy"][:, 1:]}


def eagle_loss(objective: Objective, params: Params, batch: dict, base: Params,
               ks: tuple[int, ...]):
  """At each p of `eagle_targets`: smooth L1 from the predicted to the wanted feature
  (`regression_weight`), plus `token_weight` x the token loss of its lm_head logits.
  Unrolled step i (weight decay^(i - 1)) feeds the head, in place of h[p], its own step
  i - 1 prediction at p - 1 (h[0] stays): a cheap training-time test. Unlike drafting,
  where the prefix keeps the model's own features, every earlier position then holds
  predicted features too."""
  t = eagle_targets(batch)
  features, loss, hits, counts = t["features"], 0.0, [], []
  for step in range(objective.depth):
    predicted = eagle_causal(params, base, t["tokens"], features,
                             model_config=objective.model_config,
                             num_layers=objective.num_layers)  # [B, W, D]
    logits = lm_head(base, predicted, config=objective.model_config)  # [B, W, V]
    regression = jnp.mean(optax.huber_loss(predicted, t["wanted"], delta=1.0), axis=-1)  # [B, W]
    token = objective.token_losses(logits, t["targets"], t["wanted"], base)  # [B, W]
    loss += objective.decay ** step * masked_mean(
        objective.regression_weight * regression + objective.token_weight * token, t["mask"])
    hits.append(top_k_hits(logits, t["greedy"], t["mask"], ks))
    counts.append(jnp.sum(t["mask"]))
    features = jnp.concatenate([features[:, :1], predicted[:, :-1]], axis=1)
  return loss, {"hits": jnp.stack(hits), "count": jnp.stack(counts)}


def accepted_length(top1: list[float]) -> float:
  """`1 + sum_k prod_{i <= k} top1[i]`: tokens per model pass when each guess is right
  with its own accuracy, independently (the model's own token always counts)."""
  return float(1 + np.sum(np.cumprod(top1)))


# --- Training ---------------------------------------------------------------------------


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW (weight decay on matrices only) under
  `lm.lr_schedule` (warmup, then cosine)."""
  o = config.optim
  return optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(lm.lr_schedule(config), b1=o.b1, b2=o.b2,
                                 weight_decay=o.weight_decay,
                                 mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)))


def make_train_step(objective: Objective, optimizer: optax.GradientTransformation,
                    shardings=None):
  """`step(state, batch, base) -> (state, metrics)`, jitted, `state` donated.

  state: {"params", "opt_state"} of the heads; base: the model's unembedding (frozen,
  an argument so that jit does not bake it into the program as a constant).
  `shardings` (on a mesh, a tree like `state`): where the new state is kept.
  """

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, batch, base):
    (loss, scores), grads = jax.value_and_grad(objective, has_aux=True)(
        state["params"], batch, base, BAR_TOP)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    new_state = {"params": optax.apply_updates(state["params"], updates),
                 "opt_state": opt_state}
    if shardings is not None:
      new_state = jax.lax.with_sharding_constraint(new_state, shardings)
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **scores}

  return step


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


def unembedding(model: Model) -> Params:
  """The only weights of the model the heads' losses read: embedding and lm_head."""
  return {k: model.params[k] for k in ("embed", "lm_head") if k in model.params}


def heads_config(config: ml_collections.ConfigDict, model: Model) -> HeadsConfig:
  """The trained heads' config, before any accuracy is measured."""
  c = model.config
  return HeadsConfig(family=config.family, base_model=model.name or config.model,
                     base_family=c.family, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                     num_heads=config.num_heads, num_layers=config.num_layers,
                     own_unembedding=config.family == "medusa" and config.own_unembedding)


def validate(config: ml_collections.ConfigDict) -> None:
  """Rejects values the run cannot work with, naming them, before any model is loaded."""
  if not config.run_dir:
    raise MdjaxError("config.run_dir is required (where the cache, checkpoints and export go)")
  if config.family not in FAMILIES:
    raise MdjaxError(f"unknown heads family {config.family!r}; supported: {', '.join(FAMILIES)}")
  if config.loss not in LOSSES:
    raise MdjaxError(f"config.loss must be one of {', '.join(LOSSES)}, got {config.loss!r}")
  weight_dtype(config.export_dtype)  # fails now, not at the export after training
  if config.feature_dtype not in FEATURE_DTYPES:
    raise MdjaxError(f"config.feature_dtype must be one of {', '.join(FEATURE_DTYPES)}, "
                     f"got {config.feature_dtype!r}")
  for name in ("num_heads", "num_layers", "samples_per_prompt", "max_new_tokens",
               "generation_batch", "text_row_tokens", "feature_batch", "unroll", "steps",
               "batch_size", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
    check_count(f"config.{name}", config[name], 1)
  if config.family == "eagle" and config.num_heads != 1:
    raise MdjaxError(f"an eagle head drafts one token at a time: config.num_heads must be 1, "
                     f"got {config.num_heads} (config.unroll trains deeper drafts)")
  if config.family != "eagle" and config.unroll != 1:
    raise MdjaxError(f"config.unroll is eagle's; {config.family} needs 1, got {config.unroll}")
  if config.prompts and config.text_file:
    raise MdjaxError("config.prompts and config.text_file are exclusive: prompts make the model "
                     "write the data, a text file is the data")
  if not 0 < config.heldout_fraction < 1:
    raise MdjaxError(f"config.heldout_fraction must be in (0, 1), got {config.heldout_fraction}")
  check_real("config.temperature", config.temperature, 0.0)
  check_real("config.max_minutes", config.max_minutes, 0.0)
  for name in ("head_decay", "regression_weight", "token_weight"):
    check_real(f"config.{name}", config[name], 0.0)
  devices.device_mesh(config.mesh, config.batch_size)


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


def train(config: ml_collections.ConfigDict, *, model: Model | None = None,
          progress: bool = True) -> Run:
  """Prepares the data (or finds it cached), trains or resumes the heads up to
  `config.steps` (or `max_minutes`), evaluates them on the held-out prompts and exports
  them. `model`: the base, already loaded (default: `mdjax.load(config.model)`); put on
  `config.mesh` when it names one."""
  session_start = time.perf_counter()
  validate(config)
  progress = progress and distributed.is_main_process()
  run_dir = pathlib.Path(config.run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  if distributed.is_main_process():
    (run_dir / "config.json").write_text(config.to_json(indent=2) + "\n")
  mesh = devices.device_mesh(config.mesh, config.batch_size)
  model = (on_mesh(model, mesh) if model is not None else
           mdjax.load(config.model, dtype=config.model_dtype, mesh=mesh))
  layout = model.layout
  if layout is not None and config.batch_size % layout.mesh.shape["data"]:
    raise MdjaxError(f"config.batch_size ({config.batch_size}) must be a multiple of the "
                     f"model's mesh's data axis ({layout.mesh.shape['data']})")
  run_data = prepare_data(config, model, run_dir, progress)
  spec = heads_config(config, model)
  objective = Objective.from_config(config, model.config)
  optimizer = make_optimizer(config)
  manager = lm.checkpoint_manager(config, run_dir)
  start, state = _restore(config, spec, model.config, optimizer, manager, layout)
  log = MetricsLog(run_dir / "metrics.jsonl")
  log.truncate_after(start)
  base = unembedding(model)
  readers = [Reader(f, config.family, config.num_heads, config.mask_prompt)
             for f in (run_data.train, run_data.heldout)]
  step_fn = make_train_step(objective, optimizer, devices.state_shardings(state, layout))
  bar = _Progress(config, log, start, progress, run_dir.name, session_start)
  end, stopped_early = start, False
  with sharding.active(layout):
    for step in range(start + 1, config.steps + 1):
      batch = devices.shard_batch(functools.partial(readers[0].batch, config.seed, step - 1,
                                                    config.batch_size), config.batch_size, layout)
      state, metrics = step_fn(state, batch, base)
      end = step
      stopped_early = (config.max_minutes > 0 and step < config.steps and distributed.agreed(
          time.perf_counter() - session_start > 60 * config.max_minutes))
      bar.add(step, metrics, last=stopped_early)
      if step % config.eval_every == 0 and step < config.steps and not stopped_early:
        log.write({"step": step, **evaluate(state["params"], readers[1], objective, base,
                                            config.batch_size)})
      if lm.due(step, config.checkpoint_every, config.steps) or stopped_early:
        manager.save(step, args=ocp.args.StandardSave(state), force=True)
      if stopped_early:
        break
    bar.close()
    manager.wait_until_finished()
    heldout = _final_evaluation(log, end, state["params"], readers[1], objective, base,
                                config.batch_size)
  if distributed.is_main_process():
    plot_heads(log.records(), run_dir / "losses.png", run_dir.name)
  train_seconds = bar.wall_seconds()
  directory = pathlib.Path(config.export_dir or run_dir / "export")
  heads = export(Heads(config=spec, params=state["params"]), directory, config=config,
                 run_data=run_data, heldout=heldout, step=end,
                 train_seconds=train_seconds, stopped_early=stopped_early)
  return Run(heads=heads, step=end, heldout=heldout, export_dir=directory, data=run_data,
             stopped_early=stopped_early, train_seconds=train_seconds)


def _restore(config: ml_collections.ConfigDict, spec: HeadsConfig, model_config: ModelConfig,
             optimizer: optax.GradientTransformation, manager: ocp.CheckpointManager,
             layout: sharding.Layout | None = None) -> tuple[int, dict]:
  """(step, state) of the latest checkpoint, or (0, the seeded initial state) before any;
  the initial state is also the template restored into. With a `layout`, replicated
  on its mesh (restored straight there: abstract arrays with that sharding)."""
  params = init_heads(spec, model_config, seed=config.seed).params
  state = {"params": params, "opt_state": optimizer.init(params)}
  start = manager.latest_step() or 0
  if start:
    target = state if layout is None else jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            layout.mesh, PartitionSpec())), state)
    state = manager.restore(start, args=ocp.args.StandardRestore(target))
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


def _final_evaluation(log: MetricsLog, step: int, params, reader: Reader, objective: Objective,
                      base: Params, batch_size: int) -> dict:
  """The held-out record at `step`: logged already by an earlier session of a finished
  run, else measured now and logged."""
  for record in log.records():
    if record["step"] == step and "heldout_topk" in record:
      return record
  record = {"step": step, **evaluate(params, reader, objective, base, batch_size)}
  log.write(record)
  return record


class _Progress:
  """The train records of a session (every `log_every` steps and at the last) and its
  progress bar: loss, each head's top-1 / top-5 accuracy and the simulated accepted
  length since the previous record, summed on the device so no step waits for the host."""

  def __init__(self, config: ml_collections.ConfigDict, log: MetricsLog, start: int,
               progress: bool, name: str, session_start: float):
    previous = [r["wall_s"] for r in log.records() if "wall_s" in r]
    self.wall_offset = previous[-1] if previous else 0.0  # the earlier sessions' time
    self.log, self.every, self.end = log, config.log_every, config.steps
    self.lr = lm.lr_schedule(config)
    self.bar = tqdm(total=config.steps, initial=start, disable=not progress, dynamic_ncols=True,
                    desc=name)
    self.session_start, self.last_step, self.sums = session_start, start, None

  def add(self, step: int, metrics: dict, last: bool = False) -> None:
    """Adds step `step`'s metrics; writes a record when one is due, or when `last`."""
    sums = {k: metrics[k] for k in ("loss", "hits", "count")}
    self.sums = sums if self.sums is None else jax.tree.map(jnp.add, self.sums, sums)
    if step % self.every and step != self.end and not last:
      return
    sums = distributed.to_host(self.sums)
    accuracy = sums["hits"] / np.maximum(sums["count"], 1)[:, None]  # [depth, len(BAR_TOP)]
    record = {"step": step, "loss": float(sums["loss"]) / (step - self.last_step),
              "grad_norm": float(metrics["grad_norm"]), "lr": float(self.lr(step - 1)),
              "top1": accuracy[:, 0].tolist(), "top5": accuracy[:, 1].tolist(),
              "accepted_length": accepted_length(accuracy[:, 0]), "wall_s": self.wall_seconds()}
    self.log.write(record)
    self.bar.update(step - self.last_step)
    self.bar.set_postfix(loss=f"{record['loss']:.3f}",
                         top1="/".join(f"{a:.2f}" for a in record["top1"]),
                         top5="/".join(f"{a:.2f}" for a in record["top5"]),
                         accepted=f"{record['accepted_length']:.2f}")
    self.last_step, self.sums = step, None

  def wall_seconds(self) -> float:
    return self.wall_offset + time.perf_counter() - self.session_start

  def close(self) -> None:
    self.bar.close()


# --- Plot, card, export -------------------------------------------------------------------


def plot_heads(records: list[dict], path: pathlib.Path, title: str) -> None:
  """Left: train and held-out loss against step. Right: each head's (unrolled step's)
  held-out top-1 (solid) and top-5 (dashed) accuracy."""
  require("matplotlib", "a training plot").use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  for key, style, label in (("loss", "-", "train"), ("heldout_loss", "o-", "held-out")):
    points = [(r["step"], r[key]) for r in records if key in r]
    if points:
      left.plot(*zip(*points), style, label=label, linewidth=1.2, markersize=3)
  left.set(xlabel="step", ylabel="loss", title=title)
  evaluations = [r for r in records if "heldout_topk" in r]
  for head in range(len(evaluations[0]["heldout_topk"]) if evaluations else 0):
    steps = [r["step"] for r in evaluations]
    line, = right.plot(steps, [r["heldout_topk"][head][0] for r in evaluations], "o-",
                       label=f"head {head + 1} top-1", markersize=3)
    right.plot(steps, [r["heldout_topk"][head][4] for r in evaluations], "s--",
               color=line.get_color(), label=f"head {head + 1} top-5", markersize=3)
  right.set(xlabel="step", ylabel="accuracy vs the model's greedy token", ylim=(0, 1),
            title="held-out")
  for axis in (left, right):
    axis.grid(alpha=0.3)
    if axis.has_data():
      axis.legend(fontsize=8)
  fig.tight_layout()
  partial = path.with_name(f".{path.name}.partial.png")
  fig.savefig(partial, dpi=110)
  plt.close(fig)
  os.replace(partial, path)


def model_card(name: str, spec: HeadsConfig, config: ml_collections.ConfigDict,
               run_data: RunData, heldout: dict, step: int, train_seconds: float,
               stopped_early: bool) -> str:
  """README.md of an export: base model, data, training, held-out numbers, usage."""
  kind = {"medusa": f"{spec.num_heads} Medusa heads of {spec.num_layers} residual block(s)",
          "eagle": f"An EAGLE-style head of {spec.num_layers} decoder layer(s)",
          "mtp": f"{spec.num_heads} parallel MTP heads of {spec.num_layers} decoder layer(s)"
          }[spec.family]
  label = "draft step" if spec.family == "eagle" else "head"
  strategy = "eagle" if spec.family == "eagle" else "medusa"  # mtp heads run under medusa
  table = "\n".join(f"| {i + 1} | " + " | ".join(f"{a:.3f}" for a in (*acc[:5], acc[9])) + " |"
                    for i, acc in enumerate(heldout["heldout_topk"]))
  return f"""# {name}

{kind} for `{spec.base_model}`, trained by self-distillation with `mdjax.train.heads`
(`python -m experiments.train_heads`): the base wrote its own training text, and the
heads learned to guess, from its final-norm hidden states, what it writes further ahead.

## Data

{_card_data(config, run_data)}

## Training

{_card_training(spec, config, step, train_seconds, stopped_early)}

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


def _card_data(config: ml_collections.ConfigDict, run_data: RunData) -> str:
  d, train, held = run_data.description, run_data.train, run_data.heldout
  if config.text_file:
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


def _card_training(spec: HeadsConfig, config: ml_collections.ConfigDict, step: int,
                   train_seconds: float, stopped_early: bool) -> str:
  device = jax.devices()[0]
  unit = "positions" if spec.family == "medusa" else "rows"
  unrolled = f", unrolled {config.unroll} steps" if config.unroll > 1 else ""
  return "\n".join([
      f"- {step} steps{' (stopped by the time budget)' if stopped_early else ''} of "
      f"{config.batch_size} {unit}; AdamW, lr {config.optim.lr} (warmup "
      f"{config.optim.warmup_steps}, cosine); loss `{config.loss}`, weights "
      f"{config.head_decay}^(k-1){unrolled}",
      f"- {train_seconds / 60:.1f} minutes on {device.platform} ({device.device_kind}, "
      f"{os.cpu_count()} CPU cores), Python {platform.python_version()}, seed {config.seed}"])


def export(heads: Heads, directory: pathlib.Path, *, config: ml_collections.ConfigDict,
           run_data: RunData, heldout: dict, step: int, train_seconds: float,
           stopped_early: bool) -> Heads:
  """Writes the heads with their held-out accuracies (`HeadsConfig.top_accuracy`), the
  model card and `heldout_prompts.json` into `directory`, replaced atomically (process 0
  writes; every process returns the heads once they are written)."""
  spec = dataclasses.replace(heads.config, top_accuracy=heldout["heldout_topk"])
  card = model_card(directory.name, spec, config, run_data, heldout, step, train_seconds,
                    stopped_early)
  heads = Heads(config=spec, params=heads.params, card=card, name=str(directory))
  if distributed.is_main_process():
    with atomic_directory(directory) as staging:
      save_heads(heads, staging, dtype=config.export_dtype)
      (staging / HELDOUT_FILE).write_text(json.dumps(run_data.heldout_prompts, indent=1) + "\n")
  distributed.barrier("heads export")
  return heads
