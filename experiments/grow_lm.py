"""Grows a trained model (more key/value heads, more layers) without changing its logits.

    python -m experiments.grow_lm --model=code-tiny --num_kv_heads=6 --num_layers=8 \\
        --out=runs/code-tiny-grown

`--out` is a Hugging Face directory (float32) to continue training from
(`train_lm --config.init_from=<out> --config.model.num_kv_heads=.. --config.model.num_layers=..`).
Its `heldout_files.json` and `training_summary.json` are the source's (the grown model
computes the same function, so the recorded numbers still hold), the summary extended
with `grown_from`. See `mdjax.train.grow` for how heads and layers are added.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

from absl import app, flags

from mdjax.checkpoints import hf
from experiments.cli import one_line_errors
from mdjax.train import export, grow

_MODEL = flags.DEFINE_string("model", "code-tiny", "shipped model name or model directory")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", None, "key/value heads after growth")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", None, "layers after growth")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the new layers' (silent) weights")
_OUT = flags.DEFINE_string("out", None, "directory to write the grown model to", required=True)


def main(argv):
  del argv
  source = hf.resolve(_MODEL.value)
  model = hf.load_hf_dir(source)
  params, config = grow.grow(model.params, model.config, num_kv_heads=_NUM_KV_HEADS.value,
                             num_layers=_NUM_LAYERS.value, seed=_SEED.value)
  grown = dataclasses.replace(model, params=params, config=config)
  hf.save_hf(grown, _OUT.value)
  out = pathlib.Path(_OUT.value)
  if (source / "heldout_files.json").is_file():
    shutil.copy(source / "heldout_files.json", out / "heldout_files.json")
  summary = export.recorded_summary(source)
  summary["grown_from"] = {"model": _MODEL.value, "num_kv_heads": model.config.num_kv_heads,
                           "num_layers": model.config.num_layers, "seed": _SEED.value}
  (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  print(f"{model.description} -> {out}: {config.num_kv_heads} kv heads, "
        f"{config.num_layers} layers, {config.num_params / 1e6:.1f}M params")


if __name__ == "__main__":
  app.run(one_line_errors(main))
