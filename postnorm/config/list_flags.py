"""Checked values of the experiments' comma-separated list flags (``--seeds 0,1,2``)."""

import re
from collections.abc import Sequence

from absl import app


def _nonempty_distinct(name: str, values: Sequence[str], keys: Sequence[object]) -> None:
    """``values`` (compared as ``keys``) are one or more, none repeated."""
    if not values or len(set(keys)) < len(keys):
        raise app.UsageError(f"--{name}={','.join(values)}: give one or more values, each once")


def integer_list(name: str, values: Sequence[str], minimum: int) -> list[int]:
    """``values`` as integers in [``minimum``, 2**31), non-empty and distinct; a
    ``UsageError`` naming the flag otherwise."""
    if not all(re.fullmatch(r"-?[0-9]+", v) and minimum <= int(v) < 2**31 for v in values):
        raise app.UsageError(f"--{name}={','.join(values)}: each must be an integer in "
                             f"[{minimum}, 2**31)")
    _nonempty_distinct(name, values, [int(v) for v in values])
    return [int(v) for v in values]


def choice_list(name: str, values: Sequence[str], allowed: Sequence[str]) -> list[str]:
    """``values``, non-empty, distinct and each one of ``allowed``; a ``UsageError`` naming the
    flag otherwise."""
    if unknown := [v for v in values if v not in allowed]:
        raise app.UsageError(f"--{name}: {', '.join(map(repr, unknown))} is not one of "
                             f"{', '.join(allowed)}")
    _nonempty_distinct(name, values, values)
    return list(values)
