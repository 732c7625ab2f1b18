"""What the trainers share (`mdjax.train.lm`, `mdjax.train.heads`): the checks of the
fields every config has (`validate`), the run's `config.json`, the optimizer and its
schedule (one weight-decay rule, `decayed`), the jitted step, checkpoints and resume
(`restore`), the loop itself (`run`), which calls a trainer's `Hooks` and keeps a
session's records, plot and progress bar, and what a finished run hands back (`Run`).

    trainer.train(config)
      validate(config)  ->  write_config  ->  the trainer's data, params  ->  restore
      ->  run(config, Hooks)  ->  Outcome  ->  the trainer's export  ->  its Run

A step is one XLA program that draws no random numbers, and a batch is a function of
(seed, step): restarted from its latest checkpoint, a run ends with bitwise the
parameters of an uninterrupted one. The records of a session go to `metrics.jsonl`::

    step --- log_every --- step --- log_every --- ... --- end (or the last step run)
    {"step", "loss": the mean since the previous record, "grad_norm", "lr",
     <the trainer's fields>, "wall_s": every session's seconds, summed}

and so do the evaluations, when due (`eval_every` steps apart, at the end, at a stop):
{"step", <the trainer's held-out fields>}.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from absl import flags
from tqdm import tqdm

from mdjax import distributed, files, sharding
from mdjax.errors import MdjaxError, check_count
from mdjax.models.config import weight_dtype
from mdjax.models.transformer import Params
from mdjax.train import devices
from mdjax.train.config import TrainConfig, to_json
from mdjax.train.metrics import MetricsLog

# the fields of every config that count something (>= 1)
COUNTS = ("steps", "batch_size", "log_every", "eval_every", "checkpoint_every",
          "keep_checkpoints")

# (params, batch, extra) -> (loss, metrics summed into the records); extra: frozen inputs
LossFn = Callable[[Params, jax.Array, object], tuple[jax.Array, dict]]


def validate(config: TrainConfig, counts: tuple[str, ...] = ()) -> None:
  """Checks the fields every trainer's config has (`TrainConfig`) and the trainer's own
  `counts` (dotted paths, e.g. "data.feature_batch": each must be >= 1), naming the
  first bad one, before any data is read."""
  if not config.run_dir:
    raise MdjaxError("config.run_dir is required (where the run's checkpoints, metrics and "
                     "export go)")
  for name in COUNTS + counts:
    check_count(f"config.{name}", functools.reduce(getattr, name.split("."), config), 1)
  if not 0 < config.heldout_fraction < 1:
    raise MdjaxError(f"config.heldout_fraction must be in (0, 1), got {config.heldout_fraction}")
  weight_dtype(config.export_dtype)  # fails now, not at the export after training
  devices.device_mesh(config.mesh, config.batch_size)


def write_config(config: TrainConfig, run_dir: pathlib.Path) -> None:
  """Creates `run_dir` and writes the typed config into its `config.json` (process 0)."""
  run_dir.mkdir(parents=True, exist_ok=True)
  if distributed.is_main_process():
    files.write_text(run_dir / "config.json", to_json(config))


def lr_schedule(config: TrainConfig) -> optax.Schedule:
  """Linear warmup to `optim.lr`, then cosine decay to `lr * min_lr_ratio` at `steps`."""
  o = config.optim
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
      decay_steps=max(config.steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)


def decayed(params: Params) -> Params:
  """The weight-decay mask: every leaf of two axes or more, not counting the layer axis
  of layers stacked for a scan (`params["layers"]` a dict of `[L, ...]` leaves, where a
  norm is `[L, D]`). For an LM these are its matrices (embed, projections fused or
  split, lm_head), never its norms or biases, in either layer layout; for heads their
  matrices, and also the biases and norms a family stacks per head (medusa's `b`
  [K, 1, D], mtp's norms [K, D]): the rule each trainer had, one rule for both."""

  def is_matrix(path, leaf) -> bool:
    stacked = any(isinstance(key, jax.tree_util.DictKey) and key.key == "layers"
                  and isinstance(after, jax.tree_util.DictKey)
                  for key, after in zip(path, path[1:]))
    return leaf.ndim - stacked >= 2

  return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW under `lr_schedule`, with weight decay on the
  params `decayed` marks."""
  o = config.optim
  return optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(lr_schedule(config), b1=o.b1, b2=o.b2,
                                 weight_decay=o.weight_decay, mask=decayed))


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, shardings=None):
  """`step(state, batch, extra=None) -> (state, metrics)`, jitted, `state` donated.

  state: {"params", "opt_state"}; only the params are differentiated, `extra` (a frozen
  model's weights, say) is an argument so that jit does not bake it in as a constant.
  metrics: "loss", "grad_norm" and `loss_fn`'s own. `shardings` (a tree like `state`,
  on a mesh): where the new state is kept, so every step (and checkpoint) sees one layout.
  """

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, batch, extra=None):
    (loss, scores), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state["params"], batch, extra)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    new_state = {"params": optax.apply_updates(state["params"], updates),
                 "opt_state": opt_state}
    if shardings is not None:
      new_state = jax.lax.with_sharding_constraint(new_state, shardings)
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **scores}

  return step


def checkpoint_manager(config: TrainConfig,
                       run_dir: pathlib.Path) -> ocp.CheckpointManager:
  """`run_dir/checkpoints/<step>/`, written atomically, the last `keep_checkpoints` kept."""
  options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True,
                                         enable_async_checkpointing=False,
                                         cleanup_tmp_directories=True)
  coordinated_barriers()
  # absolute: orbax refuses a relative path, at the first save (a run_dir given relative)
  return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options)


def coordinated_barriers() -> None:
  """Makes orbax's checkpoint barriers (several per save) wait at the coordination
  service, with a timeout, instead of running a collective over every device: under
  gloo (processes of CPU devices) such a collective once in a while hung a save for
  good. A no-op with one process. Sets orbax's own flag, as its command-line switch
  `--experimental_orbax_use_distributed_barrier` would."""
  if jax.process_count() == 1:
    return
  flag = flags.FLAGS["experimental_orbax_use_distributed_barrier"]
  flag.value, flag.present = True, 1  # `present`: readable before absl parses a command line


def restore(manager: ocp.CheckpointManager, initial: dict, layout: sharding.WeightPlacement | None,
            by_rules: bool = True) -> tuple[int, dict]:
  """(step, state) of the latest checkpoint, or (0, `initial`) before any; on `layout`'s
  mesh when given (`devices.state_on_mesh`, `by_rules` or replicated).

  `initial` (the one-device layout, as checkpoints hold it) is also the template
  restored into: on a mesh, its shapes and dtypes with the shardings of
  `devices.restore_target`, so each array lands straight where it lies."""
  start = manager.latest_step() or 0
  state = initial
  if start:
    target = initial if layout is None else devices.restore_target(initial, layout, by_rules)
    state = manager.restore(start, args=ocp.args.StandardRestore(target))
  return start, devices.state_on_mesh(state, layout, by_rules)


def save(manager: ocp.CheckpointManager, step: int, state: dict) -> None:
  manager.save(step, args=ocp.args.StandardSave(state), force=True)


def due(step: int, every: int, end: int) -> bool:
  """Is a periodic action (log, evaluation, checkpoint) due after `step`? Every `every`
  steps and after the last."""
  return step % every == 0 or step == end


# (sums of the `summed` metrics since the previous record, that record's step, the steps
# and seconds since it) -> (the record's own fields, the progress bar's postfix)
Fields = Callable[[dict, int, int, float], tuple[dict, dict]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hooks:
  """What a trainer plugs into `run`; every process calls each of them."""

  step: Callable  # `make_train_step`'s: (state, batch, extra) -> (state, metrics)
  extra: object = None  # the step's frozen input (a model's weights), or None
  batch: Callable[[int, slice], object]  # (i, rows) -> rows `rows` of the batch of step i
  #                                        (0-based; numpy, batch-major: `devices.shard_batch`)
  evaluate: Callable[[Params], dict]  # params -> the held-out record's fields
  plot: Callable[[list[dict]], None]  # the records so far -> the run's picture (process 0)
  fields: Fields = lambda sums, step, steps, seconds: ({}, {})
  summed: tuple[str, ...] = ("loss",)  # the metrics `fields` gets the sums of ("loss" first)
  saved: Callable[[dict], dict] = lambda state: state  # what a checkpoint holds of the state


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What `run` hands back."""

  state: dict  # {"params", "opt_state"} after the last step
  step: int  # the last step run (`start` when none was)
  stopped_early: bool  # by `max_minutes`
  train_seconds: float  # every session's wall time, summed (the records' "wall_s")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
  """What a finished trainer's `train` hands back: where the loop ended and the data it
  read; each trainer's record adds what it made (`lm.Run`, `heads.Run`)."""

  data: object  # the trainer's prepared data
  step: int  # the last step run
  stopped_early: bool = False  # by `max_minutes`
  train_seconds: float = 0.0  # every session's, summed


def run(config: TrainConfig, hooks: Hooks, state: dict, *, start: int, end: int,
        manager: ocp.CheckpointManager, log: MetricsLog, layout: sharding.WeightPlacement | None,
        name: str, progress: bool = True, max_minutes: float = 0.0,
        session_start: float | None = None) -> Outcome:
  """Steps `start + 1` to `end`, under `sharding.active(layout)`::

      step i:  batch of i - 1 --> hooks.step --> record (log_every)
                                             --> evaluation + plot (eval_every, end, stop)
                                             --> checkpoint (checkpoint_every, end, stop)

  `max_minutes` > 0: stops after the first step that ends past that many minutes from
  `session_start` (default: now), process 0's clock deciding for every process
  (`distributed.agreed`). `name`: the progress bar's."""
  bar = Progress(config, hooks, log, start, end, progress, name, session_start)
  step, stopped_early = start, False
  with sharding.active(layout):
    for step in range(start + 1, end + 1):
      batch = devices.shard_batch(functools.partial(hooks.batch, step - 1), config.batch_size,
                                  layout)
      state, metrics = hooks.step(state, batch, hooks.extra)
      stopped_early = max_minutes > 0 and step < end and distributed.agreed(
          time.perf_counter() - bar.session_start > 60 * max_minutes)
      bar.add(step, metrics, last=stopped_early)
      if due(step, config.eval_every, end) or stopped_early:
        log.write({"step": step, **hooks.evaluate(state["params"])})
        if distributed.is_main_process():
          hooks.plot(log.records())
      if due(step, config.checkpoint_every, end) or stopped_early:
        save(manager, step, hooks.saved(state))
      if stopped_early:
        break
  bar.close()
  manager.wait_until_finished()
  return Outcome(state=state, step=step, stopped_early=stopped_early,
                 train_seconds=bar.wall_seconds())


class Progress:
  """The train records of a session (`log_every` steps apart, at `end`, and at a step
  `add` is told is the last) and its progress bar. The metrics `hooks.summed` are summed
  on the device between records, so that no step waits for the host; `hooks.fields`
  turns the sums into the trainer's own fields."""

  def __init__(self, config: TrainConfig, hooks: Hooks, log: MetricsLog, start: int, end: int,
               progress: bool, name: str, session_start: float | None = None):
    previous = [r["wall_s"] for r in log.records() if "wall_s" in r]
    self.wall_offset = previous[-1] if previous else 0.0  # the interrupted sessions' time
    self.log, self.every, self.end = log, config.log_every, end
    self.fields, self.summed = hooks.fields, hooks.summed
    self.lr = lr_schedule(config)
    self.bar = tqdm(total=end, initial=start, disable=not progress, dynamic_ncols=True,
                    desc=name)
    self.session_start = time.perf_counter() if session_start is None else session_start
    self.last_time, self.last_step, self.sums = time.perf_counter(), start, None

  def add(self, step: int, metrics: dict, last: bool = False) -> None:
    """Adds step `step`'s metrics; writes a record when one is due, or when `last`."""
    sums = {k: metrics[k] for k in self.summed}
    self.sums = sums if self.sums is None else jax.tree.map(jnp.add, self.sums, sums)
    if not (due(step, self.every, self.end) or last):
      return
    now, steps = time.perf_counter(), step - self.last_step
    sums = distributed.to_host(self.sums)
    loss = float(sums["loss"]) / steps
    fields, postfix = self.fields(sums, step, steps, now - self.last_time)
    self.log.write({"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                    "lr": float(self.lr(step - 1)), **fields, "wall_s": self.wall_seconds()})
    self.bar.update(steps)
    self.bar.set_postfix(loss=f"{loss:.3f}", **postfix)
    self.last_time, self.last_step, self.sums = now, step, None

  def wall_seconds(self) -> float:
    return self.wall_offset + time.perf_counter() - self.session_start

  def close(self) -> None:
    self.bar.close()
