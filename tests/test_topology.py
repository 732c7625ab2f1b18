"""Topology invariants: a branch decoded inside a shared cache == decoded alone.

Random segment trees (forks at random positions, interleaved slot writes in
random order, padding tokens, dead slots, rows of different lengths): every
token's logits, at the step it was fed, must equal the logits of its root-to-leaf
path decoded alone from an empty cache. Cache operations (rollback, kill, remap +
compact, gather) must leave logits exactly as if the removed tokens never existed.
The block-sparse path must equal the dense reference, and so must the cascade
path over a cache laid out in one region per branch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import cache as cache_ops
from mdjax import platform
from mdjax.cache import CacheRegions, KVCache
from mdjax.errors import MdjaxError
from mdjax.models.layer_loop import with_layer_loop
from mdjax.models.config import ModelConfig
from mdjax.models.random_init import init_params
from mdjax.step import decode_step
from mdjax.strategies.base import region_prompt_slots, region_slot_base
from mdjax.strategies.prompt_layouts import layout_prompts
from mdjax.models import attention
from mdjax.topology import Topology, visibility_limits, visible

ATOL = 2e-5
BLOCK = 8  # small key blocks so the block-sparse path really skips blocks

CONFIGS = {
    "llama-gqa": ModelConfig(family="llama", vocab_size=97, hidden_size=32, intermediate_size=48,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                             max_position_embeddings=256),
    "qwen3-qknorm": ModelConfig(family="qwen3", vocab_size=97, hidden_size=32,
                                intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=16, qk_norm=True, qkv_bias=True,
                                max_position_embeddings=256),
    "mistral-window": ModelConfig(family="mistral", vocab_size=97, hidden_size=32,
                                  intermediate_size=48, num_layers=2, num_heads=4,
                                  num_kv_heads=4, head_dim=8, sliding_window=5,
                                  max_position_embeddings=256),
    # the window on layers 0 and 2 only, each kind of layer with its own RoPE
    "gemma3-mixed": ModelConfig(family="gemma3", vocab_size=97, hidden_size=32,
                                intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                                head_dim=8, qk_norm=True, sliding_window=5,
                                layer_types=("sliding_attention", "full_attention",
                                             "sliding_attention"),
                                sliding_rope_theta=100.0, query_pre_attn_scalar=12,
                                max_position_embeddings=256),
}


def _params(config):
  # std 0.3 makes attention weights far from uniform, so a wrong mask shows.
  return init_params(config, seed=1, std=0.3)


def step(params, cache, tokens, positions, segments, topology, config, attention="block_sparse"):
  return decode_step(params, cache, jnp.asarray(tokens, jnp.int32),
                     jnp.asarray(positions, jnp.int32), jnp.asarray(segments, jnp.int32),
                     topology, config=config, attention=attention, block_size=BLOCK)


def alone(params, config, path):
  """Logits [len(path), V] of `path` decoded alone: one segment, positions 0..n-1.
  Causal, so tokens after the path change none of its logits: the path is fed
  followed by token 0 up to a whole block, one program per block count rather than
  per path length."""
  n = len(path)
  padded = n + (-n) % BLOCK
  cache = KVCache.create(config, 1, padded)
  logits, _, _ = step(params, cache, [list(path) + [0] * (padded - n)], [list(range(padded))],
                      [[0] * padded], Topology.causal(1), config, attention="dense")
  return np.asarray(logits[0, :n])


@dataclasses.dataclass
class Tree:
  parent: list
  fork: list
  tokens: list  # own tokens per segment
  junk: list  # segments whose slots get killed

  def path(self, g):
    if self.parent[g] < 0:
      return list(self.tokens[g])
    return self.path(self.parent[g])[:self.fork[g]] + list(self.tokens[g])


def random_tree(rng, num_segments, vocab, num_junk=1):
  parent, fork, tokens = [-1], [0], [rng.integers(0, vocab, rng.integers(3, 12))]
  tree = Tree(parent, fork, tokens, junk=[])
  for g in range(1, num_segments):
    p = int(rng.integers(0, g))
    while p in tree.junk:
      p = int(rng.integers(0, g))
    parent.append(p)
    fork.append(int(rng.integers(0, len(tree.path(p)) + 1)))
    tokens.append(rng.integers(0, vocab, rng.integers(1, 7)))
    if g >= num_segments - num_junk:
      tree.junk.append(g)
  return tree


def schedule(rng, tree):
  """(step, seg, pos, token) for every token; a token is fed no earlier than any
  token it sees (tokens of one step see each other)."""
  path_steps, feeds = {}, []
  for g in range(len(tree.parent)):
    inherited = [] if tree.parent[g] < 0 else path_steps[tree.parent[g]][:tree.fork[g]]
    steps = list(inherited)
    for i, token in enumerate(tree.tokens[g]):
      s = max(steps, default=0) + int(rng.integers(0, 2))
      steps.append(s)
      feeds.append((s, g, len(inherited) + i, int(token)))
    path_steps[g] = steps
  return feeds


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("attention", ["block_sparse", "dense", "fused"])
def test_random_trees_equal_paths_decoded_alone(name, attention):
  config = CONFIGS[name]
  params = _params(config)
  rng = np.random.default_rng(0)
  batch, num_segments = 3, 6
  trees = [random_tree(rng, num_segments, config.vocab_size) for _ in range(batch)]
  feeds = [schedule(rng, t) for t in trees]
  num_steps = max(f[0] for row in feeds for f in row) + 1
  per_step = [[[f for f in row if f[0] == s] for s in range(num_steps)] for row in feeds]
  width = max(len(x) for row in per_step for x in row) + 2
  topology = Topology(parent=jnp.asarray([t.parent for t in trees], jnp.int32),
                      fork=jnp.asarray([t.fork for t in trees], jnp.int32))
  cache = KVCache.create(config, batch, 8 * BLOCK)
  got = {}  # (row, seg, pos) -> logits
  for s in range(num_steps):
    tokens = np.zeros((batch, width), np.int32)
    positions = np.zeros((batch, width), np.int32)
    segments = np.full((batch, width), -1, np.int32)  # unfilled entries are padding
    for b in range(batch):
      entries = per_step[b][s]
      where = rng.permutation(width)[:len(entries)]  # interleaved, padding in between
      for (_, g, p, t), w in zip(entries, where):
        tokens[b, w], positions[b, w], segments[b, w] = t, p, g
    logits, _, cache = step(params, cache, tokens, positions, segments, topology, config,
                            attention)
    if s == num_steps // 2:  # kill the junk segments half-way: their slots become dead
      dead = np.zeros((batch, num_segments), bool)
      for b, t in enumerate(trees):
        dead[b, t.junk] = True
      cache = cache_ops.kill_segments(cache, jnp.asarray(dead))
    for b in range(batch):
      for w in np.flatnonzero(segments[b] >= 0):
        got[b, segments[b, w], positions[b, w]] = np.asarray(logits[b, w])
  assert len(set(np.asarray(cache.length))) > 1, "rows should have different lengths"
  assert (np.asarray(cache.seg) == -1).sum() > 0
  for b, tree in enumerate(trees):
    for g in range(num_segments):
      reference = alone(params, config, tree.path(g))
      for pos in range(len(tree.path(g)) - len(tree.tokens[g]), len(tree.path(g))):
        np.testing.assert_allclose(got[b, g, pos], reference[pos], atol=ATOL,
                                   err_msg=f"row {b} segment {g} position {pos}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_branches_in_their_own_regions_equal_paths_decoded_alone(name):
  """Ragged contexts and questions, one region per branch; the shared part (12
  slots, read at once) ends where region 0 begins, which the cascade must not
  count twice; regions (21 slots) are read in chunks of 7, up to the fullest one's
  fill; branches skip some passes (padding); passes feed the branches in order
  (regions read as one slice) and reversed (each query gathers its own region)."""
  config = CONFIGS[name]
  params = _params(config)
  rng = np.random.default_rng(3)
  batch, branches, regions = 2, 3, CacheRegions(12, 21)
  contexts = [list(rng.integers(0, config.vocab_size, n)) for n in (12, 7)]
  questions = [[list(rng.integers(0, config.vocab_size, rng.integers(1, 4)))
                for _ in range(branches)] for _ in range(batch)]
  prompt = layout_prompts(contexts, questions, width=32)
  cache = KVCache.create(config, batch, regions.shared + branches * regions.size)
  logits, _, cache = decode_step(params, cache, prompt.tokens, prompt.positions, prompt.segments,
                                 prompt.topology(), config=config, logits_at=prompt.branch_last,
                                 block_size=BLOCK, slots=region_prompt_slots(prompt, regions))
  paths = [[contexts[b] + questions[b][j] for j in range(branches)] for b in range(batch)]
  got = {(b, j, len(paths[b][j]) - 1): np.asarray(logits[b, j])
         for b in range(batch) for j in range(branches)}
  base = np.asarray(region_slot_base(prompt, regions))
  for i in range(6):
    tokens = rng.integers(0, config.vocab_size, (batch, branches))
    fed = rng.random((batch, branches)) < 0.75
    positions = np.asarray([[len(p) for p in row] for row in paths])
    segments = np.where(fed, np.asarray(prompt.branch_segment), -1)
    order = np.arange(branches)[::-1 if i % 2 else 1]  # reversed: each query gathers its region
    logits, _, cache = decode_step(params, cache, jnp.asarray(tokens[:, order], jnp.int32),
                                   jnp.asarray(positions[:, order], jnp.int32),
                                   jnp.asarray(segments[:, order]), prompt.topology(),
                                   config=config, block_size=BLOCK,
                                   slots=jnp.asarray((base + positions)[:, order]),
                                   regions=regions._replace(in_order=i % 2 == 0))
    logits = np.asarray(logits)[:, np.argsort(order)]
    for b, j in zip(*np.nonzero(fed)):
      paths[b][j] = paths[b][j] + [int(tokens[b, j])]
      got[b, j, positions[b, j]] = logits[b, j]
  for b in range(batch):
    for j in range(branches):
      assert (np.asarray(cache.seg[b, base[b, j] + positions[b, j] - 1]) ==
              np.asarray(prompt.branch_segment[b, j])), "the branch's tokens fill its region"
      reference = alone(params, config, paths[b][j])
      for (row, branch, pos), value in got.items():
        if (row, branch) == (b, j):
          np.testing.assert_allclose(value, reference[pos], atol=ATOL,
                                     err_msg=f"row {b} branch {j} position {pos}")


def _prefill(params, config, tokens, slots=6 * BLOCK, batch=1):
  n = len(tokens)
  cache = KVCache.create(config, batch, slots)
  _, _, cache = step(params, cache, [tokens] * batch, [list(range(n))] * batch,
                     [[0] * n] * batch, Topology.causal(batch, 4), config)
  return cache


CONFIG = CONFIGS["llama-gqa"]


def test_rollback_forgets_rejected_tokens():
  params = _params(CONFIG)
  prefix, junk, cont = [5, 6, 7, 8], [40, 41, 42], [9, 10]
  cache = _prefill(params, CONFIG, prefix + junk)
  cache = cache_ops.rollback(cache, jnp.asarray([len(prefix)], jnp.int32))
  assert int(cache.length[0]) == len(prefix)
  logits, _, cache = step(params, cache, [cont], [[4, 5]], [[0, 0]], Topology.causal(1, 4),
                          CONFIG)
  np.testing.assert_allclose(logits[0], alone(params, CONFIG, prefix + cont)[4:], atol=ATOL)
  # rolled-back slots are reused: the continuation sits right after the prefix
  assert np.asarray(cache.pos[0, :6]).tolist() == [0, 1, 2, 3, 4, 5]


def test_gap_in_positions_is_visible_only_where_meant():
  """Junk at the *same positions* in a sibling segment is never seen."""
  params = _params(CONFIG)
  prefix = [5, 6, 7]
  cache = _prefill(params, CONFIG, prefix)
  topology = Topology.causal(1, 4).add_segment(jnp.asarray([1]), jnp.asarray([0]),
                                               jnp.asarray([3]))
  topology = topology.add_segment(jnp.asarray([2]), jnp.asarray([0]), jnp.asarray([3]))
  _, _, cache = step(params, cache, [[50, 51]], [[3, 4]], [[1, 1]], topology, CONFIG)
  logits, _, _ = step(params, cache, [[9, 10]], [[3, 4]], [[2, 2]], topology, CONFIG)
  np.testing.assert_allclose(logits[0], alone(params, CONFIG, prefix + [9, 10])[3:], atol=ATOL)


CLOSE_GAPS = {  # after the tree below: its accepted path (a, c: slots 5 and 7) to the front
    "compact": lambda cache: cache_ops.compact(cache, jnp.asarray([5]), width=BLOCK),
    "move_slots": lambda cache: cache_ops.move_slots(cache, jnp.asarray([5]),
                                                     jnp.asarray([[5, 7, 6]]), jnp.asarray([2])),
}


@pytest.mark.parametrize("close_gaps", list(CLOSE_GAPS))
def test_accepted_draft_path_remapped_and_compacted(close_gaps):
  """A draft tree is verified; the accepted path joins the main segment, the rest
  dies, and the gaps close (`compact`, or `move_slots` given the path: b's slot and
  everything after the path freed); decoding on == the accepted text alone."""
  params = _params(CONFIG)
  prefix = [3, 1, 4, 1, 5]
  cache = _prefill(params, CONFIG, prefix)
  # tree: a(seg1,pos5) -> b(seg2,pos6), c(seg3,pos6) ; accepted: a, c
  topology = Topology(parent=jnp.asarray([[-1, 0, 1, 1]]), fork=jnp.asarray([[0, 5, 6, 6]]))
  _, _, cache = step(params, cache, [[20, 21, 22]], [[5, 6, 6]], [[1, 2, 3]], topology, CONFIG)
  cache = CLOSE_GAPS[close_gaps](cache_ops.remap_segments(cache, jnp.asarray([[0, 0, -1, 0]])))
  assert int(cache.length[0]) == 7
  assert np.asarray(cache.seg[0, :8]).tolist() == [0] * 7 + [-1]
  logits, _, _ = step(params, cache, [[30]], [[7]], [[0]], Topology.causal(1, 4), CONFIG)
  np.testing.assert_allclose(logits[0, 0], alone(params, CONFIG, prefix + [20, 22, 30])[-1],
                             atol=ATOL)


def test_gather_slots_reorders_beams_without_touching_prefix():
  """Beams 1 and 2 interleaved after a shared prefix; beam 2 takes over beam 1's
  history (a beam reorder); continuing beam 2 == beam 1's text decoded alone."""
  params = _params(CONFIG)
  prefix = [7, 7, 2]
  cache = _prefill(params, CONFIG, prefix)
  topology = Topology(parent=jnp.asarray([[-1, 0, 0, -1]]), fork=jnp.asarray([[0, 3, 3, 0]]))
  for p, (t1, t2) in enumerate([(11, 12), (13, 14)], start=3):
    _, _, cache = step(params, cache, [[t1, t2]], [[p, p]], [[1, 2]], topology, CONFIG)
  prefix_k = np.asarray(cache.k[:, :, :3])
  # slots 3..6 hold beams [1, 2, 1, 2]; beam 2's slots (4, 6) take beam 1's (3, 5)
  cache = cache_ops.gather_slots(cache, jnp.asarray([3]), jnp.asarray([[3, 3, 5, 5]]), width=4)
  np.testing.assert_array_equal(np.asarray(cache.k[:, :, :3]), prefix_k)
  assert np.asarray(cache.seg[0, 3:7]).tolist() == [1, 2, 1, 2]
  logits, _, _ = step(params, cache, [[15]], [[5]], [[2]], topology, CONFIG)
  np.testing.assert_allclose(logits[0, 0], alone(params, CONFIG, prefix + [11, 13, 15])[-1],
                             atol=ATOL)


