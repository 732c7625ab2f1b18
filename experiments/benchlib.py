"""What the benchmark scripts share: the bandwidth probe, the model in both libraries,
token agreement and the machine description."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import matplotlib
import numpy as np
import torch
import transformers

import mdjax
from mdjax.models import hf

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402 -- after choosing the headless backend


def memory_bandwidth(mib: int, trials: int = 5) -> dict:
  """Best-of-`trials` bandwidth (GB/s) of summing (read) and copying (read + write)
  a float32 array of `mib` MiB, split over one thread per CPU (numpy releases the GIL)."""
  source = np.ones(mib * 2**20 // 4, np.float32)
  target = np.empty_like(source)
  workers = os.cpu_count() or 1
  sources, targets = np.array_split(source, workers), np.array_split(target, workers)
  with ThreadPoolExecutor(workers) as pool:

    def best(work) -> float:
      times = []
      for _ in range(trials):
        start = time.perf_counter()
        list(pool.map(work, range(workers)))
        times.append(time.perf_counter() - start)
      return min(times)

    read_s = best(lambda i: sources[i].sum())
    copy_s = best(lambda i: np.copyto(targets[i], sources[i]))
  return dict(read_gbps=source.nbytes / read_s / 1e9, copy_gbps=2 * source.nbytes / copy_s / 1e9,
              array_mib=mib, threads=workers)


def load_pair(name: str, seed: int, scratch: pathlib.Path):
  """The model in mdjax and in transformers with identical float32 weights: anything
  `mdjax.load` takes. What it read from a Hugging Face directory (a shipped model, a
  hub id, a GGUF's converted copy such as `smollm2-135m-instruct`'s) transformers reads
  from the same directory (`model.path`); a random model is exported with `save_hf`
  into `scratch` first."""
  model = mdjax.load(name, seed=seed)
  directory = model.path
  if directory is None:
    directory = scratch / name
    hf.save_hf(model, directory)
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(directory),
                                                                dtype=torch.float32).eval()
  # No EOS: every row runs the full budget in both libraries and the logits are untouched.
  reference.generation_config.eos_token_id = None
  return model, reference


def agreement(ours: list[list[int]], theirs: np.ndarray) -> dict:
  """Matching tokens, position by position, and the shortest identical prefix."""
  ours = np.asarray(ours)
  same = ours == theirs
  prefix = [int(row.argmin()) if not row.all() else len(row) for row in same]
  return dict(matching_tokens=int(same.sum()), total_tokens=int(same.size),
              identical_prefix=min(prefix))


def median_after_first_token(whole: list[float], first: list[float]) -> float:
  """The median over repetitions of a generation's seconds after its first token: each
  whole run minus the run cut at one token from the same repetition (paired, so a slow
  repetition slows both)."""
  return statistics.median(w - f for w, f in zip(whole, first, strict=True))


def machine_info(bandwidth: dict) -> dict:
  """Versions, threads and the bandwidth probe; `load_average` (1 min) tells how busy
  the machine was, i.e. how far to trust absolute times."""
  return dict(cpu_count=os.cpu_count(), load_average=os.getloadavg()[0],
              processor=platform.processor() or platform.machine(),
              python=platform.python_version(), jax=jax.__version__, numpy=np.__version__,
              torch=torch.__version__, transformers=transformers.__version__,
              torch_threads=torch.get_num_threads(), jax_devices=[str(d) for d in jax.devices()],
              bandwidth=bandwidth)


def machine_line(machine: dict) -> str:
  """The part of a figure title that says how far to trust its times."""
  return f"{machine['cpu_count']} CPUs, load {machine['load_average']:.1f}"


def save_figure(fig, path: pathlib.Path, title: str) -> None:
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_json(path: pathlib.Path, results: dict) -> None:
  """`results` as JSON at `path`, written beside it and renamed into place, so a reader
  (or a run stopped mid-write) never sees half a file."""
  partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
  partial.write_text(json.dumps(results, indent=2) + "\n")
  os.replace(partial, path)


def write_results(results: dict, out_dir: str, stem: str, plot, table) -> None:
  """`out_dir/stem.json` and `out_dir/stem.png` (drawn by `plot(results, path)`), each
  written atomically, then the table printed."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  write_json(out_dir / f"{stem}.json", results)
  partial = out_dir / f".{stem}.{os.getpid()}.partial.png"  # matplotlib picks PNG by the suffix
  plot(results, partial)
  os.replace(partial, out_dir / f"{stem}.png")
  print(table(results))
  print(f"wrote {out_dir / (stem + '.json')} and {out_dir / (stem + '.png')}")
