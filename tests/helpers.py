"""Shared test helpers: tiny random Hugging Face checkpoints, mdjax logits, greedy
comparison with transformers."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from scipy import stats as scipy_stats

from mdjax.cache import KVCache
from mdjax.checkpoints.hf_layout import SafetensorsFile
from mdjax.checkpoints.registry import RANDOM_MODELS
from mdjax.models.config import ModelConfig
from mdjax.models.model import Model
from mdjax.models.random_init import init_params
from mdjax.models.transformer import causal_logits, rms_norm
from mdjax.step import decode_step
from mdjax.topology import Topology

NEAR_TIE = 1e-5  # docs/design.md §9: a divergence is allowed only at such a near-tie
# gemma3 layers 0..2 of `random_model("gemma3", layers=3, ...)`: sliding, full, sliding
GEMMA3_MIXED = dict(layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                    sliding_window=4, sliding_rope_theta=100.0, query_pre_attn_scalar=12)

TINY_CONFIG = dict(vocab_size=192, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                   tie_word_embeddings=False)


def write_tiny_checkpoint(path, family: str = "llama", seed: int = 0, *,
                          max_shard_size: str | None = None, **config_overrides):
  """Saves a seeded random tiny `family` model (float32) into `path` with
  `save_pretrained`; returns the torch model (eval mode, eager attention).

  Every weight is redrawn so that norms and biases are far from their identity
  init (a loader that drops or misplaces one changes the logits) and attention is
  far from uniform: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms ~
  1 + N(0, 0.3), biases ~ N(0, 0.3).
  """
  config = transformers.AutoConfig.for_model(family, **{**TINY_CONFIG, **config_overrides})
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=generator)
      if name.endswith("norm.weight"):
        param.copy_(1 + 0.3 * noise)
      elif name.endswith("bias"):
        param.copy_(0.3 * noise)
      elif "embed_tokens" in name:
        param.copy_(noise)
      else:
        param.copy_(noise / math.sqrt(param.shape[1]))
  model.eval()
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(path, **kwargs)
  return model


def torch_logits(torch_model, ids) -> np.ndarray:
  """The torch model's logits `[T, V]` (float32) for one sequence of ids."""
  with torch.no_grad():
    out = torch_model(torch.tensor(np.asarray(ids), dtype=torch.long)[None])
  return out.logits[0].float().numpy()


