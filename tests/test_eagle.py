"""eagle: greedy output == the target's greedy decoding for any EAGLE head and tree
shape (ragged rows, EOS inside an accepted path, a cache filled exactly); a head that
guesses the target's tokens accepts the whole depth every step; the features the head
reads are the target's hidden states (a reference simulation of EAGLE counts the
same acceptances) and its own predicted ones along the drafted tree; sampled output
follows the target's sampling law (chi-square); bad options."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax.heads import Heads, HeadsConfig, eagle_causal, init_heads
from mdjax.models.model import Model
from mdjax.models.transformer import forward_causal, lm_head
from mdjax.sampling import Sampling
from mdjax.strategies.base import ModelFn
from mdjax.strategies.eagle import Eagle
from tests.helpers import chi_square_p_value, random_model, target_law

# Ragged rows; row 0 is a whole prompt bucket (16) and 64 new tokens a whole budget
# bucket, so with the full depth accepted every step its caches are filled exactly.
PROMPTS = [list(range(3, 19)), [9, 10, 11, 12, 13]]
NEW = 64


def eagle_heads_config(model: Model, vocab_size: int | None = None) -> HeadsConfig:
  c = model.config
  return HeadsConfig(family="eagle", base_model=model.name, base_family=c.family,
                     hidden_size=c.hidden_size, vocab_size=vocab_size or c.vocab_size)


def quiet(model: Model, mix: float, sharpen: float = 1.0) -> Model:
  """`model` with its attention and MLP outputs (`wo`, `w_down`) scaled by `mix` and its
  logits by `sharpen`. At mix 0 the hidden state at t is the final norm of x_t's
  embedding: the next greedy token depends on the last token only."""
  layers = [dict(lp, wo=mix * lp["wo"], w_down=mix * lp["w_down"])
            for lp in model.params["layers"]]
  params = dict(model.params, layers=layers)
  unembedding = "embed" if model.config.tie_word_embeddings else "lm_head"
  params[unembedding] = sharpen * params[unembedding]  # (tied: the norm undoes it in the input)
  return Model(config=model.config, params=params, name=model.name)


def echo_head(model: Model, feature_mix: float = 0.0, attention: float = 0.0,
              seed: int = 0) -> Heads:
  """An EAGLE head that predicts the final norm of the current token's embedding: fc
  = [I; feature_mix * R] (the embedding, plus a random map of the feature scaled to
  `feature_mix` times the embeddings' size), `wo` scaled by `attention` (0: the head's
  cache is never read), zero `w_down`, and the model's final norm. On `quiet(model, 0)`
  it predicts the target's hidden state, hence its next token, exactly."""
  heads = init_heads(eagle_heads_config(model), model.config, seed)
  d = model.config.hidden_size
  size = float(jnp.sqrt(jnp.mean(jnp.square(model.params["embed"]))))
  mixing = jax.random.normal(jax.random.key(seed + 5), (d, d)) / np.sqrt(d)
  layers = [dict(lp, wo=attention * lp["wo"], w_down=jnp.zeros_like(lp["w_down"]))
            for lp in heads.params["layers"]]
  params = dict(heads.params, fc=jnp.concatenate([jnp.eye(d), feature_mix * size * mixing]),
                layers=layers, final_norm=model.params["final_norm"])
  return Heads(config=heads.config, params=params)


@pytest.fixture(scope="module")
def targets():
  return [mdjax.load("random-llama-tiny"), random_model("qwen3", 2)]


