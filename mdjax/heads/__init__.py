"""Multi-token-prediction heads over a frozen target model: Medusa, the EAGLE-style
sequential head, EAGLE-3 and parallel MTP heads, each family a registered plug-in
(`mdjax.heads.family`) whose params, initialisation and forward are one Flax NNX module
(`mdjax.heads.module`); `mdjax.heads.base` holds the data, `mdjax.heads.store` mdjax's
own files, `mdjax.heads.formats` the public layouts."""

# Importing a family module registers it (the order is the one errors list them in).
from mdjax.heads import medusa, eagle, mtp, eagle3  # noqa: F401  (isort: skip)
from mdjax.heads.base import Heads, HeadsConfig
from mdjax.heads.decoder import decoder_config
from mdjax.heads.eagle import EagleHead, eagle_causal, eagle_step, init_eagle
from mdjax.heads.eagle3 import Eagle3Head
from mdjax.heads.family import HeadFamily, register
from mdjax.heads.formats import LAYOUTS, export_heads, import_heads
from mdjax.heads.medusa import MedusaHeads, init_medusa, medusa_features, medusa_logits
from mdjax.heads.mtp import (MtpHeads, check_mtp_params, init_mtp, mtp_cache_config, mtp_causal,
                             mtp_features, mtp_step)
from mdjax.heads.registry import FAMILIES, get as get_family
from mdjax.heads.store import load_heads, save_heads, shipped_heads
from mdjax.models.config import ModelConfig, weight_dtype


def init_heads(config: HeadsConfig, target_config: ModelConfig, seed: int = 0,
               dtype="float32") -> Heads:
  """Untrained heads of `config.family` for a target of `target_config`."""
  config.check_model(target_config)
  return Heads(config=config, params=get_family(config.family).init(config, target_config, seed,
                                                                    weight_dtype(dtype)))


__all__ = ["FAMILIES", "HeadFamily", "get_family", "register", "Heads", "HeadsConfig", "load_heads",
           "save_heads", "shipped_heads", "init_heads", "MedusaHeads", "EagleHead", "Eagle3Head",
           "MtpHeads", "init_medusa", "medusa_features", "medusa_logits", "init_eagle",
           "decoder_config", "eagle_step", "eagle_causal", "init_mtp", "mtp_cache_config",
           "mtp_features", "mtp_step", "mtp_causal", "check_mtp_params", "LAYOUTS",
           "import_heads", "export_heads"]
