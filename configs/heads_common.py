"""The fields every heads-training config shares; `heads_medusa.py`, `heads_eagle.py`,
`heads_mtp.py` and `heads_tiny_test.py` set the family, the data size and the schedule.

    python -m experiments.train_heads --config=configs/heads_medusa.py --config.run_dir=/tmp/run

The fields are nested by section: the run's (top level, as `configs/lm_common.py`'s),
the heads' family and shape and their objective (top level), `config.data.*` (what the
data is made of and how its features are cached), `config.optim.*`, and `config.eagle.*`
(what only the sequential families read); on the command line `--config.data.prompts=...`.

Strings stand for "none": `data.prompts=""` uses the built-in prompt set
(`mdjax.train.head_data.prompts`), else a prompts file (one per line, or `.jsonl`);
`data.text_file=""` generates the data, else that plain text is the training data as it
is (no prompts, no generation); `export_dir=""` exports into `run_dir/export`.
`data.temperature=0` generates greedily ("greedy"), above 0 samples ("sample").
"""

import ml_collections


def get_base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.run_dir = ""  # required: data cache, checkpoints, metrics, plot, export
  config.model = "smollm2-135m-instruct"  # the frozen target: any name or path mdjax.load takes
  config.model_dtype = "float32"
  config.family = "medusa"  # or "eagle", "mtp", "eagle3"
  # heads to continue from (a name or path `mdjax.load_heads` takes, of this family and
  # shape, for config.model): their weights, and their draft vocabulary, replace the seeded
  # initial heads; the optimizer starts afresh. "" = seeded random heads
  config.init_from = ""
  config.num_heads = 4  # medusa, mtp: heads (head k guesses token t + 1 + k); eagle: must be 1
  config.num_layers = 1  # medusa: residual blocks per head; eagle: decoder layers; mtp: decoder
  #                        layers per head
  config.own_unembedding = False  # medusa: a [D, V] unembedding per head (large)
  config.draft_vocab_size = 0  # heads score only the N most frequent target tokens of the
  #                              training answers (eagle3: 8192 or 16384); 0 = all of them
  config.seed = 0  # split, generation, initial heads, batches
  config.heldout_fraction = 0.1  # of the prompts (of the text's rows), held out by `seed`
  # "ce": the data's tokens; "kl": the target's distribution of them; "greedy" (medusa, mtp):
  # the target's greedy guesses of them, what a greedy verifier accepts, at "ce"'s cost
  # (eagle3: "ce" and "greedy" both train on those guesses, "kl" on the target's law over
  # the draft vocabulary, SpecForge's soft labels). Measured (Medusa on SmolLM2, 150 steps each,
  # same data): held-out top-1 0.169 / 0.076 / 0.058 / 0.045 with "ce" against 0.172 /
  # 0.075 / 0.058 / 0.045 with "kl", at half the time per step: prefer "ce" or "greedy"
  # for a time budget
  config.loss = "kl"
  config.head_decay = 0.8  # loss weight of head k (eagle: unrolled step k): decay^(k-1)
  config.mask_prompt = True  # no loss on targets inside the prompt
  config.data = ml_collections.ConfigDict({
      "prompts": "",  # a prompts file; "" = the built-in set
      "text_file": "",  # plain text training data instead of generated answers
      # a data set `experiments/make_head_data.py` wrote (the target's answers and hidden
      # states) instead of generating: prompts, text_file unused
      "data_dir": "",
      "chat": True,  # text prompts through the target's chat template, when it has one
      "samples_per_prompt": 1,  # answers generated per prompt (seeds differ)
      "temperature": 0.7,
      "max_new_tokens": 128,
      "generation_batch": 16,  # prompts per `mdjax.generate` call
      "text_row_tokens": 256,  # text_file: tokens per row
      "feature_dtype": "float32",  # the cached hidden states: "float32" or "float16"
      "feature_batch": 8})  # rows per forward pass of the target
  # The sequential families' (eagle, eagle3: one head unrolled on its own outputs)
  config.eagle = ml_collections.ConfigDict({
      "unroll": 1,  # steps fed their own predicted features (1 = teacher forcing)
      # unrolled steps scored on the held-out data (0 = unroll): runs trained with
      # different unroll lengths compared at one depth
      "eval_unroll": 0,
      "regression_weight": 1.0,  # eagle: smooth-L1 to the target's next hidden state
      "token_weight": 0.1})  # eagle: the token loss (config.loss) of the predicted state
  config.steps = 1000
  config.batch_size = 256  # medusa: positions; eagle, mtp: rows
  # "data,tensor", e.g. "4,2": the model on a ("data", "tensor") mesh of all the devices
  # (`mdjax.sharding`), each batch split over data (batch_size a multiple of it), the heads
  # replicated; "" = one device, no mesh. Checkpoints resume on any mesh.
  config.mesh = ""
  # "" = one process; "auto" = JAX's cluster detection (TPU pod, SLURM, Kubernetes);
  # "HOST:PORT,NUM_PROCESSES,PROCESS_ID" = explicit. Every process runs the same command
  # (config.mesh spans all their devices; run_dir on a filesystem they share); only
  # process 0 writes files. Checkpoints resume on any number of processes.
  config.distributed = ""
  config.optim = ml_collections.ConfigDict({
      "lr": 1e-3, "warmup_steps": 50, "min_lr_ratio": 0.1, "weight_decay": 0.0, "b1": 0.9,
      "b2": 0.95, "clip_norm": 1.0})
  config.log_every = 10
  config.eval_every = 200
  config.checkpoint_every = 100
  config.keep_checkpoints = 3
  config.max_minutes = 0.0  # > 0: stop after the step that crosses this budget, then export
  config.export_dir = ""
  config.export_dtype = "float32"  # the exported weights: "float32" or "bfloat16" (half the size)
  return config


def get_shipped_config(family: str) -> ml_collections.ConfigDict:
  """What the shipped SmolLM2 heads' configs share: `family` over the default model,
  two answers per prompt, a float16 cache of hidden states (the same data, so every
  family's run reuses the first one's cache), evaluations every 250 steps, checkpoints
  every 100, the 90-minute budget, a bfloat16 export (half the size; `mdjax.load_heads`
  gives float32)."""
  config = get_base_config()
  config.family = family
  config.data.samples_per_prompt = 2
  config.data.feature_dtype = "float16"
  config.eval_every = 250
  config.checkpoint_every = 100
  config.max_minutes = 90.0
  config.export_dtype = "bfloat16"
  return config

