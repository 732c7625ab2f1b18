"""The fields every decode config shares; `greedy.py` and `sample.py` build on them.

Conventions (ConfigDict overrides cannot express None or lists well, so these are
strings):
- `prompt`: text, tokenized by the model's tokenizer. When empty, `prompt_ids` is
  the prompt: comma-separated token ids (random models have no tokenizer).
  The default asks the shipped code model to complete a function of the standard
  library's `secrets.py`, a file held out of its training data, from its signature
  and docstring.
- `eos_token_id`: "" = the model's own EOS ids, "none" = no EOS (always generate
  `max_new_tokens`), else comma-separated ids such as "2" or "2,7".
- the controls (docs/controls.md), off by default: `repetition_penalty` (1 = off),
  `presence_penalty`, `frequency_penalty`, `no_repeat_ngram_size`, `min_new_tokens`
  (0 = off); `bad_words_ids` "5;7,8" (the words [5] and [7, 8]); `logit_bias` "13:2.0,42:-1"
  ({13: 2.0, 42: -1.0}); `stop_strings` a JSON list ('["\n\n", "Q:"]') or one string;
  `logprobs`, `top_logprobs` (0 = off).
"""

import ml_collections

HELDOUT_FUNCTION = '''def token_bytes(nbytes=None):
    """Return a random byte string containing *nbytes* bytes.

    If *nbytes* is ``None`` or not supplied, a reasonable
    default is used.
    """
    if nbytes is None:
        nbytes = DEFAULT_ENTROPY
    return _sysrand.randbytes(nbytes)

def token_hex(nbytes=None):
    """Return a random text string, in hexadecimal.

    The string has *nbytes* random bytes, each byte converted to two
    hex digits.  If *nbytes* is ``None`` or not supplied, a reasonable
    default is used.
    """'''  # no newline: the tokenizer merges it with the next line's indent


def get_base_config(strategy: str) -> ml_collections.ConfigDict:
  """The shared fields, set to complete a held-out function with the shipped `code-tiny`."""
  config = ml_collections.ConfigDict()
  config.model = "code-tiny"  # HF directory, hub id, shipped or built-in random model name
  config.dtype = ""  # "float32" or "bfloat16"; "": mdjax.load's default (float32 on CPU,
  #                     bfloat16 on GPU and TPU), as the API's
  config.quantize = ""  # "int8", "int4" or "gguf" (a GGUF's blocks): docs/quantization.md
  config.quantize_group = 0  # int4's inputs per group; 0: 64
  config.kv_cache_dtype = ""  # "int8", "bfloat16" or "float32"; "": the weights' dtype
  config.strategy = strategy
  config.prompt = HELDOUT_FUNCTION
  config.prompt_ids = ""
  config.max_new_tokens = 48
  config.eos_token_id = ""
  config.seed = 0  # seeds sampling; a random model always has its canonical (seed 0) weights
  config.chat = False  # apply the model's chat template to the prompt (and each question)
  config.system = ""  # with chat: a system message ("" = none)
  config.question_separator = "\n\n"  # with chat: between the prompt and each question
  config.compare_sequential = False  # multi_question: also answer each question alone, timed
  # "data,tensor", e.g. "2,4": the model on a ("data", "tensor") mesh of all the devices
  # (every process's); "" = one device, no mesh
  config.mesh = ""
  # "" = one process; "auto" = JAX's cluster detection (TPU pod, SLURM, Kubernetes);
  # "HOST:PORT,NUM_PROCESSES,PROCESS_ID" = explicit. Every process runs the same command;
  # only process 0 prints and writes files (`mdjax.distributed`)
  config.distributed = ""
  config.repetition_penalty = 1.0
  config.presence_penalty = 0.0
  config.frequency_penalty = 0.0
  config.no_repeat_ngram_size = 0
  config.min_new_tokens = 0
  config.bad_words_ids = ""
  config.logit_bias = ""
  config.stop_strings = ""
  config.logprobs = False
  config.top_logprobs = 0
  return config
