"""What heads learn: the options of a training objective and the pieces the families'
losses share (`HeadFamily.loss`; the trainer is `mdjax.train.heads`).

At position t of a row (x: the tokens, h: the model's final-norm hidden states, so that
the model's own guess of x[t + 1] is lm_head(h[t])), parallel heads (K of them, scored
side by side: `parallel_loss`) learn::

    head k   reads h[t] (medusa) or h[0..t] (mtp)   target x[t + 1 + k]  ("ce"), the
                                                    model's greedy guess of it ("greedy"),
                                                    or its law softmax(lm_head(h[t + k])) ("kl")

Accuracies compare a head's ranked guesses with the model's greedy choice of the same
token: what a verifier decoding greedily accepts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int

from mdjax import losses
from mdjax.heads import registry, vocab
from mdjax.models.config import ModelConfig
from mdjax.models.transformer import Params, lm_head

LOSSES = ("ce", "kl", "greedy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Objective:
  """The loss of a family (static: a jit argument), and the accuracies it measures."""

  family: str
  model_config: ModelConfig
  depth: int  # predictions scored per position: K parallel heads, or a head's unrolled steps
  num_layers: int
  loss: str  # "ce" | "kl" | "greedy"
  decay: float  # weight of prediction k: decay^(k - 1)
  regression_weight: float = 1.0  # eagle's feature regression
  token_weight: float = 0.1  # eagle's token loss

  def __call__(self, params: Params, batch: dict, target: Params, ks: tuple[int, ...]):
    """(loss, {"hits": [depth, len(ks)] top-k hits, "count": [depth] targets}); `target`:
    the frozen target's params the heads read (`HeadFamily.loss`)."""
    return registry.get(self.family).loss(self, params, batch, target, ks)

  def token_losses(self, logits: Float[Array, "... V"], targets: Int[Array, "..."],
                   teacher_hidden: Float[Array, "... D"], target: Params) -> Float[Array, "..."]:
    """Cross-entropy to `targets` ("ce": the data's tokens; "greedy": the model's greedy
    guesses of them), or the KL from the model's law of them, softmax(lm_head(
    teacher_hidden)) ("kl"); with a draft vocabulary (`target["draft_ids"]`) `targets`
    are draft columns and the law is the model's over those tokens."""
    if self.loss != "kl":
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    teacher = lm_head(target, teacher_hidden, config=self.model_config)
    if "draft_ids" in target:  # the target's law over the draft vocabulary, renormalised
      teacher = jnp.take(teacher, target["draft_ids"], axis=-1)
    return losses.kl_to_teacher(logits, jax.lax.stop_gradient(teacher), 1.0)


def ahead(x: jax.Array, depth: int) -> jax.Array:
  """`x` `[B, W + depth, ...]` -> `[B, W, depth, ...]`: entry (t, k - 1) is x[t + k],
  for k = 1..depth."""
  width = x.shape[1] - depth
  return jnp.stack([x[:, k:k + width] for k in range(1, depth + 1)], axis=2)


def parallel_targets(tokens: Int[Array, "B n"], ok: Bool[Array, "B n"], num_heads: int
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


HeadLogits = Callable[[Params, Float[Array, "B T D"], Params], Float[Array, "B T K V"]]


def parallel_loss(head_logits: HeadLogits, objective: Objective, params: Params, batch: dict,
                  target: Params, ks: tuple[int, ...]):
  """`sum_k decay^(k-1) * mean loss of head k` over n = W + K + 1 tokens: medusa's
  windows, mtp's whole rows (its heads read h[0..t], causally, so the last K hidden
  states, which have no target, are left out). `head_logits(params, hidden, target)`:
  head k's logits of token t + 1 + k at every t."""
  k = objective.depth
  hidden = batch["hidden"].astype(jnp.float32)  # [B, W + K, D]
  width = hidden.shape[1] - k
  logits = head_logits(params, hidden[:, :width], target)  # [B, W, K, V]
  targets, mask = parallel_targets(batch["tokens"], batch["ok"], k)  # [B, W, K]
  greedy = ahead(batch["greedy"], k)  # [B, W, K]: the model's guesses of the same tokens
  trained, scored = mask, mask
  if "draft_ids" in target:  # draft columns; a token outside is no target, and a miss
    column = vocab.column_of(target["draft_ids"], objective.model_config.vocab_size)
    targets, greedy = column[targets], column[greedy]
    trained, scored = mask & (targets >= 0), mask & (greedy >= 0)
    targets, greedy = jnp.maximum(targets, 0), jnp.maximum(greedy, 0)
  if objective.loss == "greedy":  # what a greedy verifier accepts, at "ce"'s cost
    targets, trained = greedy, scored
  losses = objective.token_losses(logits, targets, ahead(hidden, k), target)  # [B, W, K]
  weights = objective.decay ** jnp.arange(k)  # [K]
  loss = jnp.sum(weights * masked_mean(losses, trained, axis=(0, 1)))
  hits = jnp.stack([top_k_hits(logits[:, :, i], greedy[:, :, i], scored[:, :, i], ks)
                    for i in range(k)])  # [K, len(ks)]
  return loss, {"hits": hits, "count": jnp.sum(mask, axis=(0, 1))}
