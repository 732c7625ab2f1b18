"""`mdjax.generate`: validate input, size the cache, run a strategy as one program.

Compiled programs are cached by (strategy, shapes, placements: see `mdjax.sharding`),
the least recently used dropped past `mdjax.compiled_cache_size()` (`mdjax.programs`).
Prompt lengths and `max_new_tokens` are padded to buckets (`bucket`) so a new prompt
length or a different `max_new_tokens` rarely recompiles; the real values travel as
traced arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import (controls, distributed, generation_config, platform, programs, sharding,
                   strategies, stream_text)
from mdjax.cache import KVCache, check_kv_dtype
from mdjax.controls import CONTROL_OPTIONS
from mdjax.errors import MdjaxError
from mdjax.models.attention import ATTENTION_BLOCK
from mdjax.models.model import Model
from mdjax.prompts import bucket, eos_ids
from mdjax.strategies import metadata
from mdjax.strategies.base import Limits, Prompt, Sampled


@dataclasses.dataclass
class GenerationOutput:
  sequences: list[list[int]]  # generated ids per output row, ending at EOS or the budget
  stats: dict[str, Any]
  texts: list[str] | None = None  # decoded sequences, without the EOS that ended each (the
  #                                  chat's end token), when the model has a tokenizer
  beams: list | None = None  # beam: per prompt, its hypotheses {"tokens", "score"}, best first
  # return_metadata=True (speculative family): per output row, per token target_prob,
  # drafted, rejected, and accepted_per_step (see `mdjax.strategies.metadata`)
  metadata: list[dict] | None = None
  # pipelines (`mdjax.pipelines`): per prompt, what their phases produced
  intermediate: list[dict] | None = None
  # logprobs=True: per output row, each token's log-probability under the distribution
  # it was chosen from (after every processor: `mdjax.controls`)
  logprobs: list[list[float]] | None = None
  # top_logprobs=k: per output row, per token, the k likeliest (id, log-probability)
  top_logprobs: list[list[list[tuple[int, float]]]] | None = None


def _start(strategy, params, prompt: Prompt, limits: Limits, *, num_slots: int, capacity: int,
           cache_dtype):
  """An empty cache of `num_slots` per row, then the strategy's prefill: its first state."""
  model_params = params["target"] if "target" in params else params  # beside heads, a draft
  cache = KVCache.for_params(strategy.model.config, model_params, prompt.tokens.shape[0],
                             num_slots, cache_dtype)
  return strategy.init(params, prompt, cache, limits, capacity)


STEP_LOOP = "strategy_steps"  # the named scope of the loop whose iterations are `step`s
STEPS_PER_CHECK = 8  # off the CPU: steps run between two checks that every row is done


def steps_per_check() -> int:
  """How many `step`s the token loop runs between two reads of "every row done".

  A while loop's condition is read by the host on a GPU: the device waits for the host
  each iteration (`mdjax.hlo_report`'s host syncs). Off the CPU the loop checks once
  every `STEPS_PER_CHECK` steps; the steps between run in a loop of known trip count,
  and once every row is done they change nothing (`_step_unless_done`). The price: at
  most `STEPS_PER_CHECK - 1` passes run after the last row is done. On the CPU a while
  condition costs nothing and every pass costs its full compute: it checks every step.
  """
  return 1 if platform.is_cpu() else STEPS_PER_CHECK


def _step_unless_done(strategy, params, state):
  """`strategy.step(params, state)`, or `state` unchanged where every row was already
  done (a select: the step still runs; none where the strategy's step changes nothing
  `result` reads of a done row, `done_rows_stay`: on a GPU, a kernel to read "all done"
  and the copy of the flags it reads). KV caches are taken from the step either way: no
  one reads a cache after the last row is done, and selecting one would copy it."""
  if strategy.done_rows_stay:
    return strategy.step(params, state)
  finished = strategy.done(state).all()
  stepped = strategy.step(params, state)
  is_cache = lambda x: isinstance(x, KVCache)
  return jax.tree.map(lambda old, new: new if is_cache(old) else jnp.where(finished, old, new),
                      state, stepped, is_leaf=is_cache)


