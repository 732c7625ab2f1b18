"""speculative: greedy output == the target's greedy decoding, whatever the draft and
the draft schedule; sampled output follows the target's sampling law (chi-square)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from configs import speculative as speculative_config
from experiments import decode
from mdjax.sampling import speculative_accept
from tests.helpers import chi_square_p_value, random_model, target_law

VOCAB = 64  # random_model's


@pytest.fixture(scope="module")
def targets():
  return [random_model("llama", 1), random_model("qwen3", 2)]


@pytest.fixture(scope="module")
def draft():
  return random_model("llama", 7, layers=1, hidden=16, heads=2, kv_heads=1)  # another shape


# The full-acceptance runs: a 16-token prompt (a whole bucket) and a shorter one, 64 new
# tokens; the EOS test below runs the same programs.
FULL_PROMPTS = [list(range(3, 19)), [9, 10, 11, 12, 13]]


def test_draft_equal_to_target_accepts_every_token(targets):
  """Also a run that fills the cache exactly: the first prompt and the budget are whole
  buckets (16 and 64), so a slot leaked per step would overflow it and change the output."""
  target = targets[0]
  greedy = mdjax.generate(target, FULL_PROMPTS, max_new_tokens=64, eos_token_id=[]).sequences
  for gamma in (1, 3):
    out = mdjax.generate(target, FULL_PROMPTS, strategy="speculative", draft=target,
                         num_draft_tokens=gamma, max_new_tokens=64, eos_token_id=[])
    assert out.stats["accepted"] == out.stats["drafted"]
    assert out.stats["target_passes"] == -(-63 // (gamma + 1))  # (gamma + 1) tokens per pass
    assert out.sequences == greedy


# Each target with each kind of draft (`draft`, of another shape; a random model of the
# target's own family and shape), and each chain length with each kind: a draft's shape and
# the chain's length shape different parts of the program (the draft's pass; the chain
# loop and the verify width), so these four runs meet every pair of them that the eight
# combinations would.
@pytest.mark.parametrize("gamma", [1, 5])  # the shortest and a long chain (3: above)
def test_speculative_equals_target_greedy(targets, draft, gamma):
  rng = np.random.default_rng(gamma)
  for i, target in enumerate(targets):
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (9, 2, 5)]
    greedy = mdjax.generate(target, prompts, max_new_tokens=29, eos_token_id=[])
    d = draft if (i + (gamma > 1)) % 2 == 0 else random_model(target.config.family, 11)
    out = mdjax.generate(target, prompts, strategy="speculative", draft=d,
                         num_draft_tokens=gamma, max_new_tokens=29, eos_token_id=[])
    assert out.sequences == greedy.sequences
    assert out.stats["draft_passes"] == gamma * out.stats["target_passes"]
    assert 0 < out.stats["accepted"] < out.stats["drafted"]  # drafts kept and rejected


def test_eos_inside_an_accepted_block(targets):
  """Draft == target, 3 tokens a chain: 4 tokens a pass after the first, so the 7th
  token ends its first row in the middle of an accepted block; the other row goes on."""
  target = targets[0]
  free = mdjax.generate(target, FULL_PROMPTS, max_new_tokens=64, eos_token_id=[]).sequences
  eos = free[0][6]
  out = mdjax.generate(target, FULL_PROMPTS, strategy="speculative", draft=target,
                       num_draft_tokens=3, max_new_tokens=64, eos_token_id=eos)
  assert out.sequences == mdjax.generate(target, FULL_PROMPTS, max_new_tokens=64,
                                         eos_token_id=eos).sequences
  assert out.sequences[0][-1] == eos and len(out.sequences[1]) > 7


SCHEDULE_PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3]]


# Each schedule with both drafts (one rejects often, the target's own accepts every
# token: the budget shrinks and grows), on one target each, both targets between them: a
# schedule sets the chain's budget from the draft's confidences and the accepted counts,
# whatever model verifies (both families verify every chain length: above).
@pytest.mark.parametrize("schedule, target_index", [
    (dict(draft_schedule="heuristic", num_draft_tokens=1, max_draft_tokens=6), 0),
    (dict(confidence_threshold=0.3, num_draft_tokens=4), 1),
    (dict(draft_schedule="heuristic", num_draft_tokens=1, confidence_threshold=0.2), 0),
])
def test_draft_schedules_stay_greedy_exact(targets, draft, schedule, target_index):
  target = targets[target_index]
  greedy = mdjax.generate(target, SCHEDULE_PROMPTS, max_new_tokens=27,
                          eos_token_id=[]).sequences
  for d in (draft, target):
    out = mdjax.generate(target, SCHEDULE_PROMPTS, strategy="speculative", draft=d,
                         max_new_tokens=27, eos_token_id=[], **schedule)
    assert out.sequences == greedy


def test_heuristic_grows_the_chain_while_everything_is_accepted(targets):
  """Draft == target: budgets 1, 3, 5, 6, 6, ... tokens (+2 per full accept, capped), in
  each of the three rows (the first schedule's program above)."""
  target = targets[0]
  out = mdjax.generate(target, SCHEDULE_PROMPTS, strategy="speculative", draft=target,
                       draft_schedule="heuristic", num_draft_tokens=1, max_draft_tokens=6,
                       max_new_tokens=1 + 2 + 4 + 6 + 7 + 7, eos_token_id=[])
  assert out.stats["drafted_at"] == [3 * n for n in (5, 4, 4, 3, 3, 2)]
  assert out.stats["acceptance_rate_at"] == [1.0] * 6


def test_confidence_threshold_one_drafts_a_single_token(targets, draft):
  out = mdjax.generate(targets[0], [[4, 5, 6]], strategy="speculative", draft=draft,
                       num_draft_tokens=5, confidence_threshold=1.0, max_new_tokens=20,
                       eos_token_id=[])
  assert out.stats["drafted_at"][1:] == [0] * 4 and out.stats["drafted_at"][0] > 0
  assert out.stats["draft_passes"] == out.stats["target_passes"]


def _accept(p, q, chain, count, draws, seed=0):
  """`speculative_accept` for one row repeated over `draws` keys."""
  keys = jax.random.split(jax.random.key(seed), draws)
  tile = lambda x: jnp.broadcast_to(jnp.asarray(x), (draws, *np.shape(x)))
  accepted, token = speculative_accept(keys, tile(chain), tile(count), tile(q), tile(p))
  return np.asarray(accepted), np.asarray(token)


def test_acceptance_rule_hand_computed_cases():
  # p == q: every drafted token is kept, then the bonus token comes from p[count].
  q = np.array([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2]])
  p = np.concatenate([q, [[0.0, 0.0, 1.0]]])
  accepted, token = _accept(p, q, [1, 0], 2, 50)
  assert (accepted == 2).all() and (token == 2).all()
  # count 1: only chain[0] is verified; the bonus comes from p[1].
  accepted, token = _accept(np.array([q[0], [0, 1.0, 0], [1.0, 0, 0]]), q, [1, 0], 1, 50)
  assert (accepted == 1).all() and (token == 1).all()
  # p(x) = 0: always rejected, next token from norm(max(0, p - q)) = [0, 1, 0].
  accepted, token = _accept(np.array([[0, 0.5, 0.5], [1.0, 0, 0]]), np.array([[0.5, 0, 0.5]]),
                            [0], 1, 50)
  assert (accepted == 0).all() and (token == 1).all()
  # p = [.5, .5, 0], q = [1, 0, 0]: keep token 0 with probability 1/2, else emit 1.
  accepted, token = _accept(np.array([[0.5, 0.5, 0], [0, 0, 1.0]]), np.array([[1.0, 0, 0]]),
                            [0], 1, 4000)
  assert set(zip(accepted, token)) == {(1, 2), (0, 1)}
  assert abs(accepted.mean() - 0.5) < 0.03  # 4000 draws: sd 0.008