def hf_greedy(torch_model, prompt, max_new_tokens, eos_token_id):
  """transformers' greedy continuation of `prompt` (generated ids only)."""
  with torch.no_grad():
    out = torch_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                               do_sample=False, max_new_tokens=max_new_tokens,
                               eos_token_id=eos_token_id, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def assert_same_greedy(ours, theirs, torch_model, prompt):
  """Token-equal, except that a divergence is tolerated at a genuine near-tie of
  the reference (top-2 logits within NEAR_TIE), after which nothing is compared."""
  for i, (a, b) in enumerate(zip(ours, theirs)):
    if a != b:
      with torch.no_grad():
        logits = torch_model(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
      top2 = torch.topk(logits, 2).values
      assert float(top2[0] - top2[1]) < NEAR_TIE, f"diverged at token {i}: {a} != {b}"
      return
  assert len(ours) == len(theirs)


def mdjax_logits(model: Model, ids, attention: str = "block_sparse") -> np.ndarray:
  """Plain causal forward of `ids` in one `decode_step` over an empty cache: `[T, V]`."""
  ids = np.asarray(ids)
  t = len(ids)
  cache = KVCache.create(model.config, 1, t, dtype=model.params["embed"].dtype)
  tokens = jnp.asarray(ids, jnp.int32)[None]  # [1, T]
  positions = jnp.arange(t, dtype=jnp.int32)[None]  # [1, T]
  segments = jnp.zeros((1, t), jnp.int32)  # [1, T]
  logits, _, _ = decode_step(model.params, cache, tokens, positions, segments, Topology.causal(1),
                             config=model.config, attention=attention)
  return np.asarray(logits[0])


def random_model(family: str = "llama", seed: int = 0, *, vocab_size: int = 64, layers: int = 2,
                 hidden: int = 32, heads: int = 4, kv_heads: int = 2, std: float = 0.3,
                 **extra) -> Model:
  """A tiny seeded random mdjax model (no checkpoint); std 0.3 keeps attention peaked,
  so a wrong mask or position changes the output."""
  config = ModelConfig(family=family, vocab_size=vocab_size, hidden_size=hidden,
                       intermediate_size=48, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=8, max_position_embeddings=256,
                       qk_norm=family in ("qwen3", "gemma3"), **extra)
  return Model(config=config, params=init_params(config, seed=seed, std=std),
               name=f"random-{family}-{seed}")


def expected_first_token_law(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
  """The sampling law written out independently of mdjax.sampling (numpy)."""
  z = logits.astype(np.float64) / temperature
  probs = np.exp(z - z.max())
  probs /= probs.sum()
  keep = np.ones_like(probs, bool)
  if top_k:
    keep &= probs >= np.sort(probs)[-top_k]
  if top_p < 1:
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    keep_sorted = np.zeros_like(keep)
    keep_sorted[order] = before < top_p
    keep &= keep_sorted
  filtered = np.where(keep, probs, 0)
  if min_p:
    filtered = np.where(filtered >= min_p * filtered.max(), filtered, 0)
  return filtered / filtered.sum()


def target_law(model: Model, prompt, position: int, options: dict) -> np.ndarray:
  """Exact law of generated token `position` under target sampling with `options`:
  the mixture, over every earlier generated sequence of nonzero probability, of the
  law after it (up to vocab ** position sequences: small positions only)."""
  run = jax.jit(lambda ids: causal_logits(model.params, ids, config=model.config))
  prefixes, weights = np.asarray([prompt]), np.ones(1)  # [n, P + i], [n]
  while True:
    logits = np.asarray(run(jnp.asarray(prefixes))[:, -1])  # [n, V]
    laws = np.stack([expected_first_token_law(row, **options) for row in logits])  # [n, V]
    if prefixes.shape[1] == len(prompt) + position:
      return weights @ laws
    prefix, token = np.nonzero(weights[:, None] * laws)
    prefixes = np.concatenate([prefixes[prefix], token[:, None]], axis=1)
    weights = weights[prefix] * laws[prefix, token]


def chi_square_p_value(samples, law: np.ndarray, min_expected: float = 5.0) -> float:
  """Goodness of fit of integer `samples` to the probabilities `law` [V]; tokens
  expected fewer than `min_expected` times are pooled into one bin (so the test is
  valid). Tests assert p > 1e-3: a correct sampler fails 1 time in 1000."""
  samples = np.asarray(samples)
  counts = np.bincount(samples, minlength=law.size)
  big = law * samples.size >= min_expected
  assert big.sum() >= 3, "the law is too peaked for a meaningful test"
  observed = np.append(counts[big], counts[~big].sum())
  expected = np.append(law[big], law[~big].sum()) * samples.size
  keep = expected > 0
  assert observed[~keep].sum() == 0, "sampled a token of probability 0"
  return float(scipy_stats.chisquare(observed[keep], expected[keep]).pvalue)


def edit_config(path, edit):
  """Applies `edit` (a function of the dict) to the checkpoint's config.json in place."""
  config = json.loads((path / "config.json").read_text())
  edit(config)
  (path / "config.json").write_text(json.dumps(config))


CYCLE = np.arange(3, 19)  # the synthetic base writes these ids in this order, round and round


def write_cycle_prompts(path, count: int, seed: int = 0):
  """`count` prompts, each a stretch of `CYCLE` (2..5 ids from a random start), as JSONL."""
  rng = np.random.default_rng(seed)
  lines = [np.roll(CYCLE, -rng.integers(16))[:rng.integers(2, 6)].tolist() for _ in range(count)]
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))
  return path


def cycle_model() -> Model:
  """`random-llama-tiny` turned predictable: zero attention and MLP outputs (hidden state
  at t = RMSNorm(embedding of x[t])) and an untied lm_head whose column for id j is that
  state for the id before j on the cycle, so the argmax after x[t] is its successor by a
  margin of ~40 logits (sampling at temperature 1 still follows the cycle)."""
  config = dataclasses.replace(RANDOM_MODELS["random-llama-tiny"], tie_word_embeddings=False)
  params = init_params(config, 0)
  successor = np.arange(config.vocab_size)
  successor[CYCLE] = np.roll(CYCLE, -1)
  states = rms_norm(params["embed"], jnp.ones(config.hidden_size), config.rms_norm_eps)  # [V, D]
  layers = [{**lp, "wo": jnp.zeros_like(lp["wo"]), "w_down": jnp.zeros_like(lp["w_down"])}
            for lp in params["layers"]]
  return Model(config=config, name="cycle-llama-tiny",
               params={**params, "layers": layers, "lm_head": states[np.argsort(successor)].T})


