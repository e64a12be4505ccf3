"""Config-file arguments: ``configs/default.py:pre,lr=3e-3,model.n_layers=24``."""

import importlib.util
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import NoReturn

import ml_collections
from absl import flags

from postnorm.errors import UserError

ALIASES = {
    "lr": "opt.lr",
    "steps": "train.steps",
    "layers": "model.n_layers",
    "depth": "model.n_layers",
    "norm": "model.norm",
    "init": "model.init",
    "batch": "data.batch_size",
    "seq_len": "data.seq_len",
}

Variant = Callable[[ml_collections.ConfigDict], None]


class ConfigArgError(UserError, ValueError):
    """A variant or ``key=value`` of a config argument that the config does not accept."""


def _parse_value(text: str, current: object, key: str) -> object:
    if isinstance(current, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ConfigArgError(f"{key}={text!r}: expected a boolean (true/false)")
    if isinstance(current, int | float):
        kind = type(current)
        try:
            number = float(text)
        except ValueError as err:
            raise ConfigArgError(f"{key}={text!r}: expected {kind.__name__}") from err
        if kind is int and not number.is_integer():
            raise ConfigArgError(f"{key}={text!r}: expected int")
        return kind(number)
    return text


def field_path(key: str) -> str:
    """The dotted path (``opt.lr``) of ``key``, which is a path or an alias (``lr``)."""
    return ALIASES.get(key, key)


def set_field(config: ml_collections.ConfigDict, key: str, text: str) -> None:
    """Set the dotted field ``key`` (or alias) of ``config`` from the string ``text``."""
    path = field_path(key)
    node = config
    *parents, leaf = path.split(".")
    for part in parents:
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise ConfigArgError(f"unknown config key {key!r} (no section {part!r})")
        node = node[part]
    if leaf not in node:
        raise ConfigArgError(f"unknown config key {key!r}; known in this section: {sorted(node)}")
    if isinstance(node[leaf], ml_collections.ConfigDict):
        raise ConfigArgError(f"{key!r} is a config section, not a field: set one of its fields, "
                             f"e.g. {path}.{sorted(node[leaf])[0]}")
    node[leaf] = _parse_value(text, node[leaf], path)


def apply_arg(config: ml_collections.ConfigDict, arg: str | None,
              variants: Mapping[str, Variant]) -> ml_collections.ConfigDict:
    """Apply the variants and overrides of ``arg`` to ``config``, in order; returns it."""
    for token in filter(None, (t.strip() for t in (arg or "").split(","))):
        if "=" in token:
            key, _, value = token.partition("=")
            set_field(config, key.strip(), value.strip())
        elif token in variants:
            variants[token](config)
        else:
            raise ConfigArgError(f"unknown config variant {token!r}; known: {sorted(variants)}")
    return config


def load_module(path: str) -> ModuleType:
    """Import a Python file (a config or sweep file) by path."""
    name = "_config_file_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config_file_variants(path_arg: str) -> Mapping[str, Variant]:
    """The named variants (``VARIANTS``) of the config file ``path_arg`` names (``file.py`` or
    ``file.py:args``); none if it defines none."""
    return getattr(load_module(path_arg.partition(":")[0]), "VARIANTS", {})


def _config_arg_error(error: BaseException | None) -> ConfigArgError | None:
    """The innermost (original) ``ConfigArgError`` in the chain of exceptions that led to
    ``error``, if any (ml_collections re-raises it as one of the same type whose message is
    the traceback)."""
    found, seen = None, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = error if isinstance(error, ConfigArgError) else found
        error = error.__cause__ or error.__context__
    return found


def _flag_error(message: str) -> NoReturn:
    """absl's report of a flag error (as ``app.parse_flags_with_usage`` prints it); exit 1."""
    if "\n" in message:
        message = "\n" + textwrap.indent(message, "  ")
    sys.stderr.write(f"FATAL Flags parsing error: {message}\n"
                     "Pass --helpshort or --helpfull to see help on flags.\n")
    sys.exit(1)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (``app.run(main, flags_parser=parse_flags)``), where these mistakes
    become a flag error (exit 1) instead of a traceback: a config file that cannot be loaded
    or has no ``get_config`` returning a ConfigDict,
    a bad variant or ``key=value`` in ``--config=<file>:<arg>`` (ml_collections quotes the
    traceback), and a ``--config.<path>=value`` override of a field the config does not have
    (a bare ``AttributeError``/``KeyError``)."""
    overrides = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
    try:
        remaining = flags.FLAGS(argv)
        if "config" in flags.FLAGS:  # ml_collections defers a missing file's error to first use
            config = flags.FLAGS["config"].value
            getattr(config, "keys", None)  # raises the deferred error of a file not loaded
            if not isinstance(config, ml_collections.ConfigDict):
                _flag_error(f"--config: the file's get_config() returned an object of type "
                            f"{type(config).__name__}, not an ml_collections.ConfigDict (see "
                            "configs/default.py)")
        return remaining
    except OSError as err:
        _flag_error(f"--config: {err}")
    except flags.Error as err:
        _flag_error(str(_config_arg_error(err) or err))
    except (AttributeError, KeyError) as err:
        if "'get_config'" in str(err):
            _flag_error("--config: the file defines no get_config(arg=None) returning an "
                        "ml_collections.ConfigDict (see configs/default.py)")
        if not overrides:  # raised by the config file itself: its traceback is the message
            raise
        _flag_error(f"a config override names a field the config does not have ({err}); the "
                    f"overrides given: {overrides}. The fields are in the config file (e.g. "
                    "configs/default.py).")
