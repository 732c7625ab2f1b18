"""One process of a two-process `jax.distributed` run, or the one-process reference:
what `tests/test_distributed.py` starts (its name keeps pytest from collecting it).

    python -m tests.multidevice.process_checks 0 PORT OUT     ┐ a pair: 4 CPU devices
    python -m tests.multidevice.process_checks 1 PORT OUT     ┘ each, one 2x4 mesh
    python -m tests.multidevice.process_checks reference 0 OUT  one process, no mesh

Each writes OUT/<role>.json as it goes: every registered strategy's sequences (the
pair on the global mesh, the reference on one device), `stream`, `forward_logits`
and a pipeline; then the pair checks that prompts differing between processes are a
clear error, loads OUT/checkpoint (which the parent wrote) onto a 1x8 mesh recording
what each process reads (`local_reads`), and process 1 kills itself in the middle
of a generate while process 0 generates until the runtime stops it (the parent
times it).
"""

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
  if role != "reference":  # the reference keeps one device, as the test processes do: JAX's
    # compilation cache keys a program by the process's device count, so its programs are
    # the ones other tests compile (tests/test_layer_loop.py's unrolled runs), compiled once
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from mdjax import distributed
  if role != "reference":
    distributed.initialize(f"localhost:{port}", 2, int(role), heartbeat_timeout_s=HEARTBEAT_S,
                           initialization_timeout_s=120)

  import numpy as np

  import mdjax
  from mdjax.strategies import STRATEGIES
  from tests import helpers

  out, found = pathlib.Path(out_dir) / f"{role}.json", {"devices": jax.device_count()}
  base = mdjax.load("random-llama-tiny")
  draft = helpers.random_model("llama", 5, vocab_size=base.config.vocab_size, layers=1, std=0.05)
  requests = helpers.every_strategy(draft, helpers.strategy_heads(base))
  model = base if role == "reference" else mdjax.load(
      "random-llama-tiny", mesh=jax.make_mesh((2, 4), ("data", "tensor")))

  names = sorted(set(STRATEGIES) - helpers.LOSSLESS) if role == "reference" else sorted(STRATEGIES)
  found["strategies"] = {name: helpers.run_strategy(model, name, requests[name]).sequences
                         for name in names}  # the reference: greedy and the lossy ones
  found["stream"] = [sum(rows, []) for rows in zip(*mdjax.stream(
      model, helpers.STRATEGY_PROMPTS, max_new_tokens=12, eos_token_id=[]))]
  found["forward_logits"] = mdjax.forward_logits(model, helpers.STRATEGY_PROMPTS[0]).tolist()
  write(out, found)
  if role == "reference":
    return

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
