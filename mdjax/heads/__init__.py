"""Multi-token-prediction heads over a frozen model: Medusa, the EAGLE-style
sequential head and parallel MTP heads (see `mdjax.heads.base` for the layout and the
file format)."""

from mdjax.heads.base import (FAMILIES, Heads, HeadsConfig, load_heads, save_heads,
                              shipped_heads)
from mdjax.heads.formats import LAYOUTS, export_heads, import_heads
from mdjax.heads.eagle import eagle_causal, eagle_config, eagle_step, init_eagle
from mdjax.heads.medusa import init_medusa, medusa_features, medusa_logits
from mdjax.heads.mtp import (check_mtp_params, init_mtp, mtp_cache_config, mtp_causal,
                             mtp_features, mtp_step)


def init_heads(config: HeadsConfig, model_config, seed: int = 0, dtype="float32") -> Heads:
  """Untrained heads of `config.family` for a model of `model_config`."""
  from mdjax.models.config import weight_dtype
  config.check_model(model_config)
  dtype = weight_dtype(dtype)
  if config.family == "medusa":
    params = init_medusa(config, seed, dtype)
  elif config.family == "eagle":
    params = init_eagle(config, model_config, seed, dtype)
  else:
    params = init_mtp(config, model_config, seed, dtype)
  return Heads(config=config, params=params)


__all__ = ["FAMILIES", "Heads", "HeadsConfig", "load_heads", "save_heads", "shipped_heads",
           "init_heads", "init_medusa", "medusa_features", "medusa_logits", "init_eagle",
           "eagle_config", "eagle_step", "eagle_causal", "init_mtp", "mtp_cache_config",
           "mtp_features", "mtp_step", "mtp_causal", "check_mtp_params", "LAYOUTS",
           "import_heads", "export_heads"]
