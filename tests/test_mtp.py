"""mtp heads: their cached pass == their causal forward; under medusa and blockwise,
greedy output == the target's greedy decoding for any heads (ragged rows, questions);
heads that know the target's future accept the whole depth every step; after steps of
decoding, the heads' cache has caught up exactly on the committed text; a few training
steps lower the loss and the export loads back with a calibrated tree; bad heads are
named."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from configs import heads_tiny_test
from mdjax.cache import KVCache
from mdjax.generate import _prepare, _start
from mdjax.heads import (Heads, HeadsConfig, init_heads, load_heads, mtp_cache_config,
                         mtp_causal, mtp_step, save_heads)
from mdjax.heads.tree import build_tree, check_tree
from mdjax.models.model import Model
from mdjax.models.transformer import forward_causal, lm_head
from mdjax.strategies.base import ModelFn
from mdjax.strategies.medusa import DEFAULT_BUDGET, Medusa
from mdjax.train import heads as heads_lib
from tests.helpers import CYCLE, cycle_model, random_model

PROMPTS = [list(range(3, 19)), [9, 10, 11, 12, 13], [30]]  # ragged, ids < 32
NEW = 40


def mtp_config(model: Model, num_heads: int = 3, **fields) -> HeadsConfig:
  c = model.config
  return HeadsConfig(family="mtp", base_model=model.name, base_family=c.family,
                     hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_heads=num_heads,
                     **fields)


def random_heads(model: Model, num_heads: int = 3, num_layers: int = 1, scale: float = 4.0,
                 seed: int = 1) -> Heads:
  """`init_heads`' draw with its matrices scaled up: peaked attention over the heads'
  cache (a wrong key, position or segment shows), many rejections, some acceptances."""
  heads = init_heads(mtp_config(model, num_heads, num_layers=num_layers), model.config,
                     seed=seed)
  params = jax.tree.map(lambda a: scale * a if a.ndim == 3 else a, heads.params)
  return Heads(config=heads.config, params=params)


def permutation_model_and_heads(num_heads: int = 3, seed: int = 0) -> tuple[Model, Heads]:
  """A llama over 32 tokens whose greedy continuation is x -> pi(x) -> pi(pi(x)) ...
  for a random permutation pi whatever the context, and MTP heads that know it.

  Its embeddings are orthonormal rows q(x) in D = 64 dimensions and its layers add
  nothing (zero `wo`, `w_down`), so its final-norm hidden state at x is h = 8 q(x);
  its lm_head's column pi(y) is q(y), so the largest logit after x is pi(x). Head k
  (from 1) adds nothing by attention (zero `wo`); its MLP's gate is G for every h (the
  sum of the q's), its up projection reads x's coordinate and its down projection
  writes 8 s q(pi^k(x)). Its output 8 (q(x) + s q(pi^k(x))), s = 10, is read by the
  model's lm_head as pi^(k+1)(x): token t + 1 + k.
  """
  base = random_model("llama", seed, vocab_size=32, hidden=64, tie_word_embeddings=False)
  c = base.config
  vocab, d, f = c.vocab_size, c.hidden_size, c.intermediate_size
  rng = np.random.default_rng(seed)
  q = np.linalg.qr(rng.normal(size=(d, vocab)))[0].T.astype(np.float32)  # [V, D] orthonormal
  pi = rng.permutation(vocab)
  layers = [dict(lp, wo=jnp.zeros_like(lp["wo"]), w_down=jnp.zeros_like(lp["w_down"]))
            for lp in base.params["layers"]]
  model = Model(config=c, name="random-llama-permutation",
                params=dict(base.params, embed=jnp.asarray(q), layers=layers,
                            lm_head=jnp.asarray(q[np.argsort(pi)].T)))
  gain, s, root = 20.0, 10.0, np.sqrt(d)
  w_gate = np.zeros((d, f), np.float32)
  w_gate[:, :vocab] = gain * q.sum(axis=0)[:, None] / root  # gate = G for h = 8 q(x)
  w_up = np.zeros((d, f), np.float32)
  w_up[:, :vocab] = q.T / root  # up_y = [x == y]
  heads = init_heads(mtp_config(model, num_heads), c, seed=seed)
  layer = dict(heads.params["layers"][0])
  image = np.arange(vocab)
  w_down = []
  for _ in range(num_heads):
    image = pi[image]  # pi^k
    down = np.zeros((f, d), np.float32)
    down[:vocab] = s * root * q[image] / float(jax.nn.silu(gain))
    w_down.append(down)
  layer.update(wo=jnp.zeros_like(layer["wo"]),
               w_gate_up=jnp.asarray(np.stack([np.concatenate([w_gate, w_up], 1)] * num_heads)),
               w_down=jnp.asarray(np.stack(w_down)))
  return model, Heads(config=heads.config, params=dict(heads.params, layers=[layer]))


@pytest.fixture(scope="module")
def tiny():
  return mdjax.load("random-llama-tiny")


@pytest.fixture(scope="module")
def permutation():
  return permutation_model_and_heads()


# ------------------------------------------------------------------ the heads


@pytest.mark.parametrize("num_layers", [1, 2])
def test_cached_passes_equal_the_causal_forward(tiny, num_layers):
  """Two `mtp_step` passes (a prefix, then the rest) over the heads' cache == the
  causal forward of the whole sequences; the heads differ; save/load keeps them."""
  heads = random_heads(tiny, num_layers=num_layers)
  hidden = jax.random.normal(jax.random.key(0), (2, 12, tiny.config.hidden_size))
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  segments = jnp.zeros((2, 12), jnp.int32)
  cache = KVCache.create(mtp_cache_config(tiny.config, 3, num_layers), 2, 16)
  logits = []
  for part in (slice(0, 7), slice(7, 12)):
    out, cache = mtp_step(heads.params, tiny.params, cache, hidden[:, part], positions[:, part],
                          segments[:, part], mdjax.Topology.causal(2), model_config=tiny.config)
    logits.append(out)
  want = lm_head(tiny.params, mtp_causal(heads.params, hidden, model_config=tiny.config),
                 config=tiny.config)  # [B, T, K, V]
  np.testing.assert_allclose(jnp.concatenate(logits, axis=1), want, atol=2e-4, rtol=1e-4)
  assert cache.length.tolist() == [12, 12]
  assert float(jnp.abs(want[:, :, 0] - want[:, :, 1]).max()) > 0.1


def test_saved_heads_load_as_they_were(tiny, tmp_path):
  heads = random_heads(tiny, num_layers=2)
  save_heads(heads, tmp_path / "mtp")
  loaded = load_heads(tmp_path / "mtp")
  assert loaded.config == heads.config
  assert jax.tree.structure(loaded.params) == jax.tree.structure(heads.params)
  for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(heads.params)):
    assert np.array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------------ decoding


@pytest.mark.parametrize("strategy,options", [
    ("medusa", dict()), ("blockwise", dict()),
    ("medusa", dict(tree=((0,), (1,), (2,)))),  # depth 1: only head 1 runs, and its cache
])
def test_greedy_output_equals_the_target_greedy(tiny, strategy, options):
  greedy = mdjax.generate(tiny, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
  out = mdjax.generate(tiny, PROMPTS, strategy=strategy, heads=random_heads(tiny),
                       max_new_tokens=NEW, eos_token_id=[], **options)
  assert out.sequences == greedy.sequences
  stats = out.stats
  assert 0 < stats["accepted"] < stats["drafted"]
  assert stats["draft_passes"] == stats["target_passes"]  # one heads pass per verify


def test_heads_inside_every_branch_equal_multi_question(tiny):
  contexts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10]]
  questions = [[[7, 8], [5], [6, 7, 8, 5]], [[11, 9]]]
  kwargs = dict(questions=questions, max_new_tokens=24, eos_token_id=[])
  plain = mdjax.generate(tiny, contexts, strategy="multi_question", **kwargs)
  out = mdjax.generate(tiny, contexts, strategy="medusa", heads=random_heads(tiny), **kwargs)
  assert out.sequences == plain.sequences and out.stats["accepted"] > 0


@pytest.mark.parametrize("strategy", ["medusa", "blockwise"])
def test_heads_that_know_the_future_accept_the_whole_depth(permutation, strategy):
  """Every verify accepts 3 nodes (the tree's depth) and adds the target's token:
  NEW = 40 = 1 + 9 x 4 + 3 in 10 passes."""
  model, heads = permutation
  greedy = mdjax.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
  out = mdjax.generate(model, PROMPTS, strategy=strategy, heads=heads, max_new_tokens=NEW,
                       eos_token_id=[])
  assert out.sequences == greedy.sequences
  assert out.stats["target_passes"] == 10 and out.stats["accepted_at"] == [30, 30, 30]
  assert out.stats["mean_accepted_length"] == 3


def test_the_heads_cache_catches_up_on_the_committed_text(tiny):
  """After prefill and 3 steps: the heads' logits at the last committed token (the
  next tree's) == `mtp_causal` over the whole committed text's hidden states, and
  their cache holds exactly that text."""
  heads = random_heads(tiny)
  plan = _prepare(tiny, PROMPTS, "medusa", NEW, [], 0, dict(heads=heads))

  @jax.jit
  def run(params, prompt, limits):
    first = _start(plan.decoder, params, prompt, limits, **plan.static)
    return jax.lax.fori_loop(0, 3, lambda _, s: plan.decoder.step(params, s), first)

  @jax.jit
  def causal(tokens):  # [B, T] -> [B, T, K, V]: every head's logits, no cache
    hidden = forward_causal(tiny.params, tokens, config=tiny.config)
    return lm_head(tiny.params, mtp_causal(heads.params, hidden, model_config=tiny.config),
                   config=tiny.config)

  state = run(plan.params, plan.prompt, plan.limits)
  counts = np.asarray(state.buffer.count)
  assert (counts > 3).all() and len(set(counts.tolist())) > 1  # ragged acceptances
  # the last emitted token is not fed yet; right padding changes no causal position before it
  committed = [p + np.asarray(state.buffer.tokens[r, :counts[r] - 1]).tolist()
               for r, p in enumerate(PROMPTS)]
  tokens = np.zeros((len(committed), max(map(len, committed))), np.int32)
  for row, sequence in enumerate(committed):
    tokens[row, :len(sequence)] = sequence
  lengths = np.array(list(map(len, committed)))
  want = causal(jnp.asarray(tokens))[np.arange(len(committed)), lengths - 1]  # [B, K, V]
  got = lm_head(tiny.params, state.read.features, config=tiny.config)
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
  assert np.asarray(state.read.cache.length).tolist() == lengths.tolist()


# ------------------------------------------------------------------ training


def test_training_lowers_the_loss_and_the_export_calibrates_a_tree(tmp_path):
  """12 steps on the cycle model's text (`tests.helpers.cycle_model`: token t + 1 + k
  is a function of token t, which untrained heads miss by ~40 logits)."""
  base = cycle_model()
  rng = np.random.default_rng(0)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps(np.roll(CYCLE, -rng.integers(16))[:rng.integers(2, 6)]
                                        .tolist()) + "\n" for _ in range(12)))
  config = heads_tiny_test.get_config()
  config.data.prompts = str(prompts)
  config.update(run_dir=str(tmp_path / "run"), family="mtp", num_heads=2,
                steps=12, batch_size=4, log_every=1, eval_every=12, checkpoint_every=12)
  run = heads_lib.train(config, model=base, progress=False)
  losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text()
                                   .splitlines()) if "loss" in r]
  assert len(losses) == 12 and losses[-1] < 0.2 * losses[0]
  assert min(run.heldout["heldout_top1"]) > 0.2

  loaded = load_heads(run.export_dir)
  assert loaded.config == run.heads.config and loaded.config.family == "mtp"
  for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(run.heads.params)):
    assert np.array_equal(np.asarray(got), np.asarray(want))
  accuracy = loaded.config.top_accuracy
  assert len(accuracy) == 2 and len(accuracy[0]) == 10
  assert "2 parallel MTP heads" in loaded.card and "strategy='medusa'" in loaded.card
  medusa = Medusa(model=ModelFn(config=base.config), heads=loaded.config, tree_budget=0)
  assert medusa.nodes == check_tree(build_tree(accuracy, DEFAULT_BUDGET), 2, 256)


# ------------------------------------------------------------------ bad input


def test_heads_for_another_model_are_named(tiny):
  narrow = random_model("llama", 0, vocab_size=256, hidden=32)
  with pytest.raises(mdjax.MdjaxError, match=r"trained on 'random-llama-0' \(hidden size 32\) "
                                             r"and cannot run on this model \(hidden size 64\)"):
    mdjax.generate(tiny, [1, 2], strategy="medusa", heads=random_heads(narrow))
  same_width = random_model("llama", 0, vocab_size=256, hidden=64)  # other layer sizes
  with pytest.raises(mdjax.MdjaxError, match=r"the mtp heads 'random-llama-0' do not fit this "
                                             r"model: layers.0.w_down is shape \(3, 48, 64\), "
                                             r"expected shape \(3, 128, 64\)"):
    mdjax.generate(tiny, [1, 2], strategy="blockwise", heads=random_heads(same_width))


def test_mtp_heads_are_not_eagle_heads_and_share_the_unembedding(tiny):
  with pytest.raises(mdjax.MdjaxError, match=r"strategy 'eagle' needs heads of family 'eagle' or 'eagle3', "
                                             r"got mtp heads"):
    mdjax.generate(tiny, [1, 2], strategy="eagle", heads=random_heads(tiny))
  with pytest.raises(mdjax.MdjaxError, match=r"only medusa and eagle3 heads have their own unembedding; "
                                             r"mtp heads share the model's"):
    mtp_config(tiny, own_unembedding=True)
