r"""EAGLE-3 heads (Li et al. 2025): one decoder layer that drafts from features fused
out of three of the target's layers, scoring a draft vocabulary.

At token t the head reads the token's embedding (the model's, frozen) and a feature
g: for text the target has seen, `fc` of the target's residual stream after a low, a
middle and a high layer at t - 1 (`HeadsConfig.target_layers`, concatenated); for a
token it drafted, its own output at the token before. Its output o_t, before the
final norm, is the feature of the next drafted token; after it, the draft
vocabulary's logits guess token t + 1::

    target layers (low, mid, high) at t - 1 ─ concat [3D] ─ fc ─┐
                                 or the head's own o_{t-1} [D] ─┴─> g
    embed(x_t) ─ embed_norm ─┐
    g ──────── attn_norm ────┴ concat [2D] ─ q, k, v ─ attention ─ wo ─(+ g)─ MLP ─(+)─> o_t
    o_t ─ final_norm ─ lm_head [D, V_d] ─> draft id ─ draft_ids ─> token t + 1

The layer is the model's own layer type run on g (`transformer.forward` /
`decoder_layers`: RoPE at explicit positions, segments, the cache, any attention),
with one identity: the attention reads `concat(e, n) @ wqkv = n @ wqkv[D:] + e @
wqkv[:D]`, so the embedding's half enters as a per-token qkv bias (`bqkv`, broadcast
`[B, T, (N + 2K) H]`) and the layer itself is unchanged. Params::

    fc          [3D, D]           on the target's three layers, concatenated
    fc_bias     [D]               optional (vLLM speculators' files carry one)
    layers      [one layer dict]  `transformer`'s layout, with wqkv [2D, (N + 2K) H]
                                  (rows :D read the embedding), attn_norm on g, and
                                  embed_norm [D] on the embedding
    final_norm  [D]
    lm_head     [D, V_d]          its own unembedding, over the draft vocabulary
    draft_ids   int32 [V_d]       the target id of each column (`mdjax.heads.vocab`);
                                  absent: the whole vocabulary (V_d = V)

Training-time test (`Eagle3Head.unrolled`): the head is run `steps` times over whole
sequences, step j feeding at each index t its own step j - 1 output there and the
token t + j, at position t + j, so that step j's prediction at t is the chain token
t + 1 + j drafted from the committed text up to t. Its attention sees what it would
see drafting: the committed text (step 0's keys at indices <= t) and its own chain
(steps 1..j's keys at index t); never the true tokens t + 1.. t + j. Index t, T = 4::

    keys     step 0: s = 0 1 2 3   step 1: s = 0 1 2 3   step 2: s = 0 1 2 3
    step 2, t = 2    x x x .               . . x .               . . x .
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from mdjax import losses, programs
from mdjax.cache import KVCache
from mdjax.heads import family, vocab
from mdjax.heads.base import HeadsConfig
from mdjax.heads.decoder import decoder_config
from mdjax.heads.module import hold, params_of
from mdjax.heads.objective import Objective, masked_mean, top_k_hits
from mdjax.models.attention import masked_attention
from mdjax.models.config import ModelConfig
from mdjax.models.numerics import full_float32, linear
from mdjax.models.random_init import init_params
from mdjax.models.transformer import Params, decoder_layers, embed, forward, lm_head, rms_norm
from mdjax.topology import Topology

FUSED_LAYERS = 3  # low, middle, high


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
  """EAGLE-3's choice: the residual stream after layers 1, L / 2 - 1 and L - 4 (from
  0; the inputs of layers 2, L / 2 and L - 3, as Hugging Face's hidden_states count)."""
  return (1, num_layers // 2 - 1, num_layers - 4) if num_layers >= 8 else (
      0, num_layers // 2, num_layers - 1)


def layer_config(model_config: ModelConfig) -> ModelConfig:
  """The head's decoder layer: the model's type, one layer, full attention, a qkv bias
  (the embedding's half of the projection, per token)."""
  return dataclasses.replace(decoder_config(model_config, 1), qkv_bias=True)


class Eagle3Head(nnx.Module):
  """The EAGLE-3 head (the module docstring's params), as `mdjax.heads.module` keeps them."""

  def __init__(self, params: Params):
    hold(self, params)

  @classmethod
  def init(cls, model_config: ModelConfig, draft_ids: Int[Array, "Vd"] | None = None,
           seed: int = 0, dtype=jnp.float32, std: float = 0.02,
           target_params: Params | None = None) -> "Eagle3Head":
    """Random layer (`init_params`' scheme) with a `[2D, ...]` qkv projection, a small
    random fc, identity norms; the unembedding over `draft_ids` (None: the whole
    vocabulary) is the target's columns when `target_params` is given
    (`vocab.unembedding_columns`), else random."""
    d = model_config.hidden_size
    layer = dict(init_params(layer_config(model_config), seed, dtype, std)["layers"][0])
    keys = jax.random.split(jax.random.key(seed + 1), 3)
    layer["wqkv"] = (std * jax.random.normal(keys[0], (2 * d, layer["wqkv"].shape[1]))
                     ).astype(dtype)
    layer.pop("bqkv", None)
    layer["embed_norm"] = jnp.ones((d,), dtype)
    ids = (jnp.arange(model_config.vocab_size) if draft_ids is None
           else jnp.asarray(draft_ids, jnp.int32))
    unembedding = (vocab.unembedding_columns(target_params, ids) if target_params is not None
                   else std * jax.random.normal(keys[2], (d, ids.size)))
    params = {"fc": (std * jax.random.normal(keys[1], (FUSED_LAYERS * d, d))).astype(dtype),
              "layers": [layer], "final_norm": jnp.ones((d,), dtype),
              "lm_head": unembedding.astype(dtype)}
    return cls(params if draft_ids is None else {**params, "draft_ids": ids})

  @full_float32
  def fuse(self, features: Float[Array, "... F"]) -> Float[Array, "... D"]:
    """g: `fc` of the target's concatenated layers (F = 3D), or the head's own output
    as it is (F = D)."""
    fc = self.fc[...]
    if features.shape[-1] == fc.shape[-1]:
      return features
    fused = linear(features, fc, fc.dtype)
    return fused + self.fc_bias[...] if hasattr(self, "fc_bias") else fused

  def layer_params(self, target_params: Params, tokens: Int[Array, "B T"], *,
                   model_config: ModelConfig) -> Params:
    """The params `transformer` runs the head's layer with, for these tokens: the
    feature's half of wqkv, the embedding's half as a per-token bias, no final norm
    (the output o is wanted before it)."""
    lp = params_of(self)["layers"][0]
    d = model_config.hidden_size
    e = rms_norm(embed(model_config, target_params, tokens), lp.pop("embed_norm"),
                 model_config.rms_norm_eps, plus_one=model_config.gemma_norms)  # [B, T, D]
    bias = linear(e, lp["wqkv"][:d])  # [B, T, (N + 2K) H]
    lp["bqkv"] = bias + lp["bqkv"] if "bqkv" in lp else bias
    lp["wqkv"] = lp["wqkv"][d:]
    return {"layers": [lp]}

  @full_float32
  def draft_logits(self, outputs: Float[Array, "... D"], *, model_config: ModelConfig
                   ) -> Float[Array, "... Vd"]:
    """The draft vocabulary's logits (float32) after outputs o."""
    normed = rms_norm(outputs, self.final_norm[...], model_config.rms_norm_eps,
                      plus_one=model_config.gemma_norms)
    return linear(normed, self.lm_head[...], jnp.float32)

  def __call__(self, target_params: Params, cache: KVCache, tokens: Int[Array, "B T"],
               features: Float[Array, "B T F"], positions: Int[Array, "B T"],
               segments: Int[Array, "B T"], topology: Topology, *, model_config: ModelConfig,
               attention: str = "block_sparse", logits_at: Int[Array, "B R"] | None = None
               ) -> tuple[Float[Array, "B R Vd"], Float[Array, "B T D"], KVCache]:
    """One head pass over its cache (`KVCache.create(layer_config(...), ...)`), like
    `decode_step`: `(draft-vocabulary logits after each fed token, or after those of
    `logits_at`; the outputs o, each the feature of the token after it; the cache)`.
    `features`: the target's three layers (F = 3D) or the head's own outputs (F = D)."""
    outputs, cache = forward(self.layer_params(target_params, tokens, model_config=model_config),
                             cache, tokens, positions, segments, topology,
                             config=layer_config(model_config), attention=attention,
                             inputs=self.fuse(features))
    picked = outputs if logits_at is None else jnp.take_along_axis(
        outputs, logits_at[..., None], axis=1)  # [B, R, D]
    return self.draft_logits(picked, model_config=model_config), outputs, cache

  @full_float32
  def unrolled(self, target_params: Params, tokens: Int[Array, "B T"],
               target: Float[Array, "B T F"], *, model_config: ModelConfig,
               steps: int) -> list[Float[Array, "B T Vd"]]:
    """Training forward, no cache: step j's draft logits at every index t of whole
    sequences (the chain token t + 1 + j, from the text up to t), j = 0..steps - 1.

    `tokens[:, t]` is x_t and `target[:, t]` the target's layers at t - 1 (zeros at
    t = 0): what the head reads at t when drafting after the committed x_t. Step j
    reads x_{t + j} (the last j indices read padding: their predictions are past the
    sequence) and its step j - 1 output at t, at position t + j.
    """
    b, t = tokens.shape
    config = layer_config(model_config)
    features = self.fuse(target)  # [B, T, D]
    keys: list = []

    def attend(q, k, v, index, spec, carry):
      keys.append((k, v))  # this step's, at every index
      key = jnp.concatenate([kv[0] for kv in keys], axis=1)  # [B, (1 + j) T, K, H]
      value = jnp.concatenate([kv[1] for kv in keys], axis=1)
      mask = jnp.broadcast_to(chain_mask(t, len(keys) - 1), (b, t, key.shape[1]))
      return masked_attention(q, key, value, mask, scale=spec.scale, softcap=spec.softcap), carry

    logits = []
    for step in range(steps):
      shifted = jnp.pad(tokens[:, step:], ((0, 0), (0, step)))  # [B, T]: x_{t + step}
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + step, (b, t))
      params = self.layer_params(target_params, shifted, model_config=model_config)
      outputs, _, _ = decoder_layers(config, params, features, positions, attend, None)
      logits.append(self.draft_logits(outputs, model_config=model_config))
      features = outputs
    return logits