def test_acceptance_rule_emits_the_target_law():
  """The first emitted token ~ p[0] and the acceptance rate == sum(min(p, q)),
  for random p, q over 6 tokens with q's sample as the drafted token."""
  rng = np.random.default_rng(0)
  p, q = rng.dirichlet(np.ones(6), 2), rng.dirichlet(np.ones(6), 1)
  draws = 6000
  chains = jax.random.categorical(jax.random.key(9), jnp.log(q[0]), shape=(draws,))
  keys = jax.random.split(jax.random.key(1), draws)
  accepted, token = speculative_accept(
      keys, chains[:, None].astype(jnp.int32), jnp.ones(draws, jnp.int32),
      jnp.broadcast_to(q, (draws, 1, 6)), jnp.broadcast_to(p, (draws, 2, 6)))
  first = np.where(np.asarray(accepted) == 1, np.asarray(chains), np.asarray(token))
  assert chi_square_p_value(first, p[0]) > 1e-3
  assert abs(np.asarray(accepted).mean() - np.minimum(p[0], q[0]).sum()) < 0.025  # sd < 0.0065


@pytest.mark.parametrize("options", [dict(temperature=0.8), dict(temperature=1.2, top_k=12)])
def test_speculative_sampling_follows_the_target_law(targets, draft, options):
  """3000 independent rows; the second token is the first one speculation decides
  (accepted draft token or resample). Chi-square p > 1e-3 (fails 1 in 1000)."""
  target, prompt, draws = targets[0], [4, 5, 6, 7], 3000
  out = mdjax.generate(target, [prompt] * draws, strategy="speculative", draft=draft,
                       num_draft_tokens=2, max_new_tokens=3, eos_token_id=[], seed=3, **options)
  assert 0 < out.stats["accepted"] < out.stats["drafted"]  # both branches of the rule ran
  second = [s[1] for s in out.sequences]
  assert chi_square_p_value(second, target_law(target, prompt, 1, options)) > 1e-3


