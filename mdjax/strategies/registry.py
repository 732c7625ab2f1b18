"""The strategies `mdjax.generate` knows, by name: a strategy's module decorates its
class with `@register` (the class declares its name, layout and options itself,
`mdjax.strategies.base`), and `mdjax.strategies` imports the module."""

from __future__ import annotations

from mdjax import errors
from mdjax.controls import CONTROL_OPTIONS
from mdjax.errors import MdjaxError
from mdjax.strategies.base import Strategy

STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
  """Makes `cls` known to `generate` by its `name` (usable as a class decorator)."""
  declared = isinstance(cls, type) and "__dataclass_params__" in vars(cls)  # not only inherited
  if not (declared and issubclass(cls, Strategy) and cls.__dataclass_params__.frozen):
    raise MdjaxError(f"{getattr(cls, '__name__', cls)} is not a frozen dataclass subclassing "
                     "mdjax.strategies.base.Strategy")
  for attribute in ("name", "layout"):
    if not hasattr(cls, attribute):
      raise MdjaxError(f"strategy class {cls.__name__} does not declare its {attribute}")
  STRATEGIES[cls.name] = cls
  return cls



def get(name: str) -> type[Strategy]:
  """The strategy class registered as `name`."""
  if not isinstance(name, str) or name not in STRATEGIES:
    raise MdjaxError(f"unknown strategy {name!r}; valid strategies: {', '.join(STRATEGIES)}; "
                     "pipelines of several generate calls (margins, reasoning, predict_user) "
                     "are run with mdjax.pipelines.run")
  return STRATEGIES[name]


def option_names(name: str) -> tuple[str, ...]:
  """The options (keyword arguments of `mdjax.generate`) strategy `name` takes."""
  return get(name).options()


def check_options(name: str, options: dict) -> None:
  """Rejects an option that strategy `name` does not take, naming the valid ones (a
  control it does not honor: naming the strategies that do)."""
  for option in options:
    if option in CONTROL_OPTIONS and option not in get(name).controls:
      honoring = [n for n, cls in STRATEGIES.items() if option in cls.controls]
      raise MdjaxError(f"strategy {name!r} does not honor the control {option!r}; strategies "
                       f"that do: {', '.join(honoring) or 'none'}")
  errors.check_options("strategy", name, options, option_names(name))
