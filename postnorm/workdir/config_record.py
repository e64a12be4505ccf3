"""The config a workdir's run was recorded with: ``<workdir>/config.json``."""

import json

import ml_collections

from postnorm.config.fields import SECTIONS
from postnorm.config.identity import (
    DEFAULTS_KEEP_EARLIER_RUNS,
    EVAL_FREE_FIELDS,
    EVAL_SECTIONS,
    RESUMABLE_FIELDS,
    changed_fields,
    config_data,
    flatten_fields,
    matches,
)
from postnorm.config.schema import base_config
from postnorm.files import write_json_atomic
from postnorm.workdir.layout import Workdir, WorkdirError, latest_checkpoint_step


class WorkdirConfigError(WorkdirError):
    """A workdir's ``config.json`` is unreadable or records a different config."""


def read_run_config(workdir: str) -> dict | None:
    """The recorded config's JSON data, or None when the workdir has none yet.

    Raises ``WorkdirConfigError`` naming the file when it cannot be read as a JSON object.
    """
    path = Workdir(workdir).config
    try:
        with open(path) as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None  # not started yet (a workdir that cannot exist fails where it is created)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WorkdirConfigError(
            f"{path} cannot be read ({err}): restore it, or move the run aside and use a "
            "new --workdir") from err
    if (not isinstance(data, dict) or not isinstance(data.get("model"), dict)
            or not all(isinstance(value, dict) for key, value in data.items()
                       if key in SECTIONS)):
        raise WorkdirConfigError(f"{path} does not hold a config (an object with a 'model' "
                                 f"section, and each of {', '.join(SECTIONS)} it has an "
                                 "object): restore it, or move the run aside and use a new "
                                 "--workdir")
    return data


def write_run_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Record ``config`` as the workdir's run (atomically)."""
    write_json_atomic(Workdir(workdir).config, config_data(config))


def _refusal(workdir: str, recorded: dict, config: ml_collections.ConfigDict,
             refused: list[str], allowed: str) -> WorkdirConfigError:
    old, new = flatten_fields(recorded), flatten_fields(config_data(config))

    def value(flat: dict, key: str) -> str:
        return repr(flat[key]) if key in flat else "absent"

    shown = "; ".join(f"{k}: {value(old, k)} -> {value(new, k)}" for k in refused[:6])
    more = f"; and {len(refused) - 6} more" if len(refused) > 6 else ""
    added = ("; a field absent from the record was added after the run started: if the run "
             "used its value, add it to config.json" if any(k not in old for k in refused)
             else "")
    return WorkdirConfigError(
        f"{workdir} holds a run of a different config ({Workdir(workdir).config}): {shown}{more}. "
        f"{allowed}; use a new --workdir (in a sweep: a new --out_dir, or change the sweep "
        f"back) for this config, or move the old run aside{added}")


def _checkpointed_run_config(workdir: str) -> dict | None:
    """The recorded config of ``workdir``'s checkpointed run; None without a checkpoint.
    Raises ``WorkdirConfigError`` for a checkpoint without a readable ``config.json``."""
    step = latest_checkpoint_step(workdir)
    if step is None:
        return None
    recorded = read_run_config(workdir)
    if recorded is None:
        raise WorkdirConfigError(
            f"{workdir} holds a checkpoint (step {step}) but no config.json to check this "
            "config against: restore the file, or move the run aside and use a new --workdir")
    return recorded



def recorded_config(workdir: str) -> ml_collections.ConfigDict:
    """The config ``workdir``'s run was recorded with, as a config to rebuild the run from: a
    field of ``DEFAULTS_KEEP_EARLIER_RUNS`` that the record predates takes its default, which
    computes what the run computed. Raises ``WorkdirConfigError`` when there is no record."""
    recorded = read_run_config(workdir)
    if recorded is None:
        raise WorkdirConfigError(f"{Workdir(workdir).config} does not exist: give the --workdir "
                                 "of a run that has started")
    return config_with_later_defaults(recorded)


def config_with_later_defaults(recorded: dict) -> ml_collections.ConfigDict:
    """A recorded config (JSON data) with each field of ``DEFAULTS_KEEP_EARLIER_RUNS`` that it
    predates at its default."""
    config = ml_collections.ConfigDict(recorded)
    old = flatten_fields(recorded)
    default = flatten_fields(config_data(base_config()))
    for field in DEFAULTS_KEEP_EARLIER_RUNS:
        if field not in old:
            section, name = field.split(".")
            if section not in config:  # a section added since the record
                config[section] = ml_collections.ConfigDict()
            config[section][name] = default[field]
    return config

def _changed(recorded: dict, config: ml_collections.ConfigDict) -> list[str]:
    """``changed_fields``, except a field of ``DEFAULTS_KEEP_EARLIER_RUNS`` that the record
    lacks and ``config`` keeps at its default: the run computed what that default computes."""
    old, new = flatten_fields(recorded), flatten_fields(config_data(config))
    default = flatten_fields(config_data(base_config()))
    return [k for k in changed_fields(recorded, config)
            if k in old or k not in DEFAULTS_KEEP_EARLIER_RUNS or new.get(k) != default[k]]


def check_run_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Raise ``WorkdirConfigError`` when ``workdir`` holds a checkpoint of a run whose config
    differs from ``config`` outside ``RESUMABLE_FIELDS`` (the message names the fields), or a
    checkpoint without a readable ``config.json``."""
    recorded = _checkpointed_run_config(workdir)
    if recorded is None:
        return
    refused = [k for k in _changed(recorded, config)
               if not matches(k, RESUMABLE_FIELDS)]
    if refused:
        raise _refusal(workdir, recorded, config, refused,
                       "A resume may change only " + ", ".join(RESUMABLE_FIELDS)
                       + " and runtime.*")


def check_eval_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Raise ``WorkdirConfigError`` when ``workdir``'s recorded run differs from ``config`` in
    ``EVAL_SECTIONS`` outside ``EVAL_FREE_FIELDS`` (a checkpoint evaluated as another model,
    or on other data), or holds a checkpoint without a readable ``config.json`` (nothing says
    which model it is)."""
    recorded = _checkpointed_run_config(workdir)
    if recorded is None:
        return
    refused = [k for k in _changed(recorded, config)
               if k.split(".")[0] in EVAL_SECTIONS and not matches(k, EVAL_FREE_FIELDS)]
    if refused:
        raise _refusal(workdir, recorded, config, refused,
                       "An evaluation needs the run's " + " and ".join(EVAL_SECTIONS)
                       + " sections, except " + ", ".join(EVAL_FREE_FIELDS))
