"""Heads in the layouts other projects publish them in: import and export.

Each layout is a directory with a `config.json` and one safetensors file (torch
pickles, `.pt` / `.bin`, are refused: loading one runs code; the error says how to
convert). Torch `Linear` weights are stored `[out, in]`::

    medusa (FasterDecoding)   medusa_lm_head.safetensors
      {k}.{l}.linear.weight  [D, D]  {k}.{l}.linear.bias [D]   block l < L of head k
      {k}.{L}.weight         [V, D]                            head k's own unembedding
      config.json: medusa_num_heads (K), medusa_num_layers (L), base_model_name_or_path
    vllm-medusa (vLLM)        model.safetensors
      blocks.{k}.layers.{l}.weight [D, D]  blocks.{k}.layers.{l}.bias [D] (if medusa_fc_bias)
      lm_heads.{k}.weight          [V, D]  (only lm_heads.0, the model's, if original_lm_head)
      config.json: model_type "medusa", num_heads, num_hidden_layers, hidden_size, vocab_size
    eagle (SafeAILab EAGLE-1/2)  model.safetensors
      fc.weight [D, 2D]  fc.bias [D] (unless "bias": false)    on concat(embedding, feature)
      layers.{i}.<a Hugging Face decoder layer>, but layers.0 has no input_layernorm
      embed_tokens.weight [V, D]                               a copy of the model's
      config.json: the base model's, num_hidden_layers = the head's layers
    eagle3 (SafeAILab EAGLE-3)  model.safetensors
      fc.weight [D, 3D]                                        on the target's three layers
      midlayer.{input_layernorm (embedding), hidden_norm (feature), self_attn.{q,k,v}_proj
        [., 2D], o_proj, post_attention_layernorm, mlp.*}      one decoder layer
      norm.weight [D]   lm_head.weight [V_d, D]
      d2t int64 [V_d] (target id - draft id)   t2d bool [V]    the draft vocabulary
      config.json: a llama config of the layer, draft_vocab_size, and (vLLM's key)
        eagle_aux_hidden_state_layer_ids: the target layers, as inputs of layer i
    speculators (vLLM speculators)  model.safetensors: eagle3's tensors, the layer as
      layers.0.*, and fc.bias [D]
      config.json: speculators_model_type "eagle3", transformer_layer_config (the
        layer's llama config), draft_vocab_size, eagle_aux_hidden_state_layer_ids,
        speculators_config {algorithm "eagle3", proposal_methods, verifier}

and onto mdjax's heads (`mdjax.heads.base`)::

    medusa layouts   {k}.{l} weight.T, bias -> blocks.w[k, l] [D, D], blocks.b[k, l] [D]
                     head k's unembedding.T -> lm_head[k] [D, V] (own_unembedding=True);
                     vLLM's original_lm_head -> none: the model's lm_head, shared
    eagle            fc.weight.T, fc.bias   -> fc [2D, D], fc_bias [D]
                     layers.{i}             -> layers[i], as `mdjax.checkpoints.hf` maps a model's
                                               (layer 0 without attn_norm; no final_norm)
                     embed_tokens           -> not imported: the model's embedding is used
    eagle3 layouts   q, k, v_proj.T        -> layers[0].wqkv [2D, (N + 2K) H] (fused)
                     input_layernorm       -> layers[0].embed_norm; hidden_norm -> attn_norm
                     d2t                   -> draft_ids = d2t + arange (`mdjax.heads.vocab`)
                     aux layer ids i       -> HeadsConfig.target_layers i - 1 (the output of
                                              layer i - 1: mdjax counts layer outputs)

`load_heads(directory)` imports any of them (`detect_layout`); `import_heads` also takes
the model's config (to check it, or to name the base family where the files do not);
`export_heads` writes them back, atomically.

Each layout is one `CheckpointFormat` (`common`: its reader, writer, detector and the
family it holds), registered by name by the module of its family's layouts: `medusa`
(medusa, vllm-medusa), `eagle` (eagle), `eagle3` (eagle3, speculators). A new layout is
one such registration; nothing here changes.
"""

from __future__ import annotations

import os
import pathlib

from mdjax.errors import CheckpointError, MdjaxError
from mdjax.files import atomic_directory
# importing a layouts module registers its formats (the order `detect_layout` tries them in)
from mdjax.heads.formats import medusa, eagle, eagle3  # noqa: F401  (isort: skip)
from mdjax.heads.formats.common import (CARD_FILE, CONFIG_FILE, FORMATS, WEIGHTS_FILE,
                                        CheckpointFormat, get)
from mdjax.heads.base import Heads
from mdjax.heads.formats.medusa import MEDUSA_FILE
from mdjax.models.config import ModelConfig, weight_dtype
from mdjax.models.model import Model

LAYOUTS = tuple(FORMATS)


def detect_layout(path: str | os.PathLike) -> str | None:
  """The public layout of the heads in directory `path`, None where it holds none."""
  directory = pathlib.Path(path)
  return next((name for name, spec in FORMATS.items() if spec.detect(directory)), None)


def import_heads(path: str | os.PathLike, layout: str | None = None,
                 model_config: ModelConfig | None = None, *, dtype="float32") -> Heads:
  """Heads from directory `path` in a public `layout` (`LAYOUTS`; None: detected).

  `model_config`, the model the heads will run on, is checked against them and names
  their base family where the files do not (FasterDecoding's and vLLM's Medusa configs
  name only the base model).
  """
  directory = pathlib.Path(path)
  if not directory.is_dir():
    raise CheckpointError(f"no heads directory at {str(path)!r}")
  if layout is None:
    layout = detect_layout(directory)
    if layout is None:
      raise CheckpointError(
          f"no heads in a known layout in {str(path)!r}: expected {MEDUSA_FILE} (FasterDecoding "
          f"Medusa), or {CONFIG_FILE} with {WEIGHTS_FILE} (vLLM Medusa: model_type \"medusa\"; "
          "EAGLE: an fc.weight tensor)")
  config, params = get(layout).read(directory, model_config, weight_dtype(dtype))
  if model_config is not None:
    config.check_model(model_config)
  card = (directory / CARD_FILE).read_text() if (directory / CARD_FILE).is_file() else ""
  return Heads(config=config, params=params, card=card, name=str(path), path=str(path))


def export_heads(heads: Heads, path: str | os.PathLike, layout: str, *,
                 model: Model | None = None, dtype="float32") -> None:
  """Writes `heads` as directory `path` (replaced atomically) in public `layout`.

  `model` (the one the heads run on) is needed where the layout stores parts of it:
  eagle (its config and embedding) and medusa heads that share its unembedding.
  """
  spec = get(layout)
  if heads.config.family != spec.family:
    raise MdjaxError(f"the {layout} layout holds {spec.family} heads; these are "
                     f"{heads.config.family} heads")
  if model is not None:
    heads.check_model(model.config)
  np_dtype = weight_dtype(dtype)
  with atomic_directory(path) as staging:
    spec.write(heads, staging, model, np_dtype)
    if heads.card:
      (staging / CARD_FILE).write_text(heads.card)


__all__ = ["LAYOUTS", "CARD_FILE", "CheckpointFormat", "detect_layout", "import_heads",
           "export_heads"]
