"""The trainers' configs, typed: one frozen dataclass per trainer, built once from the
`ml_collections.ConfigDict` a user passes (`configs/lm_common.py`, `configs/heads_common.py`:
the same fields, the same nesting) and handed to every function of the run.

    ConfigDict (the CLI's --config.<field>=..., or Python)
        |  typed(): every field present, none unknown, each of its field's type
        v
    LMTrainConfig / HeadsTrainConfig  -->  the trainer's validate() (values)  -->  train

The fields' meanings: the comments of the config files above.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from collections.abc import Mapping
from typing import TypeVar

import ml_collections

from mdjax.errors import MdjaxError


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  """AdamW with global-norm clipping under a warmup-cosine schedule (`loop.make_optimizer`)."""

  lr: float
  warmup_steps: int
  min_lr_ratio: float
  weight_decay: float
  b1: float
  b2: float
  clip_norm: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """What the shared loop (`mdjax.train.loop`) reads: the fields both trainers have."""

  run_dir: str
  seed: int
  heldout_fraction: float
  steps: int
  batch_size: int
  mesh: str  # "data,tensor"; "" = one device
  distributed: str  # "" = one process (`experiments.cli.start_processes`)
  optim: OptimConfig
  log_every: int
  eval_every: int
  checkpoint_every: int
  keep_checkpoints: int
  export_dir: str
  export_dtype: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMArchitecture:
  """The `ModelConfig` fields of the llama the LM trainer builds (`lm.model_config`)."""

  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float
  tie_word_embeddings: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMTrainConfig(TrainConfig):
  """`mdjax.train.lm`'s config (`configs/lm_common.py`); `copy_fraction` to
  `random_copy_shown_twice`: the row mix (`data.RowMix`)."""

  data_dir: str
  data_pattern: str
  tokenizer: str
  vocab_size: int
  init_from: str
  copy_fraction: float
  copy_min_period: int
  copy_shown_twice: bool
  random_copy_fraction: float
  random_copy_common_share: float
  random_copy_shown_twice: bool
  teacher: str
  distill_weight: float
  distill_temperature: float
  seq_len: int
  model: LMArchitecture
  eval_sequences: int
  export_shard_mb: float
  export_only: bool
  card_notes: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadsDataConfig:
  """`config.data` of the heads trainer: what its data is made of (prompts the target
  answers, a text, or a data set) and how its features are cached (`mdjax.train.heads.inputs`)."""

  prompts: str
  text_file: str
  data_dir: str
  chat: bool
  samples_per_prompt: int
  temperature: float
  max_new_tokens: int
  generation_batch: int
  text_row_tokens: int
  feature_dtype: str
  feature_batch: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
  """`config.eagle` of the heads trainer: what only sequential heads (eagle, eagle3: one
  head unrolled on its own outputs) read; the other families keep the defaults."""

  unroll: int
  eval_unroll: int
  regression_weight: float
  token_weight: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadsTrainConfig(TrainConfig):
  """`mdjax.train.heads`' config (`configs/heads_common.py`): the frozen target, the
  heads trained (family and shape), the objective, and its sections."""

  model: str  # the frozen target: a name or path `mdjax.load` takes
  model_dtype: str
  init_from: str  # heads to continue from (a name or path `mdjax.load_heads` takes); "" = seeded
  family: str
  num_heads: int
  num_layers: int
  own_unembedding: bool
  draft_vocab_size: int
  loss: str
  head_decay: float
  mask_prompt: bool
  data: HeadsDataConfig
  eagle: EagleConfig
  max_minutes: float


Config = TypeVar("Config")
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


def typed(cls: type[Config], config: ml_collections.ConfigDict | Config,
          name: str = "config") -> Config:
  """`config` as a `cls`: a ConfigDict (or any mapping) converted field by field, nested
  ones into nested dataclasses; a `cls` as it is. `MdjaxError` naming the field for one
  that is missing, unknown, or of another type than its field's (an int is a float)."""
  if isinstance(config, cls):
    return config
  if not isinstance(config, Mapping | ml_collections.ConfigDict):
    raise MdjaxError(f"{name} must be a ConfigDict of {cls.__name__}'s fields, got "
                     f"{type(config).__name__}")
  fields = typing.get_type_hints(cls)
  for key in config.keys():
    if key not in fields:
      close = difflib.get_close_matches(key, fields, n=1)
      hint = f" (did you mean {name}.{close[0]}?)" if close else ""
      raise MdjaxError(f"unknown field {name}.{key} in a {cls.__name__}{hint}")
  missing = [f"{name}.{key}" for key in fields if key not in config]
  if missing:
    raise MdjaxError(f"{cls.__name__} lacks {', '.join(missing)}")
  return cls(**{key: _value(kind, config[key], f"{name}.{key}") for key, kind in fields.items()})


def _value(kind: type, value, name: str):
  """`value` of the field `name` of type `kind`, checked (and a nested config typed)."""
  if dataclasses.is_dataclass(kind):
    return typed(kind, value, name)
  exact = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
  if exact or (kind is float and isinstance(value, int) and not isinstance(value, bool)):
    return kind(value)
  raise MdjaxError(f"{name} must be {_TYPE_NAMES[kind]}, got {value!r}")


def to_json(config) -> str:
  """A typed config as the indented JSON a run keeps in `run_dir/config.json`."""
  return json.dumps(dataclasses.asdict(config), indent=2) + "\n"
