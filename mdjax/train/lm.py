"""Causal LM training over mdjax's own transformer (`causal_logits`).

One run lives in `run_dir`::

    run_dir/
      config.json          the training config (`LMTrainConfig`, as JSON)
      heldout_files.json   data root, python version, the held-out relative paths
      tokenizer/           tokenizer.json + tokenizer_config.json (trained here unless
                           `config.tokenizer` names an existing one)
      checkpoints/<step>/  orbax: params + optimizer state, written atomically, last N kept
      metrics.jsonl        train loss (mean since the last record), grad norm, lr,
                           tokens per s; held-out loss, top-1 accuracy, nats per byte,
                           the same on held-out copy rows, how many of those a greedy
                           decode would copy (`evaluate_copying`), and the copying of
                           random ids (`evaluate_induction`)
      loss.png             the loss curves, and the evaluations' accuracies beside them
      export/              Hugging Face format (see `mdjax.train.export`)

Determinism: the initial params come from `config.seed`, the batch of step i is a
pure function of (seed, i) (`data.Batches`), and the step is one jitted XLA program.
The model has no dropout, so the step itself draws no random numbers. Hence a run
killed at any point and restarted from its latest checkpoint ends with bitwise the
same parameters as a run that was never interrupted.

Devices: `config.mesh = "data,tensor"` (e.g. "2,4"; "" = one device, no mesh) trains
on a `("data", "tensor")` mesh of all the devices (`device_mesh`). The params and the
optimizer's moments are laid out by `mdjax.sharding` (with tensor > 1 the fused
`wqkv` / `w_gate_up` split, the vocabulary rows zero-padded to a multiple of the tensor
size, every matrix sharded by the rules table), step counts replicated, each batch
split over "data", and the step traced under `sharding.active` so the model's own
constraints apply. Padded vocabulary rows get no gradient (`lm_head` cuts them from the
logits, no token embeds them), so Adam and the weight decay leave them at zero.
Checkpoints always hold the one-device layout (`checkpoint_state`), so a run resumes on
any mesh, or on one device, whatever wrote its checkpoint: the mesh's losses are the
one device's up to float reassociation, and a resume on the same mesh is bitwise.

Many processes (`config.distributed`, `mdjax.distributed`; the same command on every
host, `run_dir` on a filesystem they share): the mesh spans every process's devices,
each process builds only its rows of each batch (`devices.shard_batch`), all of them
save and restore the checkpoints together, and only process 0 writes the run files,
the tokenizer, the metrics and the plot (the others read what they need of them after
a barrier). The global batch is the one-process batch, so the losses are one process's
on the same mesh, and a run resumes on any number of processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import platform

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from mdjax import distributed, files, losses, programs, sharding
from mdjax.checkpoints import hf
from mdjax.errors import MdjaxError
from mdjax.models.config import ModelConfig
from mdjax.models.random_init import init_params
from mdjax.models.transformer import Params, causal_logits
from mdjax.train import data, devices, distill, loop
from mdjax.train import tokenizer as tokenizer_lib
from mdjax.train.config import LMTrainConfig, typed
from mdjax.train.loop import make_optimizer
from mdjax.train.metrics import MetricsLog, plot_losses

def model_config(config: LMTrainConfig, vocab_size: int) -> ModelConfig:
  """The llama architecture of `config.model` over the tokenizer's vocabulary.

  Context length = `seq_len`: positions past what training saw are not trusted.
  """
  return ModelConfig(family="llama", vocab_size=vocab_size, **dataclasses.asdict(config.model),
                     max_position_embeddings=config.seq_len, rms_norm_eps=1e-6,
                     bos_token_id=0, eos_token_id=(1,), pad_token_id=2)


def token_losses(params: Params, sequences: jax.Array, config: ModelConfig):
  """Per-token loss and top-1 prediction for the targets of `sequences` `[B, T + 1]`
  (target j is token j + 1): both `[B, T]`."""
  logits = causal_logits(params, sequences[:, :-1], config=config)  # [B, T, V]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, sequences[:, 1:])
  return losses, jnp.argmax(logits, axis=-1)


def make_train_step(config: ModelConfig, optimizer: optax.GradientTransformation,
                    teacher: distill.Teacher | None = None, shardings=None):
  """`step(state, batch, teacher_params=None) -> (state, metrics)`, jitted, `state` donated.

  state: {"params", "opt_state"}; batch: int32 `[B, T + 1]`. With a `teacher`, the loss
  mixes cross-entropy and the KL to the teacher (`mdjax.train.distill`); pass its
  params as `teacher_params`. `shardings` (a tree of shardings like `state`, on a
  mesh): the new state is kept on them, so every step (and checkpoint) sees one layout.
  Call the step under `sharding.active(layout)` on a mesh.
  """

  def loss_fn(params, batch, teacher_params):
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = causal_logits(params, inputs, config=config)  # [B, T, V]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    if teacher is None:
      return loss, {}
    guide = distill.teacher_logits(teacher, teacher_params, inputs)
    kl = losses.kl_to_teacher(logits, guide, teacher.temperature).mean()
    return (1 - teacher.weight) * loss + teacher.weight * kl, {}

  return loop.make_train_step(loss_fn, optimizer, shardings)


def evaluate(params: Params, sequences: np.ndarray, config: ModelConfig, batch_size: int,
             first_target: int = 0) -> dict[str, float]:
  """Mean loss (nats per token) and top-1 next-token accuracy over `sequences`' targets
  from index `first_target` on (target j is token j + 1)."""
  losses, predicted = token_scores(params, sequences, config, batch_size)
  correct = predicted == sequences[:, 1:]
  return {"loss": float(losses[:, first_target:].mean()),
          "accuracy": float(correct[:, first_target:].mean())}


COPY_SHOWN, COPY_RUN = 4, 32  # the greedy-copy metric: 4 repeated tokens given, 32 to copy


def evaluate_copying(params: Params, sequences: np.ndarray, config: ModelConfig,
                     batch_size: int) -> dict[str, float]:
  """How well the model repeats text it was just shown, on `sequences` turned into copy
  rows (`data.repeat_first_half`)::

      tokens:         a0 a1 ... a(h-1) | a0 a1 a2 a3 a4 ... a35 a36 ... a(h-1)
      loss, accuracy:                        ^^ ^^ ^^ ^^ ... ^^^ ^^^ ... ^^^^^^
      greedy_copy:                                   ^^ ... ^^^    (all 32 right?)

  loss / accuracy: `evaluate` over the repeated half. A model that copies scores ~0 and
  ~1; one that does not scores about its plain held-out numbers.
  greedy_copy: the share of rows whose 32 tokens after the first 4 of the repeat are all
  top-1 right, i.e. given the original and 4 tokens of its repeat, greedy decoding goes
  on copying for 32 tokens. A per-token accuracy of 0.7 can hide a greedy_copy of 0:
  a greedy copy needs every token right (fewer than 32 when the half is shorter).
  """
  half = data.first_half(sequences.shape[1])
  rows = data.repeat_first_half(sequences)
  losses, predicted = token_scores(params, rows, config, batch_size)
  correct = predicted == rows[:, 1:]
  return {"loss": float(losses[:, half:].mean()), "accuracy": float(correct[:, half:].mean()),
          "greedy_copy": float(greedy_copied(correct, half).mean())}


def greedy_copied(correct: np.ndarray, half: int) -> np.ndarray:
  """`[N]` bool from the correctness `[N, T]` of copy rows repeating their first `half`
  tokens: are the targets of the 32 tokens after the repeat's first 4 all right?"""
  return correct[:, half + COPY_SHOWN - 1:half + COPY_SHOWN - 1 + COPY_RUN].all(axis=1)