@pytest.mark.parametrize("strategy,options", [
    ("speculative", dict(num_draft_tokens=3)),
    ("speculative", dict(num_draft_tokens=3, temperature=0.7)),
    ("self_speculative", dict(draft_layers=1, num_draft_tokens=2)),
    ("prompt_lookup", dict(prompt_lookup_num_tokens=4, max_ngram_size=1)),
])
def test_per_token_metadata(targets, draft, strategy, options):
  """Each emitted token's target probability is the one the target gives it after the
  prompt and the tokens before it; drafted/rejected flags add up to the stats."""
  target, prompts = targets[0], [[5, 6, 7, 5, 6], [9, 10]]
  extra = {"draft": draft} if strategy == "speculative" else {}
  out = mdjax.generate(target, prompts, strategy=strategy, max_new_tokens=14, eos_token_id=[],
                       return_metadata=True, **extra, **options)
  assert sum(sum(m["drafted"]) for m in out.metadata) == out.stats["accepted"]
  assert sum(sum(m["accepted_per_step"]) for m in out.metadata) == out.stats["accepted"]
  temperature = options.get("temperature", 1.0)
  for prompt, sequence, meta in zip(prompts, out.sequences, out.metadata):
    assert len(meta["target_prob"]) == len(meta["drafted"]) == len(sequence) == 14
    logits = mdjax.forward_logits(target, prompt + sequence)[len(prompt) - 1:-1] / temperature
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(meta["target_prob"], probs[np.arange(14), sequence], atol=1e-4)
    assert meta["drafted"][0] is False and meta["rejected"][0] == -1
    for token, drafted, rejected in zip(sequence, meta["drafted"], meta["rejected"]):
      assert rejected != token and not (drafted and rejected != -1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_draft_tokens=0), r"num_draft_tokens must be an integer >= 1, got 0"),
    (dict(draft_schedule="fast"), r"draft_schedule must be one of constant, heuristic, got 'fast'"),
    (dict(num_draft_tokens=4, max_draft_tokens=2), r"max_draft_tokens \(2\) must be >= "),
    (dict(confidence_threshold=1.5), r"confidence_threshold must be in \[0, 1\], got 1.5"),
    (dict(draft=None), r"needs draft=<an mdjax Model>, got None"),
])
def test_bad_options(targets, draft, kwargs, match):
  with pytest.raises(mdjax.MdjaxError, match=match):
    mdjax.generate(targets[0], [1, 2], strategy="speculative", **{"draft": draft, **kwargs})


def test_draft_with_another_vocabulary_is_refused(targets):
  other = mdjax.load("random-llama-tiny")
  with pytest.raises(mdjax.MdjaxError, match=r"draft's vocabulary \(256 tokens\).*target's \(64"):
    mdjax.generate(targets[0], [1, 2], strategy="speculative", draft=other)


def test_cli_takes_the_draft_by_name():
  """configs/speculative.py with the draft named in the config == greedy via the API (the
  CLI's `decode`, in this process: tests/test_cli_configs.py runs the CLI itself)."""
  config = speculative_config.get_config()
  config.update(model="random-llama-tiny", draft="random-llama-tiny", prompt="",
                prompt_ids="5,6,7", max_new_tokens=12)
  summary = json.loads(json.dumps(decode.decode(config)))
  model = mdjax.load("random-llama-tiny")
  assert summary["sequences"] == mdjax.generate(model, [5, 6, 7], max_new_tokens=12).sequences
  assert summary["stats"]["accepted"] == summary["stats"]["drafted"]