@pytest.mark.parametrize("filled, branch", [(700, False), (700, True), (300, False)])
def test_a_long_cache_read_whole_or_walked_gives_the_dense_logits(filled, branch):
  """Over a cache of `WHOLE_READ_SLOTS` slots, block_sparse reads a layer whole when its
  pass would skip no block and half the cache is filled, else walks (a dead branch's
  blocks, which no query sees; a cache under half filled): the dense reference's logits
  either way, and the choice `walk_pays` makes is the one described."""
  params = _params(CONFIG)
  slots = attention.WHOLE_READ_SLOTS
  tokens = np.random.default_rng(4).integers(0, CONFIG.vocab_size, filled).tolist()
  cache = _prefill(params, CONFIG, tokens, slots=slots)
  if branch:  # the last 2 blocks' tokens are dead (a pruned branch's): no query sees them
    cache = cache.replace(seg=jnp.where(jnp.arange(slots) < filled - 2 * BLOCK, cache.seg, -1))
  topology = Topology.causal(1, 4)
  mask = visible(visibility_limits(topology), jnp.asarray([[0]]), jnp.asarray([[filled]]),
                 cache.seg, cache.pos, None)  # what the next token sees
  assert bool(attention.walk_pays(mask, cache.length, BLOCK)) == (branch or 2 * filled < slots)
  got, expected = (step(params, jax.tree.map(jnp.copy, cache), [[3]], [[filled]], [[0]],
                        topology, CONFIG, attention=name)[0] for name in ("block_sparse", "dense"))
  np.testing.assert_allclose(got, expected, atol=ATOL)