def _run(strategy, params, prompt: Prompt, limits: Limits, **static):
  """The whole generation: prefill, then `strategy.step` until every row is done::

      CPU     while not done: step                        (one check per step)
      else    while not done: repeat k: step unless done  (k = `steps_per_check()`,
                                                           a loop of known trip count)

  The loop of steps is traced under the named scope `STEP_LOOP` (how
  `experiments.program_report` finds it in the compiled program)."""
  state = _start(strategy, params, prompt, limits, **static)
  unfinished = lambda s: ~strategy.done(s).all()
  every = steps_per_check()
  if every == 1:
    with jax.named_scope(STEP_LOOP):
      state = jax.lax.while_loop(unfinished, functools.partial(strategy.step, params), state)
    return strategy.result(state)

  def steps(s):
    with jax.named_scope(STEP_LOOP):
      return jax.lax.fori_loop(0, every, lambda _, s: _step_unless_done(strategy, params, s), s)

  return strategy.result(jax.lax.while_loop(unfinished, steps, state))


_programs = programs.Table()  # generate's whole-generation programs
_steppers = programs.Table()  # stream's jitted (first state, step) pairs


def compiled_programs() -> list[jax.stages.Compiled]:
  """The whole-generation programs `generate` keeps (at most
  `mdjax.compiled_cache_size()`), least recently used first: how many a workload
  needed, and each one's HLO (`.as_text()`) or XLA's cost estimate (`.cost_analysis()`)."""
  return _programs.values()


def _signature(tree) -> tuple:
  """Shapes, dtypes and placements: a program compiled for arrays on one mesh (or one
  device) is never run on arrays placed otherwise."""
  leaves, treedef = jax.tree.flatten(tree)
  return (treedef,) + tuple((x.shape, str(x.dtype), getattr(x, "sharding", None))
                            for x in leaves)


def _compile(strategy, params, prompt, limits, layout=None, **static):
  """The compiled program for these shapes and placements (cached), the seconds
  compiling took and why it compiled (None: it did not); traced under `layout`'s mesh
  when the model lies on one."""
  key = (strategy, layout, platform.current(), tuple(sorted(static.items())),
         _signature((params, prompt, limits)))
  program = _programs.get(key)
  if program is not None:
    return program, 0.0, None
  reason = _why_new(key, _programs.keys())
  start = time.perf_counter()
  with sharding.active(layout):  # a jit of its own: see `mdjax.programs`
    program = jax.jit(functools.partial(_run, strategy, **static)).lower(
        params, prompt, limits).compile()
  _programs.put(key, program)
  return program, time.perf_counter() - start, reason


def _why_new(key: tuple, earlier: list[tuple]) -> str:
  """What differs from the last program of the same strategy (`_compile`'s keys)."""
  strategy = key[0]
  same = [k for k in earlier if type(k[0]) is type(strategy)]
  if not same:
    return f"the first {type(strategy).__name__} program (of those kept)"
  last = same[-1]
  if last[0] != strategy:
    changed = [f.name for f in dataclasses.fields(strategy)
               if f.compare and getattr(strategy, f.name) != getattr(last[0], f.name)]
    return "options that shape the program: " + ", ".join(changed)
  if last[3] != key[3]:
    return "the cache's size or dtype (a longer prompt or max_new_tokens bucket)"
  if last[1:3] != key[1:3]:
    return "the mesh or platform"
  return ("the inputs' shapes: the prompt bucket, the batch, or the controls set and their "
          "shapes (stop strings, bad words, top_logprobs)")


def program(model: Model, prompts, strategy: str = "greedy", max_new_tokens: int | None = None,
            eos_token_id=None, seed: int = 0, **options) -> tuple[Any, tuple]:
  """The whole-generation program `generate` would run for this request, not compiled
  and not run: `(fn, args)`, `fn` jitted, so that `fn.trace(*args).lower().compile()`
  is `generate`'s program. The weights (the model's, a draft's, heads') may be
  `jax.ShapeDtypeStruct`s, e.g. to compile for a GPU target on this CPU::

      fn, args = mdjax.generate.program(model, [[1, 2, 3]], "greedy", 64)
      compiled = compile_targets.compile_for(fn, "h200", *args)

  Options are `generate`'s; `tree_budget="auto"` times passes, so it needs real weights.
  """
  plan = _prepare(model, prompts, strategy, max_new_tokens, eos_token_id, seed, options)
  fn = jax.jit(functools.partial(_run, plan.decoder, **plan.static))
  return fn, (plan.params, plan.prompt, plan.limits)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """A validated request: the strategy, its device inputs and how to read the output."""

  decoder: Any
  params: Any  # what the decoder runs on (the model's params, or target + draft)
  layout: Any  # the model's `mdjax.sharding.WeightPlacement` on a mesh, or None
  prompt: Prompt
  limits: Limits
  static: dict
  prompt_tokens: int
  output_rows: list[int]  # buffer rows that are real branches, prompt-major
  eos: tuple[int, ...]  # the ids that end a row
  stop_strings: tuple[str, ...] = ()  # the strings that end a row (`mdjax.stop_strings`)
  from_file: dict | None = None  # the settings the model's generation_config.json gave


