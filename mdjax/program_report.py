"""What the programs mdjax builds do on a device it compiles for without having it
(`mdjax.compile_targets`: a GPU or a TPU), read by `mdjax.hlo_report` (kernels, host
syncs, copies) and `mdjax.hlo_products` (float32 products), with the compiler's memory
analysis: one `decode_step` pass, and every registered strategy's whole-generation
program (`mdjax.generate.program`) on weights that are shapes only.
`experiments/program_report.py` is the CLI that tabulates them;
`tests/test_gpu_programs.py` and `tests/test_tpu_programs.py` hold CI to their floors.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

from mdjax import compile_targets, hlo_products, hlo_report, hlo_text, platform, strategies
from mdjax.cache import KVCache
from mdjax.generate import STEP_LOOP, program
from mdjax.heads import Heads, HeadsConfig, init_heads, load_heads
from mdjax.models.attention import default_attention
from mdjax.models.config import ModelConfig
from mdjax.models.layer_loop import default_layer_loop, layer_loop_of, with_layer_loop
from mdjax.models.model import Model
from mdjax.models.quantized import quantize_params
from mdjax.models.random_init import init_params
from mdjax.step import decode_step
from mdjax.strategies import prompt_layouts
from mdjax.topology import Topology


def compile_decode_step(target: str, config, *, batch: int, tokens: int, slots: int,
                        segments: int, layer_loop: str, dtype=jnp.bfloat16,
                        quantize: str | None = None, kv_dtype=None):
  """One `decode_step` pass compiled for `target` (weights of `dtype` laid out for
  `layer_loop`, quantized by `quantize` when given; a cache of `kv_dtype` (None: `dtype`)
  with `slots` slots per row, the target's attention): `(compiled, params)`, the params
  shapes only."""
  def weights():
    params = init_params(config, 0, dtype)
    params = params if quantize is None else quantize_params(params, quantize)
    return with_layer_loop(params, layer_loop)

  with platform.building_for(compile_targets.get(target).platform):
    params = jax.eval_shape(weights)
    cache = jax.eval_shape(lambda: KVCache.create(config, batch, slots, kv_dtype or dtype))
    attention = default_attention()
  ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
  topology = Topology(parent=jax.ShapeDtypeStruct((batch, segments), jnp.int32),
                      fork=jax.ShapeDtypeStruct((batch, segments), jnp.int32))
  compiled = compile_targets.compile_for(decode_step, target, params, cache, ids, ids, ids,
                                         topology, config=config, attention=attention)
  return compiled, params


def decode_step_counts(target: str, config, **shape) -> hlo_report.Counts:
  """The counts of one `decode_step` pass compiled for `target` (`shape`: as
  `compile_decode_step`'s)."""
  compiled, _ = compile_decode_step(target, config, **shape)
  return hlo_report.read(compiled.as_text(), platform=compile_targets.get(target).platform)


def decode_step_report(target: str, config, **shape) -> dict:
  """One `decode_step` pass compiled for `target`: its counts, the weight bytes among
  its loop copies, its memory and its float32 products (`shape`: as
  `compile_decode_step`'s)."""
  compiled, params = compile_decode_step(target, config, **shape)
  text, on = compiled.as_text(), compile_targets.get(target).platform
  counts = hlo_report.read(text, platform=on)
  products = hlo_products.float32_products(text, platform=on)
  return dict(kernels_per_layer=counts.kernels / config.num_layers, **counts.to_json(),
              weight_bytes=held_bytes(params),
              weight_bytes_read=read_bytes(params, config, shape["batch"] * shape["tokens"]),
              weight_copy_bytes=weight_copy_bytes(counts, params),
              memory=memory(compiled), f32_products=hlo_products.summary(products),
              f32_products_listed=hlo_products.grouped(products))


def held_bytes(tree) -> int:
  """Bytes of the arrays (or shapes) of `tree` as a device holds them: int4 two a byte."""
  return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize // (2 if leaf.dtype == jnp.int4 else 1)
             for leaf in jax.tree.leaves(tree))


def read_bytes(params, config: ModelConfig, rows: int) -> int:
  """The weight bytes a pass of `rows` tokens reads: `held_bytes`, less the rows of an
  untied embedding it does not gather (a tied one is also the head's matrix, read whole)."""
  held = held_bytes(params)
  if config.tie_word_embeddings:
    return held
  embedding = held_bytes(params["embed"])
  return held - embedding + embedding * min(rows, config.vocab_size) // config.vocab_size


def memory(compiled) -> dict[str, int]:
  """What `compiled` needs on its device (`compiled.memory_analysis()`), in bytes:
  its arguments, outputs (less those aliased to donated arguments), temporaries and
  generated code, and `total`: all of them at once."""
  stats = compiled.memory_analysis()
  found = dict(argument=stats.argument_size_in_bytes, output=stats.output_size_in_bytes,
               alias=stats.alias_size_in_bytes, temp=stats.temp_size_in_bytes,
               generated_code=stats.generated_code_size_in_bytes)
  found["total"] = (found["argument"] + found["output"] - found["alias"] + found["temp"] +
                    found["generated_code"])
  return found


def weight_copy_bytes(counts: hlo_report.Counts, params) -> int:
  """Bytes of `counts`' loop copies (into device memory or on chip) shaped like one
  layer's weight (dimensions of 1 aside, in any order: a slice of a stacked weight,
  transposed or not)."""
  def key(dims):
    return tuple(sorted(d for d in dims if d != 1))

  stacked = layer_loop_of(params) == "scan"  # each weight [layers, ...]
  weights = {key(leaf.shape[1:] if stacked else leaf.shape)
             for leaf in jax.tree.leaves(params["layers"])}
  total = 0
  for shape, n in counts.loop_copy_shapes.items():
    dtype, dims = re.fullmatch(r"(\w+)\[([\d,]*)\]", shape).groups()
    dims = tuple(int(d) for d in filter(None, dims.split(",")))
    if key(dims) in weights:
      total += n * hlo_text.nbytes(dtype, dims)
  return total


def abstract_model(config, name: str = "") -> Model:
  """A model of `config` whose weights are shapes only (bfloat16), laid out for the
  platform being built for."""
  params = jax.eval_shape(lambda: with_layer_loop(init_params(config, 0, jnp.bfloat16),
                                                  default_layer_loop()))
  return Model(config=config, params=params, name=name)


def abstract_heads(model: Model, shipped: str | None, **fields) -> Heads:
  """Heads for `model`, shapes only: configured like the shipped heads `shipped` (or
  from `fields`) at the model's width and vocabulary."""
  c = model.config
  config = load_heads(shipped).config if shipped else None
  shape = dict(base_model=model.name, base_family=c.family, hidden_size=c.hidden_size,
               vocab_size=c.vocab_size, **fields)
  config = dataclasses.replace(config, **shape) if config else HeadsConfig(**shape)
  return Heads(config=config, params=jax.eval_shape(lambda: init_heads(config, c).params))


DRAFT_LAYERS = 30  # SmolLM2-135M's


def draft_config(target: ModelConfig, num_layers: int = DRAFT_LAYERS) -> ModelConfig:
  """The draft the report pairs with `target`: SmolLM2-135M's shape (576 wide, 9 query
  heads over 3 KV heads of 64, an MLP of 1,536, a tied head; a draft a user pairs with a
  1B llama, whose head dim the GPU's attention kernel takes), with `num_layers` layers
  and the target's vocabulary."""
  return ModelConfig(family="llama", vocab_size=target.vocab_size, hidden_size=576,
                     intermediate_size=1536, num_layers=num_layers, num_heads=9, num_kv_heads=3,
                     head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=8192, tie_word_embeddings=True)


def strategy_requests(model: Model, prompt_tokens: int,
                      draft_layers: int = DRAFT_LAYERS) -> dict[str, tuple[list, dict]]:
  """Per registered strategy: its prompts and options, one request of `prompt_tokens`
  (a draft of `draft_config(model.config, draft_layers)`)."""
  prompt = [list(range(3, 3 + prompt_tokens))]
  chunks = [[prompt[0][:prompt_tokens // 2], prompt[0][prompt_tokens // 2:]]]
  draft = abstract_model(draft_config(model.config, draft_layers), "draft")
  medusa = abstract_heads(model, "smollm2-135m-instruct-medusa")
  eagle = abstract_heads(model, "smollm2-135m-instruct-eagle")
  mtp = abstract_heads(model, None, family="mtp", num_heads=3)
  tree = dict(tree_depth=4, tree_top_k=4, tree_budget=16)
  requests = {
      "sample": dict(temperature=0.8, top_k=40),
      "multi_question": dict(questions=[[20, 21], [22], [23, 24, 25], [26]]),
      "parallel_sample": dict(num_samples=4, temperature=0.9),
      "margin_notes": dict(instruction=[7, 8, 9]),
      "beam": dict(num_beams=4),
      "speculative_tree": dict(draft=draft, **tree),
      "eagle": dict(heads=eagle, **tree),
      "entropy_branching": dict(num_branches=2, branch_tokens=4),
      "lookahead": dict(window=4, ngram=4, guess_set=4),
      "jacobi": dict(window=4),
      "medusa": dict(heads=medusa, tree_budget=16),
      "blockwise": dict(heads=mtp),
      "self_speculative": dict(draft_layers=max(1, model.config.num_layers // 4),
                                num_draft_tokens=4),
      "speculative": dict(draft=draft, num_draft_tokens=4),
      "mixed": dict(heads=medusa, draft=draft, tree_budget=16),
  }
  return {name: (chunks if isinstance(cls.layout, prompt_layouts.Chains) else prompt,
                 requests.get(name, {}))
          for name, cls in strategies.registry.STRATEGIES.items()}


def generation_counts(target: str, model: Model, strategy: str, prompts: list, options: dict,
                      max_new_tokens: int) -> dict:
  """Strategy `strategy`'s whole-generation program compiled for `target`: per step of
  its token loop (the loop under `mdjax.generate.STEP_LOOP`), kernels, host syncs and,
  on a GPU, layer passes (the target's layers, the draft's or a head's, one per pass
  that runs them) with the kernels per layer pass, the unit of the GPU program's goal,
  and both by unrolled layer index (every model's layer of that index, in any pass);
  the host syncs of the program outside that loop, and how many steps run between
  them; the program's loops, memory and float32 products."""
  on = compile_targets.get(target).platform
  with platform.building_for(on):  # generate's choices
    fn, args = program(model, prompts, strategy, max_new_tokens, eos_token_id=[], **options)
  compiled = compile_targets.compile_for(fn, target, *args)
  text = compiled.as_text()
  products = hlo_products.float32_products(text, platform=on)
  whole = hlo_report.read(text, platform=on)
  loop = hlo_report.find_loop(text, STEP_LOOP, platform=on)
  per_step = loop.iteration.host_syncs + (loop.trip_count is None and
                                          hlo_report.control_flow_waits(on))
  layer_passes = loop.iteration.attention_kernels  # mdjax's few-token attention kernels
  return dict(strategy=strategy, kernels_per_step=loop.iteration.kernels,
              layer_passes_per_step=layer_passes or None,
              kernels_per_layer_pass=(loop.iteration.kernels / layer_passes if layer_passes
                                      else None),
              kernels_by_layer=dict(sorted(loop.iteration.kernels_by_layer.items())),
              layer_passes_by_layer=dict(sorted(loop.iteration.attention_by_layer.items())),
              host_syncs_per_step=per_step, steps_per_check=loop.trip_count or 1,
              host_syncs_around=whole.host_syncs - per_step * (loop.trip_count or 1),
              program_kernels=whole.kernels, loops=whole.to_json()["loops"],
              memory=memory(compiled), f32_products=hlo_products.summary(products),
              f32_products_listed=hlo_products.grouped(products))