def chain_mask(length: int, step: int) -> Float[Array, "T S"]:
  """What index t sees at unrolled step `step` (the module docstring's picture):
  step 0's keys at s <= t, then each later step's key at t. `[T, (1 + step) T]`."""
  causal = jnp.tril(jnp.ones((length, length), bool))
  return jnp.concatenate([causal] + [jnp.eye(length, dtype=bool)] * step, axis=1)


def init_eagle3(model_config: ModelConfig, draft_ids: Int[Array, "Vd"] | None = None,
                seed: int = 0, dtype=jnp.float32, std: float = 0.02,
                target_params: Params | None = None) -> Params:
  """`Eagle3Head.init`'s params pytree."""
  return params_of(Eagle3Head.init(model_config, draft_ids, seed, dtype, std, target_params))


@functools.partial(programs.jit, static_argnames=("model_config", "attention"),
                   donate_argnames=("cache",))
def eagle3_step(heads_params: Params, target_params: Params, cache: KVCache,
                tokens: Int[Array, "B T"], features: Float[Array, "B T F"],
                positions: Int[Array, "B T"], segments: Int[Array, "B T"], topology: Topology,
                *, model_config: ModelConfig, attention: str = "block_sparse",
                logits_at: Int[Array, "B R"] | None = None
                ) -> tuple[Float[Array, "B R Vd"], Float[Array, "B T D"], KVCache]:
  """`Eagle3Head(heads_params)`'s pass over `cache`: a pure, jitted function of the pytrees."""
  return Eagle3Head(heads_params)(target_params, cache, tokens, features, positions, segments,
                                  topology, model_config=model_config, attention=attention,
                                  logits_at=logits_at)


