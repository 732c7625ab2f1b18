"""The trainers under `jax.distributed`: one process of a two-process run, or the
one-process reference, as `tests/test_distributed_train.py` starts them (its name keeps
pytest from collecting it).

    python -m tests.multidevice.train_process_checks 0 PORT OUT     ┐ a pair: 4 CPU devices
    python -m tests.multidevice.train_process_checks 1 PORT OUT     ┘ each, one 2x4 mesh
    python -m tests.multidevice.train_process_checks reference 0 OUT  8 devices, a 2x4 mesh

Each group (the pair, the reference) trains the tiny LM and the tiny heads into
OUT/<group>/ as the entry points do (`experiments.train_lm`, `train_heads`; the pair
joins the runtime by `config.distributed`), then waits for the other group,
and resumes a copy of each of its runs interrupted after the next-to-last checkpoint
(OUT/<group>/<lm|heads>_resumed): a checkpoint written by 2 processes resumed by 1,
and the other way round. Each process writes OUT/<role>.json: the entry points'
summaries, and `distributed.agreed` of a flag only process 0 sets.
"""

import pathlib
import shutil
import sys
import time

import jax

GROUPS = {"0": "pair", "1": "pair", "reference": "one"}
STEPS = 4
KEPT = 2  # checkpoints at 2 and 4: a resume starts after step 2
MESH = "2,4"
WAIT_S = 600


def lm_config(run_dir: pathlib.Path, distributed: str):
  from configs import lm_tiny_test
  from mdjax.train import data
  config = lm_tiny_test.get_config()
  config.update(run_dir=str(run_dir), data_dir=str(data.stdlib_dir() / "json"), mesh=MESH,
                distributed=distributed, steps=STEPS, log_every=1, eval_every=100,
                checkpoint_every=KEPT, keep_checkpoints=2)
  config.model.update(num_heads=4, num_kv_heads=2, head_dim=8)  # heads shard over tensor 4
  return config


def heads_config(run_dir: pathlib.Path, distributed: str, prompts: pathlib.Path):
  from configs import heads_tiny_test
  config = heads_tiny_test.get_config()
  config.data.prompts = str(prompts)
  config.update(run_dir=str(run_dir), mesh=MESH, distributed=distributed,
                steps=STEPS, log_every=1, eval_every=100, checkpoint_every=KEPT,
                keep_checkpoints=2)
  return config


def interrupted_copy(run_dir: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
  """A copy of a finished run as killed right after its next-to-last checkpoint."""
  shutil.copytree(run_dir, to)
  shutil.rmtree(to / "checkpoints" / str(STEPS))
  return to


def wait_for(path: pathlib.Path) -> None:
  deadline = time.time() + WAIT_S
  while not path.exists():
    if time.time() > deadline:
      raise TimeoutError(f"{path} did not appear in {WAIT_S} s")
    time.sleep(0.5)


def main(role: str, port: str, out_dir: str):
  jax.config.update("jax_num_cpu_devices", 8 if role == "reference" else 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from experiments import cli, train_heads  # train_lm's flags would clash with its
  from mdjax import distributed
  from mdjax.train import export, lm

  def train_lm(config) -> dict:  # `experiments.train_lm.run`
    return export.export(lm.train(config), config, pathlib.Path(config.run_dir) / "export")
  from tests.collector import collect_rarely
  from tests.multidevice.process_checks import write
  collect_rarely()

  out, group = pathlib.Path(out_dir), GROUPS[role]
  flag = "" if role == "reference" else f"localhost:{port},2,{role}"
  mine, other = out / group, out / GROUPS["0" if role == "reference" else "reference"]
  cli.start_processes(lm_config(mine / "lm", flag))
  found = {"devices": jax.device_count(), "processes": jax.process_count(),
           "agreed": distributed.agreed(distributed.is_main_process())}  # process 0's: True
  found["lm"] = train_lm(lm_config(mine / "lm", flag))
  found["heads"] = train_heads.run(heads_config(mine / "heads", flag, out / "prompts.jsonl"))
  write(out / f"{role}.json", found)
  if distributed.is_main_process():
    (mine / "trained").touch()
  wait_for(other / "trained")

  if distributed.is_main_process():  # resume what the other group wrote
    for name in ("lm", "heads"):
      interrupted_copy(other / name, mine / f"{name}_resumed")
  distributed.barrier("copied")
  found["lm_resumed"] = train_lm(lm_config(mine / "lm_resumed", flag))
  found["heads_resumed"] = train_heads.run(
      heads_config(mine / "heads_resumed", flag, out / "prompts.jsonl"))
  write(out / f"{role}.json", found)


if __name__ == "__main__":
  main(*sys.argv[1:])