def evaluate_induction(params: Params, config: ModelConfig, batch_size: int,
                       rows: int = 16, alphabet: int = 0) -> float:
  """Top-1 accuracy on the repeat of blocks of random ids shown twice::

      tokens:  r0 r1 ... r(L-1) | r0 r1 r2 ... r(L-1)      (L = 64, or half the context)
      scored:                        ^^ ^^ ... ^^^^^^

  Text gives a model other cues (the repeat of code is half-predictable anyway); random
  ids give none, so only an induction mechanism (find the earlier occurrence of the
  current id, copy the one after it) scores above chance (1 / vocab_size). The blocks
  are fixed (seed 0), so every evaluation and every model sees the same ones.
  `alphabet` > 0: blocks over that many ids each (`induction_rows`).
  """
  sequences, block = induction_rows(config, rows, alphabet)
  _, predicted = token_scores(params, sequences, config, batch_size)
  return float((predicted == sequences[:, 1:])[:, block:].mean())


def induction_rows(config: ModelConfig, rows: int = 16, alphabet: int = 0,
                   common_share: float = 0.0, phrase_rate: float = 0.0) -> tuple[np.ndarray, int]:
  """`evaluate_induction`'s rows `[rows, 2 L]` (fixed blocks of L random ids, each shown
  twice) and L. `alphabet` = k > 0 draws each block from k ids of its own (also fixed), so
  ids recur in the block and copying needs the ids before the current one too.
  `common_share` = p > 0 then puts one of the block's 2..8 common ids at each position
  with probability p (`data.with_common_ids`): the same need after each common id.
  `phrase_rate` = q > 0 then writes the block's phrases of 2..4 ids over it
  (`data.with_phrases`): after a phrase only a match longer than it says where to copy."""
  block = min(64, config.max_position_embeddings // 2)
  rng = np.random.default_rng(0)
  if not alphabet:
    ids = rng.integers(data.FIRST_RANDOM_ID, config.vocab_size, (rows, block))
  else:
    ids = np.stack([rng.choice(data.random_alphabet(rng, config.vocab_size, alphabet), block)
                    for _ in range(rows)])
  if common_share:
    ids = np.stack([data.with_common_ids(rng, row, config.vocab_size, common_share)
                    for row in ids])
  if phrase_rate:
    ids = np.stack([data.with_phrases(rng, row, config.vocab_size, phrase_rate) for row in ids])
  return np.concatenate([ids, ids], axis=1), block


def token_scores(params: Params, sequences: np.ndarray, config: ModelConfig,
                 batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """`token_losses` of `sequences` `[N, T + 1]`, `batch_size` rows at a time (one
  compilation per shape): float64 losses and int top-1 predictions, both `[N, T]`."""
  losses, predicted = [], []
  for start in range(0, len(sequences), batch_size):
    loss, top = distributed.to_host(_token_losses_jit(
        params, jnp.asarray(sequences[start:start + batch_size]), config))
    losses.append(np.asarray(loss, np.float64))
    predicted.append(np.asarray(top))
  return np.concatenate(losses), np.concatenate(predicted)


_token_losses_jit = programs.jit(token_losses, static_argnames="config")


@dataclasses.dataclass(frozen=True)
class Data:
  """Everything the loop reads: batches, the fixed held-out subset, unit conversions."""

  batches: data.Batches
  heldout: np.ndarray  # [eval_sequences, seq_len + 1]
  heldout_bytes_per_token: float  # of the subset's targets: loss / this = nats per byte
  train_tokens: int


def prepare_data(config: LMTrainConfig, corpus: data.Corpus, fast_tokenizer) -> Data:
  """Tokenizes and packs both splits; the held-out subset is evenly spaced and fixed."""
  eos = fast_tokenizer.token_to_id(tokenizer_lib.EOS)
  train = data.token_stream(corpus.texts("train"), fast_tokenizer, eos)
  heldout = data.pack(data.token_stream(corpus.texts("heldout"), fast_tokenizer, eos),
                      config.seq_len)
  picked = heldout[np.unique(np.linspace(0, len(heldout) - 1, config.eval_sequences).astype(int))]
  target_bytes = tokenizer_lib.token_byte_lengths(fast_tokenizer)[picked[:, 1:]]  # [E, T]
  return Data(batches=data.Batches(data.pack(train, config.seq_len), config.batch_size,
                                   config.seed, data.RowMix.from_config(config),
                                   fast_tokenizer.get_vocab_size()),
              heldout=picked, heldout_bytes_per_token=float(target_bytes.mean()),
              train_tokens=len(train))


def evaluate_heldout(params: Params, config: ModelConfig, run_data: Data, batch_size: int,
                     teacher: distill.Teacher | None = None) -> dict[str, float]:
  """Every held-out number a run logs and an export records, on `run_data.heldout`:
  loss, top-1 accuracy and nats per byte (`evaluate`), the same on its copy rows and
  their greedy copies (`evaluate_copying`), the copying of random ids
  (`evaluate_induction`) and, with a `teacher`, the argmax agreement with it."""
  plain = evaluate(params, run_data.heldout, config, batch_size)
  copying = evaluate_copying(params, run_data.heldout, config, batch_size)
  record = {"heldout_loss": plain["loss"], "heldout_accuracy": plain["accuracy"],
            "heldout_nats_per_byte": plain["loss"] / run_data.heldout_bytes_per_token,
            "heldout_copy_loss": copying["loss"], "heldout_copy_accuracy": copying["accuracy"],
            "heldout_greedy_copy": copying["greedy_copy"],
            "random_copy_accuracy": evaluate_induction(params, config, batch_size)}
  if teacher:
    record["heldout_teacher_agreement"] = distill.agreement(params, config, teacher,
                                                            run_data.heldout, batch_size)
  return record


def load_or_train_tokenizer(config: LMTrainConfig, corpus: data.Corpus,
                            run_dir: pathlib.Path):
  """`config.tokenizer` if set, else the run's own (trained on the train split once, by
  process 0: the others wait, then read it)."""
  if config.tokenizer:
    return tokenizer_lib.load(config.tokenizer)
  directory = run_dir / "tokenizer"
  if distributed.is_main_process() and not (directory / "tokenizer.json").is_file():
    tokenizer_lib.save(tokenizer_lib.train_bpe(corpus.texts("train"), config.vocab_size), directory)
  distributed.barrier("tokenizer")
  return tokenizer_lib.load(directory)


def initial_params(config: LMTrainConfig, cfg: ModelConfig) -> Params:
  """Seeded random weights, or float32 copies of `config.init_from`'s (same architecture).

  A tied start may continue untied (`tie_word_embeddings=False`): its `lm_head` `[D, V]`
  starts as a copy of `embed.T`, so the logits are unchanged until training moves them
  apart (the input embeddings then no longer carry the output's push on every id).
  """
  if not config.init_from:
    return init_params(cfg, config.seed)
  start = hf.load_hf_dir(config.init_from, dtype="float32")
  untie = start.config.tie_word_embeddings and not cfg.tie_word_embeddings
  fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim") + (() if untie else ("tie_word_embeddings",))
  differ = [f"{f}: {getattr(start.config, f)} vs {getattr(cfg, f)}" for f in fields
            if getattr(start.config, f) != getattr(cfg, f)]
  if differ:
    raise MdjaxError(f"init_from {config.init_from!r} does not match the config's model "
                     f"({'; '.join(differ)})")
  if untie:
    return {**start.params, "lm_head": jnp.array(start.params["embed"].T)}
  return start.params


def _write_run_files(config: LMTrainConfig, corpus: data.Corpus, run_dir: pathlib.Path) -> None:
  """`config.json` (`loop.write_config`) and `heldout_files.json` (process 0)."""
  loop.write_config(config, run_dir)
  if distributed.is_main_process():
    files.write_text(run_dir / "heldout_files.json", json.dumps(
        {"root": str(corpus.root), "python": platform.python_version(),
         "train_files": len(corpus.train), "heldout": list(corpus.heldout)}, indent=1) + "\n")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run(loop.Run):
  """What a finished `train` hands back (`loop.Run`: data, step, ...) and what made it."""

  config: LMTrainConfig
  params: Params  # on a mesh, its layout (`sharding.one_device_layout` gives one device's)
  model_config: ModelConfig
  tokenizer: object  # transformers.PreTrainedTokenizerFast
  corpus: data.Corpus
  teacher: distill.Teacher | None = None  # the model it was distilled from, if any
  layout: sharding.WeightPlacement | None = None  # the mesh it trained on (config.mesh), if any


def validate(config: ml_collections.ConfigDict | LMTrainConfig) -> LMTrainConfig:
  """`config` typed (`mdjax.train.config.typed`), its values checked (`loop.validate`,
  then the LM's own): rejects those the loop cannot run with, naming them, before any
  data is read."""
  config = typed(LMTrainConfig, config)
  loop.validate(config, counts=("seq_len", "eval_sequences"))
  data.RowMix.from_config(config).check(config.seq_len + 1)
  if config.export_shard_mb < 0:
    raise MdjaxError(f"config.export_shard_mb must be >= 0 (0: one file), got "
                     f"{config.export_shard_mb}")
  return config


def train(config: ml_collections.ConfigDict | LMTrainConfig, *, progress: bool = True,
          restore_only: bool = False) -> Run:
  """Trains (or resumes) up to `config.steps`; returns the final params and what made them.

  `config`: a user's ConfigDict (`configs/lm_common.py`), typed and checked here
  (`validate`). `restore_only`: run no step, return the latest checkpoint's params (for
  an export), or, before any checkpoint, `init_from`'s as they are (step 0: e.g. a soup
  or a grown model exported with a card and held-out numbers like any trained one).
  """
  config = validate(config)
  progress = progress and distributed.is_main_process()
  run_dir = pathlib.Path(config.run_dir)
  corpus, tokenizer, run_data = _prepare_run(config, run_dir)
  cfg = model_config(config, tokenizer.backend_tokenizer.get_vocab_size())
  layout = sharding.layout_for(devices.device_mesh(config.mesh, config.batch_size), cfg)
  optimizer = make_optimizer(config)
  manager = loop.checkpoint_manager(config, run_dir)
  start, state = restore_state(config, cfg, optimizer, manager, layout)
  if restore_only and not start and not config.init_from:
    raise MdjaxError(f"no checkpoint to export in {str(run_dir / 'checkpoints')!r} and no "
                     "init_from")
  log = MetricsLog(run_dir / "metrics.jsonl")
  log.truncate_after(start)
  teacher = distill.load_teacher(config, cfg)
  teacher_params = teacher and (teacher.params if layout is None else sharding.WeightPlacement(
      mesh=layout.mesh, config=teacher.config).place(teacher.params))
  tokens_per_step = config.batch_size * config.seq_len
  hooks = loop.Hooks(
      step=make_train_step(cfg, optimizer, teacher, devices.state_shardings(state, layout)),
      extra=teacher_params, batch=run_data.batches.batch,
      evaluate=lambda params: evaluate_heldout(params, cfg, run_data, config.batch_size, teacher),
      plot=functools.partial(plot_losses, path=run_dir / "loss.png", title=run_dir.name),
      fields=functools.partial(_rates, tokens_per_step),
      saved=lambda state: devices.checkpoint_state(state, cfg, layout))
  end = start if restore_only else config.steps
  outcome = loop.run(config, hooks, state, start=start, end=end, manager=manager, log=log,
                     layout=layout, name=run_dir.name, progress=progress)
  return Run(config=config, params=outcome.state["params"], model_config=cfg,
             tokenizer=tokenizer, corpus=corpus, data=run_data, step=outcome.step,
             stopped_early=outcome.stopped_early, train_seconds=outcome.train_seconds,
             teacher=teacher, layout=layout)


def _prepare_run(config: LMTrainConfig,
                 run_dir: pathlib.Path) -> tuple[data.Corpus, object, Data]:
  """Creates `run_dir` and its run files; loads the corpus, the tokenizer and the data."""
  corpus = data.load_corpus(config.data_dir, config.data_pattern, config.heldout_fraction)
  _write_run_files(config, corpus, run_dir)
  tokenizer = load_or_train_tokenizer(config, corpus, run_dir)
  return corpus, tokenizer, prepare_data(config, corpus, tokenizer.backend_tokenizer)


def restore_state(config: LMTrainConfig, cfg: ModelConfig,
                  optimizer: optax.GradientTransformation, manager: ocp.CheckpointManager,
                  layout: sharding.WeightPlacement | None = None) -> tuple[int, dict]:
  """(step, state) of the latest checkpoint, or (0, the initial state) before any; on
  `layout`'s mesh when given, the params laid out by the rules (`loop.restore`).
  state: {"params", "opt_state"}; the initial one is `initial_params`'."""
  params = initial_params(config, cfg)
  return loop.restore(manager, {"params": params, "opt_state": optimizer.init(params)}, layout)


def _rates(tokens_per_step: int, sums: dict, step: int, steps: int,
           seconds: float) -> tuple[dict, dict]:
  """`loop.Hooks.fields`: the tokens per second since the previous record, the tokens seen."""
  rate = tokens_per_step * steps / seconds
  return {"tokens_per_s": rate, "tokens_seen": step * tokens_per_step}, {"tok_s": f"{rate:.0f}"}