def test_incremental_decoding_equals_full_forward():
  params = _params(CONFIG)
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, CONFIG.vocab_size, 21).tolist()
  full = alone(params, CONFIG, tokens)
  cache = _prefill(params, CONFIG, tokens[:5])
  chunks = [[5], [6, 7, 8], [9], list(range(10, 17)), [17], [18, 19, 20]]
  for chunk in chunks:
    logits, _, cache = step(params, cache, [[tokens[i] for i in chunk]], [chunk],
                            [[0] * len(chunk)], Topology.causal(1, 4), CONFIG)
    np.testing.assert_allclose(logits[0], full[chunk], atol=ATOL)


def test_padding_tokens_take_no_slot_and_see_nothing():
  params = _params(CONFIG)
  cache = _prefill(params, CONFIG, [1, 2, 3])
  logits, _, cache = step(params, cache, [[0, 4, 0]], [[0, 3, 0]], [[-1, 0, -1]],
                          Topology.causal(1, 4), CONFIG)
  assert int(cache.length[0]) == 4
  np.testing.assert_allclose(logits[0, 1], alone(params, CONFIG, [1, 2, 3, 4])[-1], atol=ATOL)
  assert np.isfinite(np.asarray(logits)).all()


def test_a_gpu_claims_a_few_slots_as_the_cpu_does():
  """Built for a GPU, `claim_slots` of a few tokens writes pos and seg by selects, not
  a scatter: the same cache, the default slots (with padding) and slots given (one
  negative, one past the end) alike."""
  cache = KVCache.create(CONFIG, 2, 8).replace(length=jnp.array([3, 8], jnp.int32))
  positions = jnp.array([[3, 4, 5], [8, 9, 10]], jnp.int32)
  segments = jnp.array([[0, -1, 1], [0, 0, 0]], jnp.int32)
  for slots in (None, jnp.array([[1, 2, -1], [7, 8, 0]], jnp.int32)):
    expected = cache_ops.claim_slots(cache, positions, segments, slots)
    with platform.building_for("gpu"):
      got = cache_ops.claim_slots(cache, positions, segments, slots)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(a, b)


