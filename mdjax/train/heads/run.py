"""Training multi-token-prediction heads over a frozen model by self-distillation.

The frozen model, the target, writes its own training text (`mdjax.generate` on a
prompt set, through its chat template), its hidden states over prompt + answer are
computed once and cached on disk, and the heads learn to guess, from those states
alone, what the target would write further ahead. The target's unembedding is a frozen
argument of the training step: only the heads' params are differentiated.

The jobs, one module each; this one is the run (`validate`, `train`), on the skeleton
every trainer shares (`mdjax.train.loop`: checks, config.json, optimizer, restore, the
loop)::

    mdjax.train.head_data      the heads' data set on disk (`make_head_data`): prompts
                               (built-in, files, the seeded split), self_instruct's grown
                               prompts, capture's answers and states, dataset's chunks
    mdjax.train.heads
      inputs                   the run's data and its cache -> features (the one writer)
      batches                  `Reader`: the batches of a split
      objective                the objective, the step, the held-out evaluation
      card                     the export and its model card
      run                      this module

One run lives in `run_dir`::

    run_dir/
      config.json
      cache/<key>/             the data (`inputs`), keyed by the target and everything
                               that shapes it; features/ as `features` lays it out
      checkpoints/<step>/      orbax: params + optimizer state, written atomically, last N kept
      metrics.jsonl            train loss, per-head top-1/top-5 accuracy, accepted length;
                               held-out top-1..top-10 accuracies, accepted length
      losses.png
      export/                  `mdjax.load_heads` reads it (+ heldout_prompts.json)

What each head learns at position p of a row (x: the tokens, h: the target's hidden
states, so that the target's own guess of x[p + 1] is lm_head(h[p])), each family's
`HeadFamily.loss` (`mdjax.heads.family`; its batch window: `HeadFamily.window`)::

    medusa head k   reads h[p]                        target x[p + 1 + k]  ("ce"), or the
                                                      law softmax(lm_head(h[p + k])) ("kl")
    eagle           reads (x[p + 1], h[p]), and the   h[p + 1] (smooth L1) and
                    heads' own features before p      x[p + 2] / lm_head(h[p + 1]) (weighted)
    mtp head k      reads h[0..p] (its attention)     as medusa head k
    eagle3          reads (x[p + 1], three of the     the model's greedy guesses of x[p + 2],
                    target's layers at p), unrolled   x[p + 3], ... ("ce", "greedy"), or its
                    on its own outputs                laws softmax(lm_head(h[p + 1])), ...
                                                      over the draft vocabulary ("kl"; the
                                                      training-time test, `mdjax.heads.eagle3`)

A data set written by `experiments/make_head_data.py` (`config.data.data_dir`: the
target's answers with their hidden states, `mdjax.train.head_data.dataset`) replaces the
generation and the target's passes: its rows become the run's cache, with the greedy
guesses the generation stored (on answers: a data set needs `mask_prompt`). Heads of a
family that takes one score a draft vocabulary (`config.draft_vocab_size`): the most
frequent tokens of the training answers (`mdjax.heads.vocab`), saved with the heads.
Accuracies and the simulated accepted length: `objective`.

Determinism: the split, the generation and the initial heads come from `config.seed`,
the batch of step i is a pure function of (seed, i), and the step is one jitted XLA
program without randomness. A run killed at any point (or stopped by `max_minutes`)
and restarted with the same `run_dir` resumes from its latest checkpoint and ends with
bitwise the parameters of an uninterrupted run.

Devices: `config.mesh = "data,tensor"` (e.g. "4,2"; "" = one device; `devices.device_mesh`)
puts the frozen target on a `("data", "tensor")` mesh (`mdjax.sharding`: it generates
and computes its features there), replicates the heads and their optimizer state,
splits each batch over "data", and traces the step under `sharding.active`. The heads'
checkpoints are the same arrays whatever the mesh, so a run resumes on any mesh.
A target passed to `train` already on a mesh trains there.

Many processes (`config.distributed`, `mdjax.distributed`; the same command on every
host, `run_dir` on a filesystem they share): the target lies on a mesh of every
process's devices, every process generates and runs the target's passes (they are
collective) but only process 0 writes the cache, the metrics, the plot and the export
(the others open the cache after a barrier), each process reads only its rows of
each batch (`devices.shard_batch`), and all of them save and restore the checkpoints
together: the losses are one process's, and a run resumes on any number of processes.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

import mdjax
from mdjax import distributed, sharding
from mdjax.errors import MdjaxError, check_count, check_real
from mdjax.heads import FAMILIES, HeadFamily, Heads, HeadsConfig, get_family, init_heads, vocab
from mdjax.heads.objective import LOSSES
from mdjax.models.model import Model
from mdjax.models.transformer import Params
from mdjax.train import devices, loop
from mdjax.train.config import HeadsTrainConfig, typed
from mdjax.train.heads.features import FEATURE_DTYPES
from mdjax.train.heads.batches import Reader
from mdjax.train.heads.card import export
from mdjax.train.heads.inputs import RunData, draft_vocabulary, prepare_data
from mdjax.train.heads.objective import (accuracies, evaluate, make_train_step, objective_of,
                                         unembedding)
from mdjax.train.metrics import MetricsLog, plot_losses

# the heads' own fields that count something (`loop.validate` checks them with its own)
COUNTS = ("num_heads", "num_layers", "eagle.unroll", "data.samples_per_prompt",
          "data.max_new_tokens", "data.generation_batch", "data.text_row_tokens",
          "data.feature_batch")


def validate(config: ml_collections.ConfigDict | HeadsTrainConfig) -> HeadsTrainConfig:
  """`config` typed (`mdjax.train.config.typed`), its values checked (`loop.validate`,
  then the heads' own): rejects those the run cannot work with, naming them, before any
  model is loaded."""
  config = typed(HeadsTrainConfig, config)
  loop.validate(config, COUNTS)
  family = get_family(config.family)
  if config.loss not in LOSSES:
    raise MdjaxError(f"config.loss must be one of {', '.join(LOSSES)}, got {config.loss!r}")
  if config.data.feature_dtype not in FEATURE_DTYPES:
    raise MdjaxError(f"config.data.feature_dtype must be one of {', '.join(FEATURE_DTYPES)}, "
                     f"got {config.data.feature_dtype!r}")
  _check_family(config, family)
  _check_data(config)
  check_real("config.max_minutes", config.max_minutes, 0.0)
  check_real("config.head_decay", config.head_decay, 0.0)
  for name in ("regression_weight", "token_weight"):
    check_real(f"config.eagle.{name}", getattr(config.eagle, name), 0.0)
  return config


def _check_family(config: HeadsTrainConfig, family: HeadFamily) -> None:
  """The fields that depend on the family: one head or K, the unroll, a draft vocabulary."""
  eagle = config.eagle
  if family.sequential and config.num_heads != 1:
    raise MdjaxError(f"an {config.family} head drafts one token at a time: config.num_heads must "
                     f"be 1, got {config.num_heads} (config.eagle.unroll trains deeper drafts)")
  if not family.sequential and eagle.unroll != 1:
    sequential = " and ".join(name for name, f in FAMILIES.items() if f.sequential)
    raise MdjaxError(f"config.eagle.unroll is {sequential}'s; {config.family} needs 1, got "
                     f"{eagle.unroll}")
  check_count("config.eagle.eval_unroll", eagle.eval_unroll, 0)
  if not family.sequential and eagle.eval_unroll:
    raise MdjaxError(f"config.eagle.eval_unroll is for heads that draft one token at a time; "
                     f"{config.family} needs 0, got {eagle.eval_unroll}")
  check_count("config.draft_vocab_size", config.draft_vocab_size, 0)
  if config.draft_vocab_size and not family.draft_vocabulary:
    takers = ", ".join(name for name, f in FAMILIES.items() if f.draft_vocabulary)
    raise MdjaxError(f"config.draft_vocab_size: {config.family} heads score the whole vocabulary "
                     f"(a draft vocabulary is for {takers} heads); set it to 0")


def _check_data(config: HeadsTrainConfig) -> None:
  """The data's sources exclude each other; a data set needs `mask_prompt`."""
  data = config.data
  if data.data_dir and (data.prompts or data.text_file):
    raise MdjaxError("config.data.data_dir is the data: leave config.data.prompts and "
                     "config.data.text_file empty")
  if data.data_dir and not config.mask_prompt:
    raise MdjaxError("a data set (config.data.data_dir) stores the target's greedy guesses on "
                     "answers only: train on it with config.mask_prompt=True")
  if data.prompts and data.text_file:
    raise MdjaxError("config.data.prompts and config.data.text_file are exclusive: prompts make "
                     "the target write the data, a text file is the data")
  check_real("config.data.temperature", data.temperature, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run(loop.Run):
  """What a finished `train` hands back (`loop.Run`: data, step, ...) and what it made."""

  data: RunData
  heads: Heads  # as exported: held-out accuracies in its config, the card
  heldout: dict  # the final `evaluate` record
  export_dir: pathlib.Path


def train(config: ml_collections.ConfigDict | HeadsTrainConfig, *, model: Model | None = None,
          progress: bool = True) -> Run:
  """Prepares the data (or finds it cached), trains or resumes the heads up to
  `config.steps` (or `max_minutes`), evaluates them on the held-out prompts and exports
  them. `config`: a user's ConfigDict (`configs/heads_common.py`), typed and checked here
  (`validate`). `model`: the target, already loaded (default: `mdjax.load(config.model)`);
  put on `config.mesh` when it names one."""
  session_start = time.perf_counter()
  config = validate(config)
  progress = progress and distributed.is_main_process()
  run_dir = pathlib.Path(config.run_dir)
  loop.write_config(config, run_dir)
  mesh = devices.device_mesh(config.mesh, config.batch_size)
  target = (on_mesh(model, mesh) if model is not None else
            mdjax.load(config.model, dtype=config.model_dtype, mesh=mesh))
  layout = target.layout
  if layout is not None and config.batch_size % layout.mesh.shape["data"]:
    raise MdjaxError(f"config.batch_size ({config.batch_size}) must be a multiple of the "
                     f"target's mesh's data axis ({layout.mesh.shape['data']})")
  family = get_family(config.family)
  spec = heads_config(config, family, target)
  continued = continued_heads(config, spec, family, target)
  run_data = prepare_data(config.data, target, run_dir, seed=config.seed,
                          heldout_fraction=config.heldout_fraction, target_name=config.model,
                          layers=family.target_layers(spec), progress=progress,
                          teacher=config.loss == "kl" and bool(family.target_layers(spec)))
  if continued is not None and "draft_ids" in continued.params:
    draft_ids = np.asarray(continued.params["draft_ids"])  # the vocabulary they were trained on
  else:
    draft_ids = (draft_vocabulary(config.draft_vocab_size, run_data, target.config.vocab_size)
                 if config.draft_vocab_size else None)
  objective = objective_of(config, family, target.config)
  optimizer = loop.make_optimizer(config)
  manager = loop.checkpoint_manager(config, run_dir)
  start, state = _restore(config.seed, spec, family, target, optimizer, manager, draft_ids,
                          continued)
  log = MetricsLog(run_dir / "metrics.jsonl")
  log.truncate_after(start)
  frozen = unembedding(target)
  if draft_ids is not None:  # frozen beside the target's: not trained
    frozen["draft_ids"] = jnp.asarray(draft_ids)
    frozen["draft_unembedding"] = vocab.unembedding_columns(frozen, frozen["draft_ids"])
  window = family.window(config.num_heads)
  train_reader, heldout_reader = (Reader(f, window, config.mask_prompt)
                                  for f in (run_data.train, run_data.heldout))
  scored = dataclasses.replace(objective, depth=config.eagle.eval_unroll or objective.depth)
  evaluation = lambda params: evaluate(params, heldout_reader, scored, frozen, config.batch_size)
  hooks = loop.Hooks(
      step=make_train_step(objective, optimizer, devices.state_shardings(state, layout)),
      extra=frozen, evaluate=evaluation,
      batch=lambda i, rows: train_reader.batch(config.seed, i, config.batch_size, rows),
      plot=functools.partial(plot_losses, path=run_dir / "losses.png", title=run_dir.name,
                             loss_label="loss", accuracy_title="held-out",
                             accuracy_label="accuracy vs the model's greedy token"),
      fields=accuracies, summed=("loss", "hits", "count"))
  if continued is not None:  # where continued heads start: the held-out curve's first point
    with sharding.active(layout):
      heldout_record(log, 0, trained_params(continued), evaluation)
  outcome = loop.run(config, hooks, state, start=start, end=config.steps, manager=manager,
                     log=log, layout=layout, name=run_dir.name, progress=progress,
                     max_minutes=config.max_minutes, session_start=session_start)
  with sharding.active(layout):
    heldout = heldout_record(log, outcome.step, outcome.state["params"], evaluation)
  directory = pathlib.Path(config.export_dir or run_dir / "export")
  params = outcome.state["params"]
  if draft_ids is not None:
    params = {**params, "draft_ids": jnp.asarray(draft_ids)}
  heads = export(Heads(config=spec, params=params), directory, family=family, config=config,
                 run_data=run_data, heldout=heldout, outcome=outcome, records=log.records())
  return Run(heads=heads, step=outcome.step, heldout=heldout, export_dir=directory,
             data=run_data, stopped_early=outcome.stopped_early,
             train_seconds=outcome.train_seconds)


def _restore(seed: int, spec: HeadsConfig, family: HeadFamily, target: Model,
             optimizer: optax.GradientTransformation, manager: ocp.CheckpointManager,
             draft_ids: np.ndarray | None, continued: Heads | None) -> tuple[int, dict]:
  """(step, state) of the latest checkpoint, or (0, the initial state) before any
  (`loop.restore`: on the target's mesh, replicated): the `continued` heads' params, else
  seeded ones, and a fresh optimizer state. The params trained are the heads' floats: a
  draft vocabulary (`draft_ids`) stays out."""
  if continued is not None:
    params = trained_params(continued)
  else:
    ids = np.arange(target.config.vocab_size) if draft_ids is None else draft_ids
    params = family.restrict(init_heads(spec, target.config, seed=seed).params, ids,
                             distributed.to_host(target.params))
  initial = {"params": params, "opt_state": optimizer.init(params)}
  return loop.restore(manager, initial, target.layout, by_rules=False)


def continued_heads(config: HeadsTrainConfig, spec: HeadsConfig, family: HeadFamily,
                    target: Model) -> Heads | None:
  """`config.init_from`'s heads in float32, checked to be the run's (`spec`: family,
  shape, target layers, draft vocabulary size) and to run on `target`; None when it is
  empty. `MdjaxError` naming each field that differs."""
  if not config.init_from:
    return None
  heads = mdjax.load_heads(config.init_from)
  fields = ("family", "hidden_size", "vocab_size", "num_heads", "num_layers", "own_unembedding",
            "draft_vocab_size", "target_layers")
  differ = [f"{name} {getattr(heads.config, name)!r} (the run's: {getattr(spec, name)!r})"
            for name in fields if getattr(heads.config, name) != getattr(spec, name)]
  if differ:
    raise MdjaxError(f"config.init_from {config.init_from!r}: not the heads this run trains: "
                     + "; ".join(differ))
  family.check(heads, target.config)
  return heads


def heads_config(config: HeadsTrainConfig, family: HeadFamily, target: Model) -> HeadsConfig:
  """The trained heads' config, before any accuracy is measured."""
  c = target.config
  return HeadsConfig(family=config.family, base_model=target.name or config.model,
                     base_family=c.family, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                     num_heads=config.num_heads, num_layers=config.num_layers,
                     own_unembedding=family.owns_unembedding and config.own_unembedding,
                     draft_vocab_size=config.draft_vocab_size,
                     target_layers=family.layers_for(c))


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


def trained_params(heads: Heads) -> Params:
  """What a run trains of `heads`: their floats, the draft vocabulary (`draft_ids`) out."""
  return {name: value for name, value in heads.params.items() if name != "draft_ids"}


def heldout_record(log: MetricsLog, step: int, params: Params, evaluation) -> dict:
  """The held-out record at `step`: logged already (by `loop.run`, or by an earlier
  session of the run), else measured now and logged."""
  for record in log.records():
    if record["step"] == step and "heldout_topk" in record:
      return record
  record = {"step": step, **evaluation(params)}
  log.write(record)
  return record
