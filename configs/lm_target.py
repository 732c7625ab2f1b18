"""The first shipped target: a 15.7M-parameter untied llama on the standard library.

The shipped `code-tiny` has this shape but was trained by `configs/lm_target_long.py`
(tied, then untied, with rows that teach copying): see its model card."""

from configs import lm_common


def get_config():
  return lm_common.get_shipped_config(
      steps=900, lr=2e-3,  # ~75 min at ~950 tokens/s on 2 CPU cores
      hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6, num_kv_heads=2,
      head_dim=64, tie_word_embeddings=False)
