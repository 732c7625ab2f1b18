"""Multi-token-prediction heads over a frozen model: Medusa, the EAGLE-style
sequential head and parallel MTP heads, each family a registered plug-in
(`mdjax.heads.family`); `mdjax.heads.base` holds the data, `mdjax.heads.store` mdjax's
own files, `mdjax.heads.formats` the public layouts."""

# Importing a family module registers it (the order is the one errors list them in).
from mdjax.heads import medusa, eagle, mtp, eagle3  # noqa: F401  (isort: skip)
from mdjax.heads.base import Heads, HeadsConfig
from mdjax.heads.decoder import decoder_config
from mdjax.heads.eagle import eagle_causal, eagle_step, init_eagle
from mdjax.heads.family import FAMILIES, HeadFamily, get as get_family, register
from mdjax.heads.formats import LAYOUTS, export_heads, import_heads
from mdjax.heads.medusa import init_medusa, medusa_features, medusa_logits
from mdjax.heads.mtp import (check_mtp_params, init_mtp, mtp_cache_config, mtp_causal,
                             mtp_features, mtp_step)
from mdjax.heads.store import load_heads, save_heads, shipped_heads
from mdjax.models.config import ModelConfig, weight_dtype


def init_heads(config: HeadsConfig, model_config: ModelConfig, seed: int = 0,
               dtype="float32") -> Heads:
  """Untrained heads of `config.family` for a model of `model_config`."""
  config.check_model(model_config)
  return Heads(config=config, params=get_family(config.family).init(config, model_config, seed,
                                                                    weight_dtype(dtype)))


__all__ = ["FAMILIES", "HeadFamily", "get_family", "register", "Heads", "HeadsConfig", "load_heads",
           "save_heads", "shipped_heads", "init_heads", "init_medusa", "medusa_features",
           "medusa_logits", "init_eagle", "decoder_config", "eagle_step", "eagle_causal",
           "init_mtp", "mtp_cache_config", "mtp_features", "mtp_step", "mtp_causal",
           "check_mtp_params", "LAYOUTS", "import_heads", "export_heads"]
