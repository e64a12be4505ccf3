"""Configs: the schema and its defaults, ``FILE:variant,key=value`` arguments, a run's identity."""

from postnorm.config.args import ConfigArgError, apply_arg, parse_flags, set_field
from postnorm.config.identity import config_data, config_digest
from postnorm.config.schema import ConfigError, base_config, check_fields

__all__ = ["ConfigArgError", "ConfigError", "apply_arg", "base_config", "check_fields",
           "config_data", "config_digest", "parse_flags", "set_field"]