def test_a_tpu_writes_a_layer_as_the_cpu_does():
  """Built for a TPU, `write_layer` writes a layer's K/V by selects over its slice, not
  a scatter into the stacked cache (XLA:TPU copied the whole cache for the scatter):
  the same cache, every other layer untouched, for slots that claim_slots gives (with
  padding past the end) and slots given (one negative, one past the end)."""
  rng = np.random.default_rng(0)
  shape = (CONFIG.num_layers, 2, 8, CONFIG.num_kv_heads, CONFIG.head_dim)
  cache = KVCache.create(CONFIG, 2, 8).replace(
      k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
      v=jnp.asarray(rng.standard_normal(shape), jnp.float32))
  new = jnp.asarray(rng.standard_normal((2, 3, *shape[3:])), jnp.bfloat16)  # [B, T, K, H]
  for slots in (jnp.array([[3, 4, 8], [5, 6, 7]], jnp.int32),
                jnp.array([[1, 2, -1], [7, 8, 0]], jnp.int32)):
    expected = cache_ops.write_layer(cache, 1, slots, new, -new)
    with platform.building_for("tpu"):
      got = jax.jit(cache_ops.write_layer, static_argnums=1)(cache, 1, slots, new, -new)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(a, b)
    assert not np.array_equal(expected.k, cache.k)  # the test writes something


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_tpu_moves_slots_as_the_cpu_does(dtype):
  """Built for a TPU, `compact`, `gather_slots` and `move_slots` move K/V (and an int8
  cache's scales) by products with one-hot columns, not a gather and a scatter: the same
  cache bit for bit, stacked and per layer, for windows inside the row, at its front and
  past its end."""
  rng = np.random.default_rng(2)
  cache = KVCache.create(CONFIG, 3, 24, dtype)
  fields = {name: jnp.asarray(rng.standard_normal(x.shape) * (60 if dtype == "int8" else 1),
                              x.dtype) for name, x in cache.slot_fields().items()}
  cache = cache.replace(**fields, seg=jnp.asarray(rng.integers(-1, 3, (3, 24)), jnp.int32),
                        pos=jnp.asarray(rng.integers(0, 24, (3, 24)), jnp.int32),
                        length=jnp.asarray([20, 24, 9], jnp.int32))
  start, source = jnp.asarray([5, 18, 0]), jnp.asarray(rng.integers(0, 24, (3, 10)), jnp.int32)
  moves = {"compact": lambda c: cache_ops.compact.__wrapped__(c, start, 10),
           "gather_slots": lambda c: cache_ops.gather_slots.__wrapped__(c, start, source, 10),
           "move_slots": lambda c: cache_ops.move_slots.__wrapped__(c, start, source,
                                                                    jnp.asarray([3, 10, 7]))}
  for layout in (cache, cache_ops.split_layers(cache)):
    for name, move in moves.items():
      expected = jax.jit(move)(layout)
      with platform.building_for("tpu"):
        got = jax.jit(lambda c, move=move: move(c))(layout)  # a program of its own
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b, err_msg=name)
      assert not np.array_equal(_stacked(expected)["k"], _stacked(layout)["k"])  # it moves


