"""The head families known by name: filled by `mdjax.heads.family.register` as each
family's module is imported (`mdjax.heads` imports them all), read by everything that
asks what a family is or does (`get`) rather than comparing its name.

The lowest floor of `mdjax.heads`: it imports no other module of the package, so the
heads' config (`mdjax.heads.base`), which checks its family here, and the families'
interface (`mdjax.heads.family`), which speaks of that config, never import each other.
"""

from __future__ import annotations

from mdjax.errors import MdjaxError

FAMILIES: dict = {}  # name -> the family's `mdjax.heads.family.HeadFamily` instance


def get(name: str):
  """The `HeadFamily` registered as `name`."""
  if name not in FAMILIES:
    raise MdjaxError(f"unknown heads family {name!r}; supported: {', '.join(FAMILIES)}")
  return FAMILIES[name]


def decoded_by(strategy: str) -> tuple[str, ...]:
  """The families strategy `strategy` decodes."""
  return tuple(name for name, family in FAMILIES.items() if strategy in family.strategies)


def owning_unembeddings() -> tuple[str, ...]:
  """The families whose heads may carry their own lm_head."""
  return tuple(name for name, family in FAMILIES.items() if family.owns_unembedding)
