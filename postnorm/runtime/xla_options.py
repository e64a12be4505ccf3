"""XLA compile options for the run's programs (``runtime.xla_options``)."""

import functools
import re

import jax
import numpy as np

from postnorm.errors import UserError

FIELD = "runtime.xla_options"

XlaOptions = dict[str, bool | int | float | str]


class XlaOptionsError(UserError, ValueError):
    """A malformed or unknown XLA option; the message names the setting and the option."""


def _items(text: str, field: str) -> dict[str, str]:
    """The ``name=value`` items of ``text`` with their values as written."""
    items = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name or not value or "=" in value:
            raise XlaOptionsError(f"{field}: {item!r} is not name=value (e.g. "
                                  "xla_cpu_enable_fast_math=true; separate options with spaces)")
        items[name] = value
    return items


def parse_xla_options(text: str, field: str | None = None) -> XlaOptions:
    """Space-separated ``name=value`` items as a dict: true/false, integers and floats are
    typed, anything else is a string; '' is no options. Raises ``XlaOptionsError`` naming the
    setting (``field``, by default ``runtime.xla_options=<text>``) and the malformed item."""
    items = _items(text, field or f"{FIELD}={text!r}")
    return {name: _typed(value) for name, value in items.items()}


def _typed(value: str) -> bool | int | float | str:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


# XLA takes each option in its field's exact type: "1" for a float field, or for a string
# field, is refused with this message and retried as that type.
_WRONG_TYPE = re.compile(r"While setting option (\w+), '.*' is not a valid (float|string) value")


def _compile_trivial(options: XlaOptions) -> None:
    jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(compiler_options=options)


def compiler_options(text: str, field: str | None = None) -> XlaOptions:
    """The options of a ``runtime.xla_options`` setting, checked by compiling a trivial
    program with them, so that an option this XLA does not know (or a value it cannot take)
    fails here, named, rather than at the first real compilation. A number given for a float
    or string field is passed as that type. Errors name ``field`` (by default
    ``runtime.xla_options=<text>``). A setting that passed is not compiled again in the same
    process."""
    return dict(_checked_options(text, field or f"{FIELD}={text!r}"))


@functools.cache
def _checked_options(text: str, field: str) -> tuple[tuple[str, bool | int | float | str], ...]:
    """``compiler_options``' typed items, once per (``text``, ``field``) and process."""
    items = _items(text, field)
    options = {name: _typed(value) for name, value in items.items()}
    retyped: set[str] = set()
    while options:
        try:
            _compile_trivial(options)
            break
        except jax.errors.JaxRuntimeError as err:
            wrong = _WRONG_TYPE.search(str(err))
            name, kind = wrong.groups() if wrong else (None, None)
            if name in options and name not in retyped and (
                    kind == "string" or isinstance(options[name], int | float)):
                options[name] = float(items[name]) if kind == "float" else items[name]
                retyped.add(name)
                continue
            message = str(err).splitlines()[0].rstrip(".")
        except (TypeError, ValueError) as err:  # a build option JAX sets itself
            message = f"a value of the wrong type for a build option ({type(err).__name__})"
        raise XlaOptionsError(f"{field}: {message}; remove or correct the option") from None
    return tuple(options.items())
