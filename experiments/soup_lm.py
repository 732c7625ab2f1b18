"""Averages the weights of exported models of one shape and lineage (a model soup).

    python -m experiments.soup_lm --models=code-tiny,runs/target-20/export,runs/target-22/export \\
        --out=runs/soup

`--out` is a Hugging Face directory (`--dtype`, default bfloat16, as shipped) with the
first model's tokenizer and `heldout_files.json`: every ingredient must record the same
held-out files, or no evaluation of the soup would be clean of training files. Its
`training_summary.json` records the ingredients and their weights; `tokens_seen_total`
is the most any ingredient saw (stages of one lineage share their tokens). Evaluate it
with `experiments.eval_lm --target=<out>`. See `mdjax.train.soup`.
"""

from __future__ import annotations

import json
import pathlib
import shutil

from absl import app, flags

from mdjax.errors import MdjaxError
from experiments.cli import one_line_errors
from mdjax.checkpoints import hf
from mdjax.train import export, soup

_MODELS = flags.DEFINE_list("models", None, "shipped model names or model directories",
                            required=True)
_WEIGHTS = flags.DEFINE_list("weights", None, "a weight per model (default: equal)")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "weight dtype of the written soup")
_OUT = flags.DEFINE_string("out", None, "directory to write the soup to", required=True)


def main(argv):
  del argv
  directories = [hf.resolve(name) for name in _MODELS.value]
  heldout = [json.loads((d / "heldout_files.json").read_text())["heldout"]
             if (d / "heldout_files.json").is_file() else None for d in directories]
  if any(h != heldout[0] for h in heldout):
    raise MdjaxError("the models record different held-out files (heldout_files.json): a "
                     "soup of them has seen training files of each other's held-out split")
  weights = None if _WEIGHTS.value is None else [float(w) for w in _WEIGHTS.value]
  mixed = soup.average([hf.load_hf_dir(d) for d in directories], weights)
  out = pathlib.Path(_OUT.value)
  hf.save_hf(mixed, out, dtype=_DTYPE.value)
  if heldout[0] is not None:
    shutil.copy(directories[0] / "heldout_files.json", out / "heldout_files.json")
  seen = [export.lineage_tokens(export.recorded_summary(d)) for d in directories]
  weights = weights or [1.0] * len(directories)
  record = {"averaged_from": [{"model": name, "weight": w / sum(weights), "tokens_seen_total": n}
                              for name, w, n in zip(_MODELS.value, weights, seen)],
            "tokens_seen": 0, "tokens_seen_total": max(seen), "weights_dtype": _DTYPE.value,
            "num_params": mixed.config.num_params}
  (out / "training_summary.json").write_text(json.dumps(record, indent=2) + "\n")
  print(f"soup of {len(directories)} models ({mixed.config.num_params / 1e6:.1f}M params) "
        f"-> {out}")


if __name__ == "__main__":
  app.run(one_line_errors(main))