# --- every registered strategy, with options that exercise it on a tiny model ------------

LOSSLESS = {"speculative", "speculative_tree", "prompt_lookup", "lookahead", "jacobi",
            "self_speculative", "medusa", "blockwise", "eagle", "mixed"}  # greedy's tokens at temperature 0
STRATEGY_PROMPTS = [list(range(3, 19)), [9, 10, 11, 12, 13]]  # ragged
CHUNKS = [[[5, 6, 7], [8, 9]], [[10, 11], [12]]]  # skeleton_fill / margin_notes prompts


def heads_config(model: Model, family: str, **fields):
  """A `HeadsConfig` of `family` for `model`."""
  from mdjax.heads import HeadsConfig
  c = model.config
  return HeadsConfig(family=family, base_model=model.name, base_family=c.family,
                     hidden_size=c.hidden_size, vocab_size=c.vocab_size, **fields)


def random_medusa_heads(model: Model, num_heads: int = 3, seed: int = 0, std: float = 0.3):
  """Medusa heads with random residual blocks (`init_heads` leaves `w` at zero): many
  rejections, some acceptances."""
  from mdjax.heads import Heads, init_heads
  heads = init_heads(heads_config(model, "medusa", num_heads=num_heads), model.config, seed=seed)
  blocks = heads.params["blocks"]
  w = std / np.sqrt(blocks["w"].shape[-1]) * jax.random.normal(jax.random.key(seed + 1),
                                                              blocks["w"].shape)
  return Heads(config=heads.config, params={"blocks": dict(blocks, w=w)})


def strategy_heads(base: Model) -> dict:
  """Random medusa (residual blocks not zero), mtp and eagle heads for `base`."""
  from mdjax.heads import init_heads
  return {"medusa": random_medusa_heads(base, 3, seed=1),
          "mtp": init_heads(heads_config(base, "mtp", num_heads=2), base.config, seed=1),
          "eagle": init_heads(heads_config(base, "eagle"), base.config, seed=1)}


def every_strategy(draft: Model, heads: dict) -> dict:
  """Per registered strategy: (its own prompts, or [] for `STRATEGY_PROMPTS`, and options)."""
  return {
      "greedy": ([], {}),
      "sample": ([], dict(temperature=0.8, top_k=40)),
      "beam": ([], dict(num_beams=3)),
      "multi_question": ([], dict(questions=[[20, 21], [22], [23, 24, 25]])),
      "parallel_sample": ([], dict(num_samples=3, temperature=0.9)),
      "skeleton_fill": (CHUNKS, {}),
      "margin_notes": (CHUNKS, dict(instruction=[7, 8, 9])),
      "entropy_branching": ([], dict(num_branches=2, branch_tokens=3, branch_entropy=0.0)),
      "speculative": ([], dict(draft=draft, num_draft_tokens=3)),
      "speculative_tree": ([], dict(draft=draft, tree_depth=2, tree_top_k=2, tree_budget=4)),
      "prompt_lookup": ([], dict(prompt_lookup_num_tokens=3, max_ngram_size=2)),
      "lookahead": ([], dict(window=3, ngram=3, guess_set=2)),
      "jacobi": ([], dict(window=3)),
      "self_speculative": ([], dict(draft_layers=1, num_draft_tokens=3)),
      "medusa": ([], dict(heads=heads["medusa"])),
      "blockwise": ([], dict(heads=heads["mtp"])),
      "eagle": ([], dict(heads=heads["eagle"], tree_depth=2, tree_top_k=2, tree_budget=4)),
      "mixed": ([], dict(heads=heads["mtp"], draft=draft, tree_budget=5, num_draft_tokens=2,
                         prompt_lookup_num_tokens=3)),
  }


