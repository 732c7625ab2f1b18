"""What a heads run optimizes and how it scores it: the objective (its family's
`HeadFamily.loss` with the config's weights, `mdjax.heads.objective`), the jitted step,
the held-out evaluation and the records' accuracies.

Accuracies compare a head's ranked guesses with the target's greedy choice of the same
token (`greedy`): what a verifier decoding greedily accepts. The simulated accepted
length is `1 + sum_k prod_{i <= k} acc_i` (acc_i: head i's top-1 accuracy; eagle:
unrolled step i's) -- tokens per target pass if heads were right independently.
"""

from __future__ import annotations

import functools

import numpy as np
import optax

from mdjax import distributed, programs
from mdjax.heads import HeadFamily
from mdjax.heads.objective import Objective
from mdjax.models.config import ModelConfig
from mdjax.models.model import Model
from mdjax.models.transformer import Params
from mdjax.train import loop
from mdjax.train.config import HeadsTrainConfig
from mdjax.train.heads.batches import Reader

BAR_TOP = (1, 5)  # the top-k accuracies a training step measures
EVAL_TOP = tuple(range(1, 11))  # the held-out ones (HeadsConfig.top_accuracy's columns)


def objective_of(config: HeadsTrainConfig, family: HeadFamily,
                 model_config: ModelConfig) -> Objective:
  """The run's training objective: `family`'s loss with the config's weights, as deep
  as the heads (parallel) or the unroll (sequential)."""
  depth = config.eagle.unroll if family.sequential else config.num_heads
  return Objective(family=config.family, model_config=model_config, depth=depth,
                   num_layers=config.num_layers, loss=config.loss, decay=config.head_decay,
                   regression_weight=config.eagle.regression_weight,
                   token_weight=config.eagle.token_weight)


def unembedding(target: Model) -> Params:
  """The only weights of the target the heads' losses read: embedding and lm_head."""
  return {k: target.params[k] for k in ("embed", "lm_head") if k in target.params}


def accepted_length(top1: list[float]) -> float:
  """`1 + sum_k prod_{i <= k} top1[i]`: tokens per target pass when each guess is right
  with its own accuracy, independently (the target's own token always counts)."""
  return float(1 + np.sum(np.cumprod(top1)))


def make_train_step(objective: Objective, optimizer: optax.GradientTransformation,
                    shardings=None):
  """`loop.make_train_step` of `objective`: `step(state, batch, target)`, target the
  frozen unembedding (`unembedding`); metrics: also each head's (step's) top-1 / top-5
  hits."""
  loss_fn = lambda params, batch, target: objective(params, batch, target, BAR_TOP)
  return loop.make_train_step(loss_fn, optimizer, shardings)


@functools.partial(programs.jit, static_argnames="objective")
def _scores(params, batch, target, *, objective: Objective):
  return objective(params, batch, target, EVAL_TOP)


def evaluate(params: Params, reader: Reader, objective: Objective, target: Params,
             batch_size: int) -> dict:
  """Held-out record: the mean loss, each head's (step's) cumulative top-1..top-10
  accuracy against the target's greedy tokens, and the simulated accepted length."""
  loss, weight, hits, count = 0.0, 0, 0, 0
  for batch in reader.chunks(batch_size):
    batch_loss, scores = distributed.to_host(_scores(params, batch, target, objective=objective))
    loss += float(batch_loss) * int(scores["count"].sum())
    weight += int(scores["count"].sum())
    hits, count = hits + scores["hits"], count + scores["count"]
  accuracy = hits / np.maximum(count, 1)[:, None]  # [depth, 10]
  return {"heldout_loss": loss / max(weight, 1), "heldout_topk": accuracy.tolist(),
          "heldout_top1": accuracy[:, 0].tolist(),
          "heldout_accepted_length": accepted_length(accuracy[:, 0])}


def accuracies(sums: dict, step: int, steps: int, seconds: float) -> tuple[dict, dict]:
  """`loop.Hooks.fields`: each head's top-1 / top-5 accuracy and the simulated accepted
  length since the previous record."""
  accuracy = sums["hits"] / np.maximum(sums["count"], 1)[:, None]  # [depth, len(BAR_TOP)]
  record = {"top1": accuracy[:, 0].tolist(), "top5": accuracy[:, 1].tolist(),
            "accepted_length": accepted_length(accuracy[:, 0])}
  return record, {"top1": "/".join(f"{a:.2f}" for a in record["top1"]),
                  "top5": "/".join(f"{a:.2f}" for a in record["top5"]),
                  "accepted": f"{record['accepted_length']:.2f}"}
