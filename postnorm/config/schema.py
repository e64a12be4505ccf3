"""The config schema: every field the trainer reads, with its default, built from ``fields``."""

import difflib

import ml_collections

from postnorm.config.fields import FIELDS
from postnorm.config.identity import config_data, flatten_fields
from postnorm.errors import UserError


class ConfigError(UserError, ValueError):
    """An invalid config field; the message names the field and the allowed values."""


def base_config() -> ml_collections.ConfigDict:
    """Every field the trainer reads, with CPU-sized defaults (``postnorm.config.fields``)."""
    c = ml_collections.ConfigDict()
    for field in FIELDS:
        node = c
        if field.section:
            if field.section not in c:
                c[field.section] = ml_collections.ConfigDict()
            node = c[field.section]
        node[field.path.rpartition(".")[2]] = field.default
    return c


def check_fields(config: ml_collections.ConfigDict) -> None:
    """Every field is one the trainer reads: those of ``base_config()`` (a misspelt field would
    otherwise be ignored, and its default used)."""
    known = flatten_fields(config_data(base_config()))
    unknown = [k for k in flatten_fields(config_data(config)) if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown config field {unknown[0]}{hint}: the fields are those of "
                          "postnorm/config/schema.py's base_config(); rename or remove it"
                          + (f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""))
