"""One process of a two-process `jax.distributed` run, and the one-process reference:
what `tests/test_distributed.py` starts and calls (its name keeps pytest from collecting
it).

    python -m tests.multidevice.process_checks 0 PORT OUT     ┐ a pair: 4 CPU devices
    python -m tests.multidevice.process_checks 1 PORT OUT     ┘ each, one 2x4 mesh
    one_process()                                               the test's process, no mesh

Each of the pair writes OUT/<role>.json as it goes: every registered strategy's
sequences on the global mesh, `stream`, `forward_logits` and a pipeline; then it checks
that prompts differing between processes are a clear error, loads OUT/checkpoint (which
the parent wrote) onto a 1x8 mesh recording what each process reads (`local_reads`),
and process 1 kills itself in the middle of a generate while process 0 generates until
the runtime stops it (the parent times it). `one_process` returns the same calls' results
on one device (greedy and the lossy strategies).
"""

import dataclasses
import json
import math
import os
import pathlib
import signal
import sys
import threading
import time

import jax

HEARTBEAT_S = 10  # a dead peer is noticed within ~2 heartbeats


def write(out: pathlib.Path, found: dict):
  """OUT/<role>.json replaced whole (the parent may read it while a phase runs)."""
  part = out.with_suffix(".part")
  part.write_text(json.dumps(found))
  part.replace(out)


def main(role: str, port: str, out_dir: str):
  jax.config.update("jax_num_cpu_devices", 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from mdjax import distributed
  distributed.initialize(f"localhost:{port}", 2, int(role), heartbeat_timeout_s=HEARTBEAT_S,
                         initialization_timeout_s=120)

  import numpy as np

  import mdjax
  from mdjax.strategies import STRATEGIES
  from tests import collector, helpers
  collector.collect_rarely()

  out = pathlib.Path(out_dir) / f"{role}.json"
  base = mdjax.load("random-llama-tiny")
  model = mdjax.load("random-llama-tiny", mesh=jax.make_mesh((2, 4), ("data", "tensor")))
  found = {"devices": jax.device_count(), **calls(model, base, sorted(STRATEGIES))}
  write(out, found)

  mine = [[3, 4, 5]] if role == "0" else [[3, 4, 6]]
  try:
    mdjax.generate(model, mine, max_new_tokens=4)
  except mdjax.MdjaxError as e:
    found["prompts_differ"] = str(e)
  local = jax.sharding.Mesh(np.array(jax.local_devices()).reshape(1, 4), ("data", "tensor"))
  try:
    mdjax.shard(base, local)
  except mdjax.MdjaxError as e:
    found["local_mesh"] = str(e)
  found["local_reads"] = local_reads(pathlib.Path(out_dir) / "checkpoint")
  write(out, found)

  if role == "1":  # dies in the middle of a generate: no goodbye to the coordinator
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
  found["generating_since"] = time.time()
  write(out, found)
  while True:  # greedy's program, compiled above: the death comes while it runs
    mdjax.generate(model, helpers.STRATEGY_PROMPTS, max_new_tokens=12, eos_token_id=[])


def one_layer(name: str) -> bool:
  """Whether strategy `name` runs on `first_layer` of the model: a lossless strategy (held
  to greedy's tokens of the same model) but self_speculative, which drafts with its
  target's first layer. A layer's collectives are the same in every layer, and a layer
  fewer is about a fifth less to compile; greedy and the lossy strategies keep both
  layers, programs tests/test_layer_loop.py compiles too on one device."""
  from tests import helpers
  return name in helpers.LOSSLESS and name != "self_speculative"


def first_layer(model):
  """`model` cut after its first layer (on its mesh, if it lies on one)."""
  from mdjax.models.layer_loop import take_layers
  return dataclasses.replace(model, config=dataclasses.replace(model.config, num_layers=1),
                             params=take_layers(model.params, 1), name=f"{model.name}[:1]")


def calls(model, base, names) -> dict:
  """`names`' sequences (each strategy with its `tests.helpers.every_strategy` request, for
  `base`; on `model` or, by `one_layer`, its first layer), `stream` and `forward_logits` of
  `model` (`base`, or `base` on a mesh)."""
  import mdjax
  from tests import helpers
  draft = helpers.random_model("llama", 5, vocab_size=base.config.vocab_size, layers=1, std=0.05)
  requests = helpers.every_strategy(draft, helpers.strategy_heads(base))
  short = first_layer(model)
  return {
      "strategies": {name: helpers.run_strategy(short if one_layer(name) else model, name,
                                                requests[name]).sequences for name in names},
      "stream": [sum(rows, []) for rows in zip(*mdjax.stream(
          model, helpers.STRATEGY_PROMPTS, max_new_tokens=12, eos_token_id=[]))],
      "forward_logits": mdjax.forward_logits(model, helpers.STRATEGY_PROMPTS[0]).tolist()}


def one_process() -> dict:
  """The reference, in the calling process (one device, as the test processes have:
  JAX's compilation cache keys a program by the process's device count, so these are the
  programs other tests compile, tests/test_layer_loop.py's unrolled runs): `calls` of
  greedy and the lossy strategies without a mesh (a lossless strategy gives greedy's
  tokens), and greedy's of the first layer alone."""
  import mdjax
  from mdjax.strategies import STRATEGIES
  from tests import helpers
  model = mdjax.load("random-llama-tiny")
  found = calls(model, model, sorted(set(STRATEGIES) - helpers.LOSSLESS))
  found["one_layer_greedy"] = helpers.run_strategy(first_layer(model), "greedy",
                                                   ([], {})).sequences
  return found


def local_reads(checkpoint: pathlib.Path) -> dict:
  """Loads `checkpoint` onto a 1x8 mesh, where each process holds half the tensor
  axis: the rows of layer 0's q_proj this process read and the ones its devices hold
  (wq's columns), blocks read twice, its share of the model's elements read, and
  whether the params equal a one-device load's bytes."""
  import mdjax
  from mdjax import distributed, sharding
  from tests import helpers

  with helpers.recorded_reads() as reads:
    model = mdjax.load(str(checkpoint), mesh=jax.make_mesh((1, 8), ("data", "tensor")))
  one_device = jax.tree.leaves(mdjax.load(str(checkpoint)).params)
  gathered = jax.tree.leaves(distributed.to_host(sharding.one_device_layout(model.params,
                                                                            model.config)))
  q_proj = "model.layers.0.self_attn.q_proj.weight"
  return {"q_rows_read": sorted(block[0] for name, block in reads if name == q_proj),
          "q_rows_held": helpers.row_blocks(model.params["layers"][0]["wq"], axis=1),
          "read_twice": len(reads) - len(set(reads)),
          "share_read": sum(math.prod(b - a for a, b in block) for _, block in reads)
          / sum(x.size for x in one_device),
          "same_bytes": len(gathered) == len(one_device) and all(
              a.dtype == b.dtype and (a == b).all() for a, b in zip(gathered, one_device))}


if __name__ == "__main__":
  main(*sys.argv[1:])