@pytest.fixture(scope="module")
def greedy(targets):
  return [mdjax.generate(t, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences
          for t in targets]


@pytest.fixture(scope="module")
def echo_target(targets):
  """The llama whose greedy continuation is decided by the last token, its logits
  sharpened so that the greedy path outscores every other drafted one."""
  return quiet(targets[0], 0.0, sharpen=1000.0)


@pytest.fixture(scope="module")
def near_target(targets):
  """The llama with its layers' outputs scaled by 0.7 and its logits sharpened: the
  echo head's guesses are often right, rows and depths accept differently."""
  return quiet(targets[0], 0.7, sharpen=30.0)


def _eagle(model, heads, depth, top_k, budget, **options):
  return mdjax.generate(model, PROMPTS, strategy="eagle", heads=heads, tree_depth=depth,
                        tree_top_k=top_k, tree_budget=budget, max_new_tokens=NEW,
                        **{"eos_token_id": [], **options})


@pytest.mark.parametrize("index", [0, 1])
def test_random_heads_equal_target_greedy(targets, greedy, index):
  """Untrained heads: nearly every node rejected; llama and qwen3."""
  target = targets[index]
  heads = init_heads(eagle_heads_config(target), target.config, seed=3)
  out = _eagle(target, heads, 3, 3, 10, return_metadata=True)
  assert out.sequences == greedy[index]
  stats = out.stats
  assert stats["draft_passes"] == 3 * stats["target_passes"]
  assert stats["drafted"] == sum(stats["drafted_at"]) and stats["drafted"] % 10 == 0
  assert stats["accepted"] == sum(stats["accepted_at"])
  assert stats["generated_tokens"] == 2 * NEW
  _check_metadata(target, out)


def _check_metadata(target, out):
  """Each token's target probability is the target's after the text before it; the
  drafted flags add up to the accepted nodes."""
  assert sum(sum(m["drafted"]) for m in out.metadata) == out.stats["accepted"]
  for prompt, sequence, meta in zip(PROMPTS, out.sequences, out.metadata):
    logits = mdjax.forward_logits(target, prompt + sequence)[len(prompt) - 1:-1]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(meta["target_prob"], probs[np.arange(NEW), sequence], atol=1e-4)
    for token, drafted, rejected in zip(sequence, meta["drafted"], meta["rejected"]):
      assert rejected != token and not (drafted and rejected != -1)


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 3, 10), (4, 2, 8)])
def test_partly_right_heads_equal_target_greedy(near_target, shape):
  """Paths of every length accepted, rows differently, for several tree shapes
  (depth, top_k, budget)."""
  expected = mdjax.generate(near_target, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences
  out = _eagle(near_target, echo_head(near_target), *shape)
  assert out.sequences == expected
  accepted = out.stats["accepted_at"]
  assert 0 < accepted[-1] and (shape[0] == 1 or accepted[-1] < accepted[0])
  assert out.stats["target_passes"] < NEW - 1


@pytest.mark.parametrize("shape,passes", [((2, 2, 6), 21), ((4, 2, 8), 13)])
def test_head_guessing_the_target_accepts_the_full_depth(echo_target, shape, passes):
  """Every step accepts tree_depth nodes + the target's token: 63 tokens after the
  first in ceil(63 / (depth + 1)) passes; at depth 2, 21 x 3 fills row 0's caches
  exactly (a slot leaked per step would overflow)."""
  depth = shape[0]
  expected = mdjax.generate(echo_target, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences
  out = _eagle(echo_target, echo_head(echo_target), *shape)
  assert out.sequences == expected
  assert out.stats["target_passes"] == passes == -(-(NEW - 1) // (depth + 1))
  assert out.stats["accepted_at"] == [2 * passes] * depth
  assert out.stats["mean_accepted_length"] == depth
  assert out.stats["draft_passes"] == depth * passes


def test_eos_inside_an_accepted_path(echo_target):
  """EOS is the second node of the first accepted path (its first occurrence)."""
  expected_all = mdjax.generate(echo_target, PROMPTS, max_new_tokens=NEW,
                                eos_token_id=[]).sequences
  eos = expected_all[0][2]
  assert eos not in expected_all[0][:2]
  out = _eagle(echo_target, echo_head(echo_target), 2, 2, 6, eos_token_id=eos)
  expected = mdjax.generate(echo_target, PROMPTS, max_new_tokens=NEW, eos_token_id=eos).sequences
  assert out.sequences == expected and len(expected[0]) == 3


def _simulated_acceptances(target: Model, heads: Heads, prompt, continuation, depth: int):
  """EAGLE with a chain (top_k 1) written out on whole sequences: at the last emitted
  token c, the head (`eagle_causal`) reads the text up to c with the target's hidden
  states shifted by one (zeros at position 0), then each drafted token with the
  feature it predicted before it; greedy acceptance. Accepted nodes per depth."""
  sequence = prompt + continuation  # the target's greedy text, `depth` tokens past NEW
  hidden = forward_causal(target.params, jnp.asarray([sequence]), config=target.config)[0]
  shifted = np.asarray(jnp.pad(hidden[:-1], ((1, 0), (0, 0))))  # [T, H]
  head = jax.jit(lambda tokens, features: eagle_causal(  # [T, H] the feature predicted at every token
      heads.params, target.params, tokens[None], features[None], model_config=target.config)[0])
  accepted_at, emitted, c = np.zeros(depth, int), 1, len(prompt)
  while emitted < NEW:
    tokens, features = np.zeros(len(sequence), np.int32), np.zeros_like(shifted)
    tokens[:c + 1], features[:c + 1] = sequence[:c + 1], shifted[:c + 1]
    accepted = 0
    for level in range(depth):
      predicted = head(jnp.asarray(tokens), jnp.asarray(features))[c + level]
      guess = int(jnp.argmax(lm_head(target.params, predicted, config=target.config)))
      if guess != sequence[c + level + 1]:
        break
      tokens[c + level + 1], features[c + level + 1] = guess, predicted
      accepted += 1
    accepted_at[:accepted] += 1
    emitted, c = emitted + accepted + 1, c + accepted + 1
  return accepted_at


def test_features_are_the_targets_hidden_states(near_target):
  """A head that reads its features and attends to its cache (rejecting more when
  either is wrong): the acceptances per depth are those of a reference written on
  whole sequences."""
  heads, depth = echo_head(near_target, feature_mix=0.3, attention=3.0), 3
  out = _eagle(near_target, heads, depth, 1, depth)
  longer = mdjax.generate(near_target, PROMPTS, max_new_tokens=NEW + depth,
                          eos_token_id=[]).sequences
  simulated = sum(_simulated_acceptances(near_target, heads, prompt, continuation, depth)
                  for prompt, continuation in zip(PROMPTS, longer))
  assert out.stats["accepted_at"] == simulated.tolist()
  assert 0 < simulated[-1] < simulated[0] < out.stats["target_passes"]


def test_drafted_nodes_read_their_parents_predicted_feature(targets):
  """The tree loop with a stand-in head whose 'predicted feature' is the token it was
  fed: a node fed with feature f guesses the tokens from (token + f) on, so every node
  at depth 3 must lie just above its parent's token + its grandparent's."""
  vocab, k, c0 = 64, 2, 5
  config = targets[1].config
  strategy = Eagle(model=ModelFn(config=config), heads=eagle_heads_config(targets[1]),
                   tree_depth=3, tree_top_k=k, tree_budget=10)

  def stand_in(cache, tokens, positions, segments, topology, features):
    center = (tokens + features[..., 0].astype(jnp.int32)) % vocab  # [B, K]
    logits = -((jnp.arange(vocab) - center[..., None]) % vocab).astype(jnp.float32)
    return logits, tokens[..., None].astype(jnp.float32), cache

  state = types.SimpleNamespace(buffer=types.SimpleNamespace(done=jnp.zeros((1,), bool)),
                                next_pos=jnp.asarray([4]),
                                limits=types.SimpleNamespace(sampling=Sampling.argmax()))
  tree, _ = strategy.draft_tree(stand_in, state, -jnp.abs(jnp.arange(vocab) - 30.0)[None],
                                 jnp.zeros(()), jnp.full((1, k, 1), float(c0)))
  tokens, parent, depth = (np.asarray(x)[0] for x in (tree.tokens, tree.parent, tree.depth))
  for n in np.flatnonzero(depth > 1):
    p = parent[n]
    fed_feature = c0 if depth[p] == 1 else tokens[parent[p]]
    assert (tokens[n] - tokens[p] - fed_feature) % vocab < k, n
  assert (depth == 3).sum() == k * k


def test_eagle_sampling_follows_the_target_law(targets):
  """3000 independent rows: the second token is decided at the tree's root, the third
  one level deeper (or by the residual or the bonus token). Chi-square p > 1e-3."""
  target = quiet(targets[0], 0.3, sharpen=30.0)
  prompt, draws, options = [4, 5, 6, 7], 3000, dict(temperature=0.9, top_k=20)
  out = mdjax.generate(target, [prompt] * draws, strategy="eagle", heads=echo_head(target),
                       tree_depth=2, tree_top_k=2, tree_budget=4, max_new_tokens=3,
                       eos_token_id=[], seed=5, **options)
  accepted, verified = out.stats["accepted_at"], out.stats["drafted"] // 4  # row-steps
  assert 0 < accepted[1] < accepted[0] < verified  # acceptances and rejections at both depths
  for position in (1, 2):
    sample = [s[position] for s in out.sequences]
    assert chi_square_p_value(sample, target_law(target, prompt, position, options)) > 1e-3


@pytest.mark.parametrize("options,match", [
    (dict(heads=None), r"strategy 'eagle' needs heads=<an mdjax.Heads of family 'eagle' or 'eagle3'> "
                       r"\(mdjax.load_heads\), got None"),
    (dict(heads="smollm2-135m-instruct-eagle"), r"needs heads=.*got a str"),
    (dict(tree_depth=0), r"tree_depth must be an integer >= 1, got 0"),
    (dict(tree_top_k=257), r"tree_top_k \(257\) exceeds the vocabulary \(256 tokens\)"),
    (dict(tree_depth=2, tree_top_k=2, tree_budget=7),
     r"tree_budget \(7\) exceeds the 6 nodes drafted with tree_depth 2 and tree_top_k 2"),
    (dict(num_heads=3), r"unknown option 'num_heads' for strategy 'eagle'"),
])
def test_bad_options(targets, options, match):
  target = targets[0]
  heads = init_heads(eagle_heads_config(target), target.config)
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(target, [1, 2], strategy="eagle", **{"heads": heads, **options})


def test_heads_of_another_family_or_model_are_refused(targets):
  llama, qwen3 = targets
  c = llama.config
  medusa = init_heads(HeadsConfig(family="medusa", base_model="random-llama-tiny",
                                  base_family="llama", hidden_size=c.hidden_size,
                                  vocab_size=c.vocab_size, num_heads=2), c)
  with pytest.raises(mdjax.MdjaxError, match=r"strategy 'eagle' needs heads of family 'eagle' or 'eagle3', "
                                             r"got medusa heads trained on 'random-llama-tiny'"):
    mdjax.generate(llama, [1, 2], strategy="eagle", heads=medusa)
  for_qwen3 = init_heads(eagle_heads_config(qwen3), qwen3.config)
  with pytest.raises(mdjax.MdjaxError, match=r"trained on 'random-qwen3-2' \(family qwen3\) and "
                                             r"cannot run on this model \(family llama\)"):
    mdjax.generate(llama, [1, 2], strategy="eagle", heads=for_qwen3)