def _plain(option) -> bool:
  """Numbers, strings or lists of them (what `check_same` compares; not a model or heads)."""
  return all(isinstance(x, (int, float, str)) for x in jax.tree.leaves(option))


def _prepare(model: Model, prompts, strategy: str, max_new_tokens: int | None, eos_token_id,
             seed: int, options: dict) -> _Plan:
  if not isinstance(strategy, str):
    raise MdjaxError(f"strategy must be a name, got {strategy!r}")
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
    raise MdjaxError(f"seed must be an integer, got {seed!r}")
  cls = strategies.get(strategy)
  request = generation_config.apply(model.generation_defaults, cls, options, max_new_tokens,
                                    eos_token_id)
  options, max_new_tokens = dict(request.options), request.max_new_tokens
  kv_dtype = options.pop("kv_cache_dtype", None)
  kv_dtype = str(model.params["embed"].dtype) if kv_dtype is None else check_kv_dtype(kv_dtype)
  strategies.check_options(strategy, options)
  options, layout = dict(options), cls.layout
  control_options = {name: options.pop(name) for name in CONTROL_OPTIONS if name in options}
  layout_value = options.pop(layout.option, None) if layout.option else None
  decoder, params = cls.build(model, options)
  params = sharding.on_layout(params, model.layout)  # a draft's or heads' weights too
  if layout_value is None and layout.option and layout.required:
    raise MdjaxError(f"strategy {strategy!r} needs the option {layout.option!r}")
  laid = layout.lay_out(model, prompts, layout_value, max_new_tokens)
  eos = eos_ids(model, eos_token_id)
  distributed.check_same("generate's arguments (prompts, strategy, options)",
                         *jax.tree.leaves(laid.prompt), strategy, max_new_tokens, eos or [], seed,
                         repr(sorted((k, v) for k, v in options.items() if _plain(v))),
                         repr(sorted(control_options.items())))
  capacity = bucket(max_new_tokens)
  num_branches = laid.prompt.branch_segment.shape[1]
  with sharding.active(model.layout):  # `auto` may time passes of the model as it will run
    decoder = decoder.for_request(params, laid.prompt, capacity)
  sampling = None
  if isinstance(decoder, Sampled):
    sampling = decoder.sampling_data(len(laid.branch_counts), num_branches,
                                     model.config.vocab_size)
  request_controls = controls.build(
      {k: v for k, v in control_options.items() if v is not None},
      vocab_size=model.config.vocab_size, tokenizer=model.tokenizer,
      num_prompts=len(laid.branch_counts), branches=num_branches,
      row_prompts=lambda: row_prompts(laid.prompt), max_new_tokens=max_new_tokens,
      eos_ids=eos or ())
  limits = Limits(max_new_tokens=jnp.asarray(max_new_tokens, jnp.int32),
                  eos_ids=jnp.asarray(eos or (-1,), jnp.int32), key=jax.random.key(seed),
                  sampling=sampling, controls=request_controls)
  static = dict(num_slots=cache_size(decoder, laid.prompt.tokens.shape[1], capacity, num_branches),
                capacity=capacity,
                cache_dtype=kv_dtype)  # K/V in the weights' dtype unless told
  output_rows = [i * num_branches + j for i, n in enumerate(laid.branch_counts) for j in range(n)]
  return _Plan(decoder=decoder, params=params, layout=model.layout, prompt=laid.prompt,
               limits=limits, static=static,
               prompt_tokens=laid.prompt_tokens, output_rows=output_rows, eos=tuple(eos or ()),
               stop_strings=_strings(control_options.get("stop_strings")),
               from_file=request.from_file)


def _strings(stop_strings) -> tuple[str, ...]:
  """The stop strings as a tuple (one string: one)."""
  if stop_strings is None:
    return ()
  return (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)