def unrolled_logits(heads_params: Params, target_params: Params, tokens: Int[Array, "B T"],
                    target: Float[Array, "B T F"], *, model_config: ModelConfig,
                    steps: int) -> list[Float[Array, "B T Vd"]]:
  """`Eagle3Head.unrolled` of the head `heads_params`."""
  return Eagle3Head(heads_params).unrolled(target_params, tokens, target,
                                           model_config=model_config, steps=steps)


def teacher_logits(batch: dict, target: Params, config: ModelConfig) -> Float[Array, "B T Vd"]:
  """The target's logits of each next token over the heads' vocabulary, from the batch's
  final-norm states (`batch["teacher"]` [B, T, D]), held fixed: lm_head's columns of
  the draft vocabulary (`target["draft_unembedding"]`), else all of lm_head."""
  hidden = jax.lax.stop_gradient(batch["teacher"].astype(jnp.float32))
  if "draft_unembedding" in target:
    return hidden @ target["draft_unembedding"].astype(jnp.float32)
  return lm_head(target, hidden, config=config)


def eagle3_loss(objective: Objective, params: Params, batch: dict, target: Params,
                ks: tuple[int, ...]):
  """The training-time test over rows of n tokens (`unrolled_logits`, W = n - 2 indices
  p, each reading x[p + 1] and the target's layers at p): step j's cross-entropy to the
  model's greedy guess of x[p + 2 + j] (`greedy[p + 1 + j]`; loss "ce" or "greedy"), or
  its KL from the model's law of that token over the draft vocabulary,
  softmax(lm_head(teacher[p + 1 + j])) restricted to it (loss "kl", SpecForge's soft
  labels), weighted decay^j, where the greedy guess is in the draft vocabulary
  (`target["draft_ids"]`, when the heads have one). Accuracies count every greedy
  guess, so a token outside it is a miss.

      batch   tokens [B, n], ok [B, n], hidden [B, n - 1, 3D] (the target's layers),
              greedy [B, n - 1], teacher [B, n - 1, D] (the final-norm states: "kl")
      target  the target's embedding (and draft_ids, draft_unembedding [D, Vd]: the
              heads' draft vocabulary and its columns of the unembedding)
  """
  steps, config = objective.depth, objective.model_config
  tokens, layers = batch["tokens"][:, 1:-1], batch["hidden"][:, :-1].astype(jnp.float32)
  logits = unrolled_logits(params, target, tokens, layers, model_config=config, steps=steps)
  column = (vocab.column_of(target["draft_ids"], config.vocab_size) if "draft_ids" in target
            else jnp.arange(config.vocab_size, dtype=jnp.int32))
  law = teacher_logits(batch, target, config) if objective.loss == "kl" else None  # [B, n-1, Vd]
  loss, hits, counts = 0.0, [], []
  for step, step_logits in enumerate(logits):  # [B, W, Vd]
    pad = lambda x, value: jnp.pad(x[:, 1 + step:], ((0, 0), (0, step)) + ((0, 0),) * (
        x.ndim - 2), constant_values=value)
    wanted = column[pad(batch["greedy"], 0)]  # [B, W] the guess's column, or -1
    mask = pad(batch["ok"][:, 1:], False)  # [B, W] may x[p + 2 + step] be a target?
    inside = mask & (wanted >= 0)
    labels = jnp.maximum(wanted, 0)
    if law is None:
      token_loss = optax.softmax_cross_entropy_with_integer_labels(step_logits, labels)
    else:
      token_loss = losses.kl_to_teacher(step_logits, pad(law, 0.0), 1.0)
    loss += objective.decay**step * masked_mean(token_loss, inside)
    hits.append(top_k_hits(step_logits, labels, inside, ks))
    counts.append(jnp.sum(mask))
  return loss, {"hits": jnp.stack(hits), "count": jnp.stack(counts)}


