"""Decoding strategies, by the name `mdjax.generate` knows them.

Adding a strategy is one new module whose class is decorated with
`@registry.register` (the class declares its name, layout and options itself:
`mdjax.strategies.base`), plus its name in the import below.
"""

# Importing a strategy module registers the strategies it defines.
from mdjax.strategies import (autoregressive, beam, eagle, entropy, lookahead,  # noqa: F401
                              lookup, medusa, mixed, self_speculative, speculative,
                              speculative_tree)
from mdjax.strategies.registry import STRATEGIES, check_options, get, option_names, register

__all__ = ["STRATEGIES", "check_options", "get", "option_names", "register"]
