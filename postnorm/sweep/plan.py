"""Sweep planning: a sweep file's grid -> a stable list of runs, shardable across hosts."""

import dataclasses
import inspect
import os
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

import ml_collections
import numpy as np

from postnorm.config.args import load_module, set_field
from postnorm.errors import UserError

_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]")


T = TypeVar("T")


class SweepError(UserError, ValueError):
    """A sweep file or plan that cannot be run (the message names the file or run)."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its id (a directory name) and its config overrides."""

    run_id: str
    overrides: tuple[tuple[str, object], ...]

    def override(self, key: str) -> object:
        return dict(self.overrides)[key]


def split_arg(path_arg: str) -> tuple[str, str | None]:
    """``file.py:args`` -> (``file.py``, ``args``); no colon -> (path, None)."""
    path, sep, arg = path_arg.partition(":")
    return path, (arg if sep else None)


def _value_text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _id_text(value: object) -> str:
    """A value as run ids write it: a float's exponent without its ``+`` (``1e30``)."""
    return _value_text(value).replace("+", "") if isinstance(value, float) else str(value)


def _plain(value: object) -> object:
    """A numpy scalar as the Python number it holds (``np.float64(1e-3)`` -> ``1e-3``)."""
    return value.item() if isinstance(value, np.generic) else value


def run_id(overrides: dict[str, object], keys: list[str]) -> str:
    """``<leaf>=<value>`` of ``keys`` joined by ``_``, e.g. ``n_layers=12_norm=post_lr=0.001``
    (an exponent's ``+`` is dropped: ``lr=1e30``)."""
    parts = [f"{key.rsplit('.', 1)[-1]}={_id_text(overrides[key])}" for key in keys]
    return _UNSAFE.sub("-", "_".join(parts))


def varying_keys(grid: list[dict[str, object]]) -> list[str]:
    """The keys of ``grid``'s entries whose values differ between entries, sorted."""
    keys = sorted({key for overrides in grid for key in overrides})
    return [k for k in keys if len({_value_text(o[k]) for o in grid}) > 1]


def id_keys(grid: list[dict[str, object]]) -> list[str]:
    """The keys run ids name: those whose values vary, or all keys when none vary."""
    return varying_keys(grid) or sorted({key for overrides in grid for key in overrides})


def plan(grid: list[dict[str, object]],
         name: Callable[[dict[str, object]], str] | None = None) -> list[RunSpec]:
    """RunSpecs in grid order; ids name ``id_keys(grid)``, or are ``name(overrides)`` (a sweep
    file's ``run_name``) when given. Raises ``SweepError`` for an empty grid, an entry that is
    not a dict of dotted keys, entries that set different keys, and repeated runs."""
    if not isinstance(grid, list | tuple) or not grid:
        raise SweepError(f"get_sweep returned {grid!r}: it must return a non-empty list of "
                         "dicts, one {dotted config key: value} per run")
    for index, overrides in enumerate(grid):
        if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
            raise SweepError(f"sweep entry {index} is {overrides!r}: each entry must be a dict "
                             "of {dotted config key: value}, e.g. {'opt.lr': 1e-3}")
    grid = [{key: _plain(value) for key, value in overrides.items()} for overrides in grid]
    keys = sorted({key for overrides in grid for key in overrides})
    for index, overrides in enumerate(grid):
        if sorted(overrides) != keys:
            raise SweepError(f"sweep entry {index} sets {sorted(overrides)}, others set {keys}: "
                             "every entry must set the same keys")
    named = id_keys(grid)
    specs = [RunSpec(_UNSAFE.sub("-", name(o)) if name else run_id(o, named),
                     tuple((k, o[k]) for k in keys)) for o in grid]
    ids = [s.run_id for s in specs]
    if len(set(ids)) != len(ids):
        raise SweepError(
            f"the sweep repeats runs: {sorted({i for i in ids if ids.count(i) > 1})}")
    return specs


def plan_file(sweep_arg: str) -> tuple[str, list[RunSpec]]:
    """(BASE_CONFIG, plan) of ``path/to/sweep.py[:arg]``; ``SweepError`` names the file."""
    path, arg = split_arg(sweep_arg)
    if not os.path.isfile(path):
        raise SweepError(f"--sweep: {path} is not a file; sweep files are Python files such as "
                         "configs/sweeps/stability.py")
    module = load_module(path)
    missing = [name for name in ("BASE_CONFIG", "get_sweep") if not hasattr(module, name)]
    if missing:
        raise SweepError(f"{path} does not define {' and '.join(missing)}: a sweep file "
                         "defines BASE_CONFIG (a config file) and get_sweep(arg=None)")
    base = module.BASE_CONFIG
    if not isinstance(base, str) or not os.path.isfile(split_arg(base)[0]):
        raise SweepError(f"{path}: BASE_CONFIG={base!r} names no config file; set it to a "
                         "config file's path, such as 'configs/default.py' (or 'file.py:arg')")
    try:
        inspect.signature(module.get_sweep).bind(arg)
    except (TypeError, ValueError) as err:  # ValueError: a callable without a signature
        raise SweepError(f"{path}: get_sweep cannot take the sweep's argument ({err}); define "
                         "it as get_sweep(arg=None)") from err
    try:
        return base, plan(module.get_sweep(arg), getattr(module, "run_name", None))
    except ValueError as err:  # SweepError, or get_sweep's own (an unknown variant)
        raise SweepError(f"{sweep_arg}: {err}") from err


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 0 <= int(match[1]) < int(match[2]):
        raise SweepError(f"--shard={text!r}: expected i/n with 0 <= i < n, e.g. 0/4")
    return int(match[1]), int(match[2])


def shard(runs: Sequence[T], index: int, count: int) -> list[T]:
    """Every ``count``-th run starting at ``index``: the shards partition the plan."""
    return list(runs[index::count])


def build_config(base_config: str, spec: RunSpec,
                 extra: dict[str, str] | None = None) -> ml_collections.ConfigDict:
    """The base config file's ``get_config(arg)`` with the run's overrides, then ``extra``."""
    path, arg = split_arg(base_config)
    config = load_module(path).get_config(arg)
    for key, value in spec.overrides:
        set_field(config, key, _value_text(value))
    for key, value in (extra or {}).items():
        set_field(config, key, value)
    return config