def row_prompts(prompt: Prompt) -> list[list[int]]:
  """(host) The prompt tokens each output row continues, in order: those its branch's
  segment sees (its own, then each ancestor's before the fork), as the branch decoded
  alone would have them (`mdjax.topology`); row b * N + j is branch j of prompt row b."""
  tokens, positions, segments, parent, fork, branch_segment = (np.asarray(x) for x in (
      prompt.tokens, prompt.positions, prompt.segments, prompt.parent, prompt.fork,
      prompt.branch_segment))
  rows = []
  for b, branch_row in enumerate(branch_segment):
    for segment in branch_row:
      seen, limit = np.zeros(tokens.shape[1], bool), np.inf
      while segment >= 0:
        seen |= (segments[b] == segment) & (positions[b] < limit)
        segment, limit = parent[b, segment], fork[b, segment]
      rows.append(tokens[b][seen][np.argsort(positions[b][seen], kind="stable")].tolist())
  return rows


def cache_size(decoder, prompt_width: int, capacity: int, branches: int) -> int:
  """Slots per row for a request: what `decoder` needs, rounded up to a power of two
  within one attention block, to whole blocks past it. Blocks must tile the cache, so
  1040 slots (16 x 65) would make every step walk 65 blocks of 16; 1152 slots are 9
  blocks of 128. A GPU's few-token attention kernel (`mdjax.models.decode_attention`)
  tiles powers of two only: a cache of 80 slots (a 64-token prompt, 16 new) would leave
  every step to the fused product, ~8 more kernels a layer."""
  slots = decoder.cache_slots(prompt_width, capacity, branches)
  if slots <= ATTENTION_BLOCK:
    return 1 << (slots - 1).bit_length()
  return -(-slots // ATTENTION_BLOCK) * ATTENTION_BLOCK


def _kv_cache_bytes(model: Model, plan: _Plan) -> int:
  """Bytes of the target's K and V caches this request allocated (every row's slots)."""
  c = model.config
  rows, slots = plan.prompt.tokens.shape[0], plan.static["num_slots"]
  itemsize = jnp.dtype(plan.static["cache_dtype"]).itemsize
  scales = 4 if itemsize == 1 else 0  # an int8 cache's float32 scale per slot and KV head
  return 2 * c.num_layers * rows * slots * c.num_kv_heads * (c.head_dim * itemsize + scales)


def _ranked_hypotheses(tokens: np.ndarray, counts: np.ndarray, scores: np.ndarray,
                      num_prompts: int) -> list[list[dict]]:
  """Per prompt, its scored hypotheses best first, from rank-major output rows (row
  r * num_prompts + i is prompt i's r-th best); a slot never filled (score -inf) is left out."""
  return [[{"tokens": tokens[r, :counts[r]].tolist(), "score": float(scores[r])}
           for r in range(i, len(scores), num_prompts) if np.isfinite(scores[r])]
          for i in range(num_prompts)]


def generate(model: Model, prompts, strategy: str = "greedy", max_new_tokens: int | None = None,
             eos_token_id=None, seed: int = 0, **options) -> GenerationOutput:
  """Generates from one prompt or a batch (texts or token-id lists, any lengths).

  `eos_token_id`: an int or list of ints (None: the model's own). Each row stops at
  its first EOS (kept) or after `max_new_tokens` (None: the model's generation config's,
  else 32). `options` are the strategy's (e.g. temperature, top_k, top_p, min_p for
  "sample"; num_beams, length_penalty, early_stopping for "beam", which also fills
  `beams`). `kv_cache_dtype`: "float32", "bfloat16" or "int8" (a scale per slot and KV
  head: `mdjax.cache`); None: the weights' dtype. The settings of a checkpoint's generation_config.json are the defaults of
  the arguments not given (`mdjax.generation_config`); `out.stats["generation_config"]`
  lists those that applied.
  """
  plan = _prepare(model, prompts, strategy, max_new_tokens, eos_token_id, seed, options)
  program, compile_s, compiled_because = _compile(plan.decoder, plan.params, plan.prompt,
                                                  plan.limits, plan.layout, **plan.static)
  start = time.perf_counter()
  buffer, stats = program(plan.params, plan.prompt, plan.limits)
  buffer, stats = distributed.to_host((buffer, stats))
  wall_s = time.perf_counter() - start
  tokens, counts, scores = buffer.tokens, buffer.count, buffer.scores
  sequences = [tokens[r, :counts[r]].tolist() for r in plan.output_rows]
  token_metadata = stats.pop("metadata", None)
  stats = {k: v.tolist() for k, v in stats.items()}
  stats.update(generated_tokens=sum(len(s) for s in sequences), prompt_tokens=plan.prompt_tokens,
               kv_cache_bytes=_kv_cache_bytes(model, plan), wall_s=wall_s, compile_s=compile_s,
               compiled=compiled_because is not None, compiled_because=compiled_because,
               **(plan.decoder.request_stats or {}))
  if buffer.stopped_by is not None:
    stops = plan.stop_strings
    stats["stopped_by"] = [None if buffer.stopped_by[r] < 0 else stops[buffer.stopped_by[r]]
                           for r in plan.output_rows]
  stats["tokens_per_pass"] = stats["generated_tokens"] / max(1, stats["target_passes"] + 1)
  if plan.from_file:
    stats["generation_config"] = dict(plan.from_file)
  texts = None
  if model.tokenizer is not None:
    texts = [model.tokenizer.decode(s[:-1] if s and s[-1] in plan.eos else s) for s in sequences]
  beams = None if scores is None else _ranked_hypotheses(tokens, counts, scores,
                                                          len(plan.output_rows))
  if token_metadata is not None:
    token_metadata = metadata.per_row(token_metadata, counts, plan.output_rows)
  logprobs = top_logprobs = None
  if buffer.logprobs is not None:
    logprobs = [buffer.logprobs[r, :counts[r]].tolist() for r in plan.output_rows]
  if buffer.top_ids is not None:
    top_logprobs = [[list(zip(ids.tolist(), values.tolist())) for ids, values in
                     zip(buffer.top_ids[r, :counts[r]], buffer.top_logprobs[r, :counts[r]])]
                    for r in plan.output_rows]
  return GenerationOutput(sequences=sequences, stats=stats, texts=texts, beams=beams,
                          metadata=token_metadata, logprobs=logprobs, top_logprobs=top_logprobs)


def _stepper(decoder, static: dict):
  """Jitted first state and step of `decoder`, for the Python-driven `stream`."""
  key = (decoder, tuple(sorted(static.items())))
  pair = _steppers.get(key)
  if pair is None:
    pair = jax.jit(functools.partial(_start, decoder, **static)), jax.jit(decoder.step)
    _steppers.put(key, pair)
  return pair


def stream(model: Model, prompts, strategy: str = "greedy", max_new_tokens: int | None = None,
           eos_token_id=None, seed: int = 0, text: bool = False,
           **options) -> Iterator[list[list[int]]] | Iterator[list[str]]:
  """Yields, after every model pass, the tokens each row gained (for demos); with
  `text=True`, each row's new text instead (needs a tokenizer): a character split
  over tokens shows once complete, a row's pieces joined are its `generate` text
  (without the EOS that ended it, with a stop string's token), and each yielded list
  says which rows are done (`.done`): `mdjax.stream_text`.

  The same strategy and step as `generate`, driven from Python: one host sync per
  pass, so it is slower than `generate`, which runs the loop on the device. Not for
  "beam": its best hypothesis is known only at the end.
  """
  if not strategies.get(strategy).streams:
    raise MdjaxError(f"stream does not support strategy {strategy!r}; use generate")
  if not isinstance(text, bool):
    raise MdjaxError(f"text must be True or False, got {text!r}")
  if text and model.tokenizer is None:
    raise MdjaxError(f"text=True needs a tokenizer, and the model {model.name or model.path!r} "
                     "has none; stream its tokens (text=False)")
  plan = _prepare(model, prompts, strategy, max_new_tokens, eos_token_id, seed, options)
  init, step = _stepper(plan.decoder, plan.static)
  with sharding.active(plan.layout):
    state = init(plan.params, plan.prompt, plan.limits)
  rows = plan.output_rows
  texts = stream_text.RowTexts(model.tokenizer, plan.eos, len(rows)) if text else None
  shown = np.zeros(len(rows), np.int64)
  while True:
    buffer, _ = plan.decoder.result(state)
    tokens, counts, done = distributed.to_host((buffer.tokens, buffer.count, buffer.done))
    counts = counts[rows]
    if texts is None:
      yield [tokens[r, s:n].tolist() for r, s, n in zip(rows, shown, counts)]
    else:
      yield texts.update([tokens[r, :n].tolist() for r, n in zip(rows, counts)], done[rows])
    shown = counts
    if done.all():
      return
    with sharding.active(plan.layout):
      state = step(plan.params, state)