@family.register
@dataclasses.dataclass(frozen=True)
class Eagle3Family(family.HeadFamily):
  """EAGLE-3 heads (the module docstring), decoded by the `eagle` strategy."""

  name = "eagle3"
  strategies = ("eagle",)
  owns_unembedding = True
  sequential = True
  step_label = "draft step"
  draft_vocabulary = True

  def init(self, config: HeadsConfig, model_config: ModelConfig, seed: int, dtype) -> Params:
    """Over the whole vocabulary (the trainer `restrict`s it to a draft vocabulary)."""
    return init_eagle3(model_config, None, seed, dtype)

  def cache_config(self, config: HeadsConfig, model_config: ModelConfig) -> ModelConfig:
    return layer_config(model_config)

  def target_layers(self, config: HeadsConfig) -> tuple[int, ...]:
    return config.target_layers

  def layers_for(self, model_config: ModelConfig) -> tuple[int, ...]:
    return default_target_layers(model_config.num_layers)

  def restrict(self, params: Params, draft_ids: jax.Array, target_params: Params) -> Params:
    """The unembedding starts as the target's draft columns."""
    columns = vocab.unembedding_columns(target_params, jnp.asarray(draft_ids))
    return {**params, "lm_head": columns.astype(params["lm_head"].dtype)}

  def draft_step(self, config: HeadsConfig, heads_params: Params, target_params: Params,
                 cache: KVCache, tokens, features, positions, segments, topology, *,
                 model_config: ModelConfig, attention: str, logits_at=None):
    return eagle3_step(heads_params, target_params, cache, tokens, features, positions, segments,
                       topology, model_config=model_config, attention=attention,
                       logits_at=logits_at)

  def describe(self, config: HeadsConfig) -> str:
    return (f"An EAGLE-3 head (one decoder layer over target layers "
            f"{', '.join(map(str, config.target_layers))})")

  def loss(self, objective: Objective, params: Params, batch: dict, target: Params,
           ks: tuple[int, ...]):
    return eagle3_loss(objective, params, batch, target, ks)
