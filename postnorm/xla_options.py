"""XLA compile options for the run's programs (``runtime.xla_options``).

The setting is ``name=value`` items separated by spaces, as in ``XLA_FLAGS`` but without the
dashes, with names from XLA's debug and build options (``xla_cpu_enable_fast_math=true``).
Each program gets them at its own compilation (``jax.jit(..., compiler_options=...)``), unlike
``XLA_FLAGS``, which fixes them for the whole process, so ``benchmarks/bench.py --xla_options``
can time several sets side by side. JAX's compilation cache keys programs on their options, so
a cached program is reused only under the same options.
"""

import jax
import numpy as np

FIELD = "runtime.xla_options"

XlaOptions = dict[str, bool | int | float | str]


class XlaOptionsError(ValueError):
    """A malformed or unknown XLA option; the message names the setting and the option."""


def parse_xla_options(text: str, field: str | None = None) -> XlaOptions:
    """Space-separated ``name=value`` items as a dict: true/false, integers and floats are
    typed, anything else is a string; '' is no options. Raises ``XlaOptionsError`` naming the
    setting (``field``, by default ``runtime.xla_options=<text>``) and the malformed item."""
    field = field or f"{FIELD}={text!r}"
    options: XlaOptions = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name or not value or "=" in value or "," in value:
            raise XlaOptionsError(f"{field}: {item!r} is not name=value (e.g. "
                                  "xla_cpu_enable_fast_math=true; separate options with spaces)")
        options[name] = _typed(value)
    return options


def _typed(value: str) -> bool | int | float | str:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def check_known(options: XlaOptions, field: str) -> None:
    """Compile a trivial program with ``options``, so that an option this XLA does not know
    fails here, named, rather than at the first real compilation."""
    if not options:
        return
    try:
        jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as err:
        raise XlaOptionsError(f"{field}: {str(err).splitlines()[0]}; remove or correct the "
                              "option") from None


def compiler_options(text: str, field: str | None = None) -> XlaOptions:
    """The parsed and checked options of a ``runtime.xla_options`` setting; errors name
    ``field`` (by default ``runtime.xla_options=<text>``)."""
    field = field or f"{FIELD}={text!r}"
    options = parse_xla_options(text, field)
    check_known(options, field)
    return options
