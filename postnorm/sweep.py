"""Sweep planning: a sweep file's grid -> a stable list of runs, shardable across hosts.

A sweep file (``configs/sweeps/*.py``) defines ``BASE_CONFIG`` (a config file, optionally with
``:variant,key=value`` arguments) and ``get_sweep(arg=None) -> list[dict]``, one dict of
``{dotted config key: value}`` overrides per run. ``plan`` turns it into ``RunSpec``s whose ids
are derived from the overrides that vary across the sweep (so they are stable and readable);
``shard(specs, i, n)`` takes every n-th run starting at i, so n hosts can split a sweep with
``--shard i/n`` and write into one shared output directory.
"""

import dataclasses
import importlib.util
import os
import re
from types import ModuleType

import ml_collections

from postnorm.config_args import set_field

_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its id (a directory name) and its config overrides."""

    run_id: str
    overrides: tuple[tuple[str, object], ...]

    def override(self, key: str) -> object:
        return dict(self.overrides)[key]


def load_module(path: str) -> ModuleType:
    """Import a Python file by path."""
    name = "_sweep_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def split_arg(path_arg: str) -> tuple[str, str | None]:
    """``file.py:args`` -> (``file.py``, ``args``); no colon -> (path, None)."""
    path, sep, arg = path_arg.partition(":")
    return path, (arg if sep else None)


def _value_text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def run_id(overrides: dict[str, object], keys: list[str]) -> str:
    """``<leaf>=<value>`` of ``keys`` joined by ``_``, e.g. ``n_layers=12_norm=post_lr=0.001``."""
    parts = [f"{key.rsplit('.', 1)[-1]}={_value_text(overrides[key])}" for key in keys]
    return _UNSAFE.sub("-", "_".join(parts))


def varying_keys(grid: list[dict[str, object]]) -> list[str]:
    """The keys of ``grid``'s entries whose values differ between entries, sorted."""
    keys = sorted({key for overrides in grid for key in overrides})
    return [k for k in keys if len({_value_text(o[k]) for o in grid}) > 1]


def id_keys(grid: list[dict[str, object]]) -> list[str]:
    """The keys run ids name: those whose values vary, or all keys when none vary."""
    return varying_keys(grid) or sorted({key for overrides in grid for key in overrides})


def plan(grid: list[dict[str, object]]) -> list[RunSpec]:
    """RunSpecs in grid order; ids name ``id_keys(grid)``."""
    keys = sorted({key for overrides in grid for key in overrides})
    for index, overrides in enumerate(grid):
        if sorted(overrides) != keys:
            raise ValueError(f"sweep entry {index} sets {sorted(overrides)}, others set {keys}: "
                             "every entry must set the same keys")
    named = id_keys(grid)
    specs = [RunSpec(run_id(o, named), tuple((k, o[k]) for k in keys)) for o in grid]
    ids = [s.run_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"the sweep repeats runs: {sorted({i for i in ids if ids.count(i) > 1})}")
    return specs


def plan_file(sweep_arg: str) -> tuple[str, list[RunSpec]]:
    """(BASE_CONFIG, plan) of ``path/to/sweep.py[:arg]``."""
    path, arg = split_arg(sweep_arg)
    module = load_module(path)
    return module.BASE_CONFIG, plan(module.get_sweep(arg))


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 0 <= int(match[1]) < int(match[2]):
        raise ValueError(f"--shard={text!r}: expected i/n with 0 <= i < n, e.g. 0/4")
    return int(match[1]), int(match[2])


def shard(specs: list[RunSpec], index: int, count: int) -> list[RunSpec]:
    """Every ``count``-th run starting at ``index``: the shards partition the plan."""
    return specs[index::count]


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
