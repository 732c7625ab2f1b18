r"""Parallel multi-token-prediction heads (Gloeckle et al. 2024): K small decoders side
by side on the target's final-norm hidden states, sharing its unembedding.

Head k (k = 1..K) is `num_layers` decoder layers of the model's own layer type
(`decoder_config`: full attention, RoPE at the tokens' positions) over the sequence of
hidden states h_0 .. h_t, then its final RMSNorm, then the target's `lm_head`; at t it
guesses token t + 1 + k (the target's own head guesses t + 1)::

    h_0 .. h_t ─┬─ layer(s) of head 1 ─ final_norm[0] ─ lm_head ─> token t + 2
                ├─ layer(s) of head 2 ─ final_norm[1] ─ lm_head ─> token t + 3
                │  ...
                └─ the target's lm_head (on h_t) ────────────────> token t + 1

Each head attends to the earlier positions, so the heads keep a KV cache of their own
over the committed text, fed the target's hidden states (as inputs: no token
embedding) at the target's positions and segments. It is one `KVCache` of K x L
layers (`mtp_cache_config`), head k's layers at k L .. k L + L - 1 (from k = 0); the
K heads run as one `jax.vmap` of the transformer's `forward` over their stacked
params and their layers of the cache, and write the same slots. K = 3, L = 1::

    target cache   tokens   x_0  x_1  x_2  x_3       seg 0 0 0 0   pos 0 1 2 3
    heads' cache   fed      h_0  h_1  h_2  h_3       (the same seg, pos and length)
                   layer 0  head 1's K/V of them
                   layer 1  head 2's
                   layer 2  head 3's

Params (leaves of every head stacked on a leading axis of K)::

    layers       a list of L decoder-layer dicts (`transformer`'s layout), each leaf [K, ...]
    final_norm   [K, D]

As a family (`MtpFamily`): decoded by `medusa` and `blockwise` (the same guesses as
Medusa's heads), keeping the cache above (`MtpGuess` prefills it with the prompt's
hidden states and feeds it the committed ones after each verify), checked param by
param against the model (`check_mtp_params`), trained on whole rows
(`mdjax.heads.objective.parallel_loss`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from mdjax import programs
from mdjax.cache import KVCache
from mdjax.errors import MdjaxError
from mdjax.heads import family
from mdjax.heads.base import Heads, HeadsConfig
from mdjax.heads.decoder import decoder_config
from mdjax.heads.module import hold, params_of
from mdjax.heads.objective import Objective, parallel_loss
from mdjax.models.config import ModelConfig
from mdjax.models.random_init import init_params
from mdjax.models.transformer import Params, forward, forward_causal, lm_head
from mdjax.topology import Topology


def mtp_cache_config(model_config: ModelConfig, num_heads: int, num_layers: int) -> ModelConfig:
  """The config the heads' KV cache is created from: K x L layers of the model's type."""
  return decoder_config(model_config, num_heads * num_layers)


class MtpHeads(nnx.Module):
  """K parallel MTP heads (the module docstring): `layers` (L decoder-layer dicts,
  each leaf stacked [K, ...]) and `final_norm` [K, D], as `mdjax.heads.module` keeps them."""

  def __init__(self, params: Params):
    hold(self, params)

  @classmethod
  def init(cls, config: HeadsConfig, model_config: ModelConfig, seed: int = 0,
           dtype=jnp.float32, std: float = 0.02) -> "MtpHeads":
    """Random decoder layers (`init_params`' scheme, a different draw per head) and
    identity final norms, stacked per head."""
    k, depth = config.num_heads, config.num_layers
    decoder = init_params(decoder_config(model_config, k * depth), seed, dtype, std)
    layers = decoder["layers"]  # K x L layer dicts, head-major
    return cls({"layers": [jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers[i::depth])
                           for i in range(depth)],
                "final_norm": jnp.stack([decoder["final_norm"]] * k)})

  def __call__(self, cache: KVCache, hidden: Float[Array, "B T D"], positions: Int[Array, "B T"],
               segments: Int[Array, "B T"], topology: Topology, *, model_config: ModelConfig,
               attention: str = "block_sparse") -> tuple[Float[Array, "B T K D"], KVCache]:
    """Every head over its layers of `cache` (`KVCache.create(mtp_cache_config(...))`)
    for the T fed hidden states, like `decode_step` feeds tokens: each head's final-norm
    output (what the unembedding reads) and the cache with the T added. The K heads run
    as one `jax.vmap` of the transformer's `forward` over their stacked params."""
    params = params_of(self)
    num_heads = params["final_norm"].shape[0]
    config = decoder_config(model_config, len(params["layers"]))
    split = lambda x: x.reshape(num_heads, -1, *x.shape[1:])  # [K L, ...] -> [K, L, ...]

    def head(params, fields):  # one head over its own layers of the cache (K/V, scales)
      return forward(params, cache.replace(**fields), None, positions, segments, topology,
                     config=config, attention=attention, inputs=hidden)

    per_head = {name: split(x) for name, x in cache.slot_fields().items()}
    shared = KVCache(pos=None, seg=None, length=None, **{name: 0 for name in per_head})  # pos,
    #                                                     seg, length: one for all heads
    features, cache = jax.vmap(head, out_axes=(2, shared))(params, per_head)
    merge = lambda x: x.reshape(-1, *x.shape[2:])  # [K, L, ...] -> [K L, ...]
    return features, cache.replace(**{name: merge(getattr(cache, name)) for name in per_head})

  def causal(self, hidden: Float[Array, "B T D"], *, model_config: ModelConfig
             ) -> Float[Array, "B T K D"]:
    """Training forward without a cache: every head's final-norm output at every
    position of whole sequences of hidden states (`hidden[:, t]`: the target's at t)."""
    params = params_of(self)
    config = decoder_config(model_config, len(params["layers"]))
    head = lambda params: forward_causal(params, None, config=config, inputs=hidden)
    return jax.vmap(head, out_axes=2)(params)  # each head: a model's params dict


def init_mtp(config: HeadsConfig, model_config: ModelConfig, seed: int = 0,
             dtype=jnp.float32) -> Params:
  """`MtpHeads.init`'s params pytree."""
  return params_of(MtpHeads.init(config, model_config, seed, dtype))


def check_mtp_params(config: HeadsConfig, params: Params, model_config: ModelConfig) -> None:
  """Raises `MdjaxError` naming the first param that heads of `config` on a model of
  `model_config` would not have, or not in that shape (e.g. heads trained on another
  model of the same hidden size)."""
  def shapes(tree) -> dict[str, tuple[int, ...]]:
    return {jax.tree_util.keystr(path, simple=True, separator="."): tuple(jnp.shape(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  expected = shapes(jax.eval_shape(lambda: init_mtp(config, model_config)))
  given = shapes(params)
  for name in sorted(expected.keys() | given.keys()):
    if expected.get(name) != given.get(name):
      got = f"shape {given[name]}" if name in given else "missing"
      want = f"shape {expected[name]}" if name in expected else "no such param"
      raise MdjaxError(f"the mtp heads {config.base_model!r} do not fit this model: {name} is "
                       f"{got}, expected {want}")


@functools.partial(programs.jit, static_argnames=("model_config", "attention"),
                   donate_argnames=("cache",))
def mtp_features(heads_params: Params, cache: KVCache, hidden: Float[Array, "B T D"],
                 positions: Int[Array, "B T"], segments: Int[Array, "B T"], topology: Topology,
                 *, model_config: ModelConfig, attention: str = "block_sparse"
                 ) -> tuple[Float[Array, "B T K D"], KVCache]:
  """`MtpHeads(heads_params)` over `cache`: a pure, jitted function of the pytrees."""
  return MtpHeads(heads_params)(cache, hidden, positions, segments, topology,
                                model_config=model_config, attention=attention)


def mtp_step(heads_params: Params, target_params: Params, cache: KVCache,
             hidden: Float[Array, "B T D"], positions: Int[Array, "B T"],
             segments: Int[Array, "B T"], topology: Topology, *, model_config: ModelConfig,
             attention: str = "block_sparse") -> tuple[Float[Array, "B T K V"], KVCache]:
  """`mtp_features` through the target's `lm_head`: head k's logits (float32) of token
  t + 1 + k at every fed t, and the cache."""
  features, cache = mtp_features(heads_params, cache, hidden, positions, segments, topology,
                                 model_config=model_config, attention=attention)
  return lm_head(target_params, features, config=model_config), cache


def mtp_causal(heads_params: Params, hidden: Float[Array, "B T D"], *,
               model_config: ModelConfig) -> Float[Array, "B T K D"]:
  """`MtpHeads.causal` of the heads `heads_params`."""
  return MtpHeads(heads_params).causal(hidden, model_config=model_config)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpRead:
  """What MTP heads read a tree from (K = the heads used, H = the hidden size).

    cache     KVCache [B]     the heads' own (`mtp_cache_config`): the target's hidden
                              state at every committed token, at its position and segment
    features  float[R, K, H]  each head's final-norm output at the token before `last`,
                              in the dtype the target's unembedding multiplies in
  """

  cache: KVCache
  features: Float[Array, "R K H"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpGuess:
  """How MTP heads draft (`family.Guess`): from their own outputs at the last
  committed token. `start` prefills their cache with the prompt's hidden states,
  `advance` feeds them the committed tokens' after each verify (see the module
  docstring); `logits` is the target's unembedding of those outputs."""

  model_config: ModelConfig
  attention: str
  num_heads: int  # K: the heads used
  num_layers: int  # decoder layers per head
  passes: ClassVar[int] = 1  # the heads' catch-up

  def features(self, params, cache: KVCache, hidden: Float[Array, "B T H"], feed: family.Feed
               ) -> tuple[Float[Array, "B T K H"], KVCache]:
    """The heads' outputs in the dtype the target's unembedding multiplies in (what
    `lm_head` converts them to: converted where they are read, each step would spend a
    kernel on it), and their cache."""
    features, cache = mtp_features(params["heads"], cache, hidden, feed.positions, feed.segments,
                                   feed.topology, model_config=self.model_config,
                                   attention=self.attention)
    unembedding = params["target"].get("lm_head", params["target"]["embed"])
    return features.astype(unembedding.dtype), cache

  def start(self, params, hidden: Float[Array, "B P H"], last: Int[Array, "B N"],
            feed: family.Feed, slots: int, cache_dtype) -> MtpRead:
    """The heads' prefill over the prompt (into a cache of `slots` slots), read at
    every branch's last prompt token."""
    batch, width = hidden.shape[0], hidden.shape[-1]
    cache = KVCache.create(mtp_cache_config(self.model_config, self.num_heads, self.num_layers),
                           batch, slots, cache_dtype)
    features, cache = self.features(params, cache, hidden, feed)  # [B, P, K, H]
    at_last = jnp.take_along_axis(features, last[..., None, None], axis=1)
    return MtpRead(cache=cache, features=at_last.reshape(-1, self.num_heads, width))

  def logits(self, params, read: MtpRead) -> Float[Array, "R K V"]:
    return lm_head(params["target"], read.features, config=self.model_config)

  def advance(self, params, read: MtpRead, hidden: Float[Array, "R D+1 H"],
              accepted: Int[Array, "R"], feed: family.Feed) -> MtpRead:
    """One heads pass over what the verify committed (each row's fed tokens, the rows
    of a batch row side by side in its cache), read at the last committed one."""
    rows, fed = hidden.shape[:2]
    batch = read.cache.length.shape[0]
    per_row = lambda x: x.reshape(batch, -1, *x.shape[2:])  # [R, 1 + D, ...] -> [B, N (1 + D), ...]
    features, cache = self.features(params, read.cache, per_row(hidden), family.Feed(
        per_row(feed.positions), per_row(feed.segments), feed.topology))
    features = features.reshape(rows, fed, *features.shape[2:])  # [R, 1 + D, K, H]
    last = jnp.take_along_axis(features, accepted[:, None, None, None], axis=1)[:, 0]
    return MtpRead(cache=cache, features=last)


@family.register
@dataclasses.dataclass(frozen=True)
class MtpFamily(family.HeadFamily):
  """Parallel MTP heads (the module docstring)."""

  name = "mtp"
  strategies = ("medusa", "blockwise")

  def init(self, config: HeadsConfig, model_config: ModelConfig, seed: int, dtype) -> Params:
    return init_mtp(config, model_config, seed, dtype)

  def check(self, heads: Heads, model_config: ModelConfig) -> None:
    heads.config.check_model(model_config)
    check_mtp_params(heads.config, heads.params, model_config)

  def cache_config(self, config: HeadsConfig, model_config: ModelConfig) -> ModelConfig:
    return mtp_cache_config(model_config, config.num_heads, config.num_layers)

  def guesser(self, config: HeadsConfig, model_config: ModelConfig, attention: str,
              num_heads: int) -> MtpGuess:
    return MtpGuess(model_config=model_config, attention=attention, num_heads=num_heads,
                    num_layers=config.num_layers)

  def describe(self, config: HeadsConfig) -> str:
    return f"{config.num_heads} parallel MTP heads of {config.num_layers} decoder layer(s)"

  def loss(self, objective: Objective, params: Params, batch: dict, target: Params,
           ks: tuple[int, ...]):
    def logits(params, hidden, target):  # [B, T, K, V]
      features = mtp_causal(params, hidden, model_config=objective.model_config)  # [B, T, K, D]
      return lm_head(target, features, config=objective.model_config)
    return parallel_loss(logits, objective, params, batch, target, ks)
