"""One process of a two-process `jax.distributed` run, or the one-process reference:
what `tests/test_distributed.py` starts (its name keeps pytest from collecting it).

    python -m tests.multidevice.process_checks 0 PORT OUT     ┐ a pair: 4 CPU devices
    python -m tests.multidevice.process_checks 1 PORT OUT     ┘ each, one 2x4 mesh
    python -m tests.multidevice.process_checks reference 0 OUT  one process, no mesh

Each writes OUT/<role>.json as it goes: every registered strategy's sequences (the
pair on the global mesh, the reference on one device), `stream`, `forward_logits`
and a pipeline; then the pair checks that prompts differing between processes are a
clear error, and process 1 kills itself in the middle of a generate while process 0
generates until the runtime stops it (the parent times it).
"""

import json
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
  write(out, found)

  if role == "1":  # dies in the middle of a generate: no goodbye to the coordinator
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
  found["generating_since"] = time.time()
  write(out, found)
  while True:
    mdjax.generate(model, helpers.STRATEGY_PROMPTS, max_new_tokens=24, eos_token_id=[])


if __name__ == "__main__":
  main(*sys.argv[1:])