def _stacked(cache: KVCache) -> dict:
  """Every field of `cache` as numpy, per-layer K/V (and scales) stacked `[L, ...]`."""
  return {name: np.asarray(getattr(cache, name)) for name in
          ("k", "v", "pos", "seg", "length", "k_scale", "v_scale")
          if getattr(cache, name) is not None}


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_per_layer_cache_takes_every_operation_as_a_stacked_one(dtype):
  """The same writes (the CPU's scatter and the TPU's selects), reads and slot moves
  (`compact`, `move_slots`, `gather_slots`, `rollback`) on a cache held per layer give
  what they give on the stacked one, field by field."""
  rng = np.random.default_rng(1)
  stacked = KVCache.create(CONFIG, 2, 8, dtype)
  k = rng.standard_normal((2, 6, CONFIG.num_kv_heads, CONFIG.head_dim))  # [B, T, K, H]
  stacked, slots = cache_ops.claim_slots(stacked, jnp.asarray([[0, 1, 2, 3, 4, 5]] * 2),
                                         jnp.asarray([[0, 0, 1, -1, 1, 0], [0, 1, 0, 0, 1, 1]]))
  per_layer = cache_ops.split_layers(stacked)
  assert per_layer.per_layer and not stacked.per_layer and per_layer.dtype == stacked.dtype
  ops = [lambda c: cache_ops.write_layer(c, 1, slots, jnp.asarray(k), jnp.asarray(-k)),
         lambda c: cache_ops.write_layer(c, 0, slots, jnp.asarray(2 * k), jnp.asarray(k))]
  for op in ops:
    stacked, per_layer = op(stacked), op(per_layer)
    with platform.building_for("tpu"):
      tpu = jax.jit(op)(per_layer)
    for name, value in _stacked(per_layer).items():
      np.testing.assert_array_equal(_stacked(tpu)[name], value)
  moves = [lambda c: cache_ops.gather_slots(c, jnp.asarray([2, 1]), jnp.asarray([[3, 2], [5, 1]]),
                                            width=2),
           lambda c: cache_ops.compact(c, jnp.asarray([1, 2]), width=4),
           lambda c: cache_ops.move_slots(c, jnp.asarray([0, 1]), jnp.asarray([[2, 0], [3, 4]]),
                                          jnp.asarray([2, 1])),
           lambda c: cache_ops.rollback(c, jnp.asarray([1, 2]))]
  for op in [None] + moves:
    if op is not None:
      stacked, per_layer = op(stacked), op(per_layer)
    expected = _stacked(stacked)
    for name, value in _stacked(per_layer).items():
      np.testing.assert_array_equal(value, expected[name], err_msg=name)
    for layer in range(CONFIG.num_layers):
      for a, b in zip(cache_ops.read_kv(per_layer, layer), cache_ops.read_kv(stacked, layer)):
        np.testing.assert_array_equal(a, b)
  assert np.abs(expected["k"]).sum() > 0  # the test wrote something


def test_a_per_layer_cache_under_the_scan_loop_is_one_clear_error():
  params = dict(_params(CONFIG))
  cache = KVCache.for_params(CONFIG, params, 1, 8)
  assert cache.per_layer  # the unrolled loop's layout
  scanned = with_layer_loop(params, "scan")
  with pytest.raises(MdjaxError, match="per-layer KV cache .* layer_loop='scan'"):
    step(scanned, cache, [[1, 2]], [[0, 1]], [[0, 0]], Topology.causal(1, 4), CONFIG)