def run_strategy(model: Model, strategy: str, request: tuple, max_new_tokens: int = 12):
  """`mdjax.generate` of one `every_strategy` entry (seed 3, no EOS)."""
  import mdjax
  prompts, options = request
  prompts = prompts or (STRATEGY_PROMPTS[:1] if strategy == "multi_question"
                        else STRATEGY_PROMPTS)
  return mdjax.generate(model, prompts, strategy=strategy, max_new_tokens=max_new_tokens,
                        eos_token_id=[], seed=3, **options)


@contextlib.contextmanager
def recorded_reads():
  """Every read of a safetensors tensor while in the block, as (HF name, block): one
  (start, stop) per dimension, the whole tensor for `get`."""
  reads, real_get, real_slice = [], SafetensorsFile.get, SafetensorsFile.get_slice

  def get(self, name, shape):
    reads.append((name, tuple((0, n) for n in shape)))
    return real_get(self, name, shape)

  def get_slice(self, name, shape, index):
    reads.append((name, tuple(s.indices(n)[:2] for s, n in zip(index, shape))))
    return real_slice(self, name, shape, index)

  SafetensorsFile.get, SafetensorsFile.get_slice = get, get_slice
  try:
    yield reads
  finally:
    SafetensorsFile.get, SafetensorsFile.get_slice = real_get, real_slice


def row_blocks(array: jax.Array, axis: int) -> list[tuple[int, int]]:
  """The distinct [start, stop) ranges along `axis` of the shards this process holds."""
  blocks = {shard.index[axis].indices(array.shape[axis])[:2] for shard in array.addressable_shards}
  return sorted(blocks)


REPO = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_processes(module: str, roles: tuple[str, ...], out: pathlib.Path,
                  timeout_s: float) -> dict[str, dict]:
  """Starts `python -m module ROLE PORT OUT` for every role at once (one free localhost
  port for a `jax.distributed` coordinator), waits for all (killing what still runs
  after `timeout_s`, once it has dumped its Python stacks into its log);
  role -> {"json": OUT/<role>.json or {}, "rc", "ended": when it exited (time.time(),
  None when killed), "log": its stdout and stderr}."""
  env = dict(os.environ, PYTHONFAULTHANDLER="1",
             PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  port, started, ended, processes = str(free_port()), time.time(), {}, {}
  for role in roles:
    with open(out / f"{role}.log", "w") as log:
      processes[role] = subprocess.Popen([sys.executable, "-m", module, role, port, str(out)],
                                         cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  while len(ended) < len(roles) and time.time() - started < timeout_s:
    for role, process in processes.items():
      if role not in ended and process.poll() is not None:
        ended[role] = time.time()
    time.sleep(0.2)
  hung = [process for process in processes.values() if process.poll() is None]
  for process in hung:
    process.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack
  time.sleep(5 if hung else 0)
  for process in hung:
    process.kill()
  found = {}
  for role, process in processes.items():
    path = out / f"{role}.json"
    found[role] = dict(json=json.loads(path.read_text()) if path.exists() else {},
                       rc=process.wait(), ended=ended.get(role),
                       log=(out / f"{role}.log").read_text())
  return found


# --- the request controls as transformers' `generate` takes them ------------------------------

class OpenAIPenalties(transformers.LogitsProcessor):
  """presence and frequency penalties over the generated tokens (vLLM's meaning), for
  transformers' `generate` as the oracle."""

  def __init__(self, prompt_length: int, presence: float, frequency: float):
    self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

  def __call__(self, input_ids, scores):
    generated = input_ids[:, self.prompt_length:]
    counts = torch.zeros_like(scores).scatter_add_(1, generated,
                                                    torch.ones_like(generated, dtype=scores.dtype))
    return scores - self.frequency * counts - self.presence * (counts > 0)


def hf_controls(prompt_length: int, options: dict) -> tuple[dict, "transformers.LogitsProcessorList"]:
  """mdjax's control options as transformers' `generate` takes them: logit_bias as
  one-token `sequence_bias`, presence and frequency penalties as `OpenAIPenalties`;
  returns (its keyword arguments, its extra logits processors)."""
  options = dict(options)
  presence = options.pop("presence_penalty", 0.0)
  frequency = options.pop("frequency_penalty", 0.0)
  if "logit_bias" in options:
    options["sequence_bias"] = {(t,): b for t, b in options.pop("logit_bias").items()}
  processors = transformers.LogitsProcessorList()
  if presence or frequency:
    processors.append(OpenAIPenalties(prompt_length, presence, frequency))
  return options, processors
