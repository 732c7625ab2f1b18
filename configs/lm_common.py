"""The fields every LM training config shares; `lm_target.py`, `lm_draft.py` and
`lm_tiny_test.py` set the model size and the schedule.

    python -m experiments.train_lm --config=configs/lm_target.py --config.run_dir=/tmp/run

Strings stand for "none": `data_dir=""` trains on the running Python's standard
library, `tokenizer=""` trains a byte-level BPE of `vocab_size` into the run dir,
`export_dir=""` exports into `run_dir/export`, `card_notes=""` adds nothing to the
model card, `init_from=""` starts from random weights (else: a Hugging Face directory of
the same architecture whose weights the run continues from, e.g. an earlier float32
export; a tied one may continue untied), `teacher=""` trains on the data alone (else: a model name or directory with the
same vocabulary to distill from, see `mdjax.train.distill`).
"""

import ml_collections


def get_base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.run_dir = ""  # required: checkpoints, metrics, plot, export
  config.data_dir = ""  # any folder of text/code; "" = the standard library
  config.data_pattern = "*.py"  # glob of the files to read, recursively
  config.heldout_fraction = 0.05
  config.tokenizer = ""  # a directory with tokenizer.json; "" = train one
  config.vocab_size = 8192
  config.seed = 0
  config.init_from = ""  # a model directory to continue from; "" = random init
  config.copy_fraction = 0.0  # share of sequences whose second half repeats the first
  config.copy_min_period = 0  # > 0: copy rows repeat a prefix of this many..seq_len/2 tokens
  config.copy_shown_twice = False  # True: copy rows show chunks of that length twice each
  config.random_copy_fraction = 0.0  # share of sequences that repeat a random block of ids
  config.random_copy_common_share = 0.0  # > 0: this share of random ids from 2..8 common ones
  config.random_copy_shown_twice = False  # True: each random block shown twice, then a fresh one
  config.teacher = ""  # a model to distill from; "" = none
  config.distill_weight = 0.5  # with a teacher: loss = (1 - w) CE + w KL(teacher || student)
  config.distill_temperature = 1.0
  config.seq_len = 256
  config.batch_size = 16
  # "data,tensor", e.g. "2,4": train on a ("data", "tensor") mesh of all the devices (their
  # count must be data x tensor, batch_size a multiple of data; see `mdjax.train.lm`);
  # "" = one device, no mesh. Checkpoints resume on any mesh.
  config.mesh = ""
  # "" = one process; "auto" = JAX's cluster detection (TPU pod, SLURM, Kubernetes);
  # "HOST:PORT,NUM_PROCESSES,PROCESS_ID" = explicit. Every process runs the same command
  # (config.mesh spans all their devices; run_dir on a filesystem they share); only
  # process 0 writes files. Checkpoints resume on any number of processes.
  config.distributed = ""
  config.steps = 1000
  config.model = ml_collections.ConfigDict({
      "hidden_size": 128, "intermediate_size": 384, "num_layers": 2, "num_heads": 4,
      "num_kv_heads": 2, "head_dim": 32, "rope_theta": 10000.0, "tie_word_embeddings": True})
  config.optim = ml_collections.ConfigDict({
      "lr": 3e-3, "warmup_steps": 100, "min_lr_ratio": 0.1, "weight_decay": 0.1, "b1": 0.9,
      "b2": 0.95, "clip_norm": 1.0})
  config.log_every = 10
  config.eval_every = 200
  config.eval_sequences = 64  # the fixed, evenly spaced held-out subset
  config.checkpoint_every = 100
  config.keep_checkpoints = 3
  config.export_dir = ""
  config.export_dtype = "bfloat16"  # or "float32"
  config.export_shard_mb = 0.0  # > 0: weights in shards of at most this many MiB, with an index
  config.export_only = False  # export the latest checkpoint without training further
  config.card_notes = ""  # a markdown file appended to the model card
  return config


def get_shipped_config(steps: int, lr: float, **model) -> ml_collections.ConfigDict:
  """The run settings the shipped target and draft share, for the architecture `model`."""
  config = get_base_config()
  config.model.update(**model)
  config.seq_len = 512
  config.batch_size = 8
  config.steps = steps
  config.optim.update(lr=lr, warmup_steps=50)
  config.eval_every = 100
  config.checkpoint_every = 50
  return config
