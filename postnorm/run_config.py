"""The config a workdir's run was recorded with: ``<workdir>/config.json``.

The trainer writes it (atomically) before its first step and checks it whenever it starts on
a workdir that holds a checkpoint: a workdir holds the run of one config. A resume may change
only how the run is watched and saved, how the same model is computed and laid out
(``RESUMABLE_FIELDS``), and how the process runs (``PROCESS_SECTIONS``). Any other difference
(the model, the data, the optimiser, the length of the schedule) would make the recorded run a
mixture of two configs, so it is refused before anything is overwritten. So is a checkpoint
without a ``config.json`` to compare with. A workdir without a checkpoint has trained nothing
that a new config would contradict: its run starts afresh. Evaluating a checkpoint
(``check_eval_config``) needs the model and data sections it was trained with.
"""

import hashlib
import json
import os

import ml_collections

from postnorm.data.files import write_json_atomic

CONFIG_NAME = "config.json"
CONFIG_SECTIONS = ("model", "data", "opt", "train", "diag", "runtime", "mesh")

# Sections that choose how the process runs, not what it computes: left out of a run's
# identity, so changing them (or a run recorded before they existed) is the same run.
PROCESS_SECTIONS = ("runtime",)

# Fields a resume may change: they set what is logged, evaluated, diagnosed and kept, what is
# done about a non-finite step (finite steps are the same under every policy), where the
# prepared data is stored, and how the same model is computed and laid out over the devices
# (``mesh.*``), not the function any finite step computes. (A run recorded before one of them
# existed resumes too.)
RESUMABLE_FIELDS = ("train.log_every", "train.eval_every", "train.ckpt_every",
                    "train.keep_ckpts", "diag.every", "train.nonfinite", "train.max_rollbacks",
                    "train.rollback_lr_factor", "data.data_dir", "model.remat",
                    "model.scan_unroll", "model.attention", "model.attention_block", "mesh.*")

# Sections an evaluation of a checkpoint must share with the run that trained it, and the
# fields of them it may still choose.
EVAL_SECTIONS = ("model", "data")
EVAL_FREE_FIELDS = ("data.data_dir", "data.batch_size", "model.remat", "model.scan_unroll",
                    "model.attention", "model.attention_block")


class WorkdirError(ValueError):
    """The workdir cannot be used as it is (the message says why and what to do)."""


class WorkdirConfigError(WorkdirError):
    """A workdir's ``config.json`` is unreadable or records a different config."""


def config_data(config: ml_collections.ConfigDict) -> dict:
    """The config as plain JSON data, as ``config.json`` holds it."""
    return json.loads(config.to_json_best_effort())


def canonical_config(config: ml_collections.ConfigDict | dict) -> dict:
    """The config's JSON data without ``PROCESS_SECTIONS``: the run's identity."""
    data = config if isinstance(config, dict) else config_data(config)
    return {k: v for k, v in data.items() if k not in PROCESS_SECTIONS}


def config_digest(config: ml_collections.ConfigDict | dict) -> str:
    """sha256 of the config's canonical JSON (sorted keys)."""
    text = json.dumps(canonical_config(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def config_path(workdir: str) -> str:
    """``<workdir>/config.json``."""
    return os.path.join(workdir, CONFIG_NAME)


def finalized_steps(directory: str) -> list[int]:
    """The finalized checkpoint steps under `directory` (``<step>/`` directories), newest
    first. Listed from the directory itself, so a step deleted during the listing is left
    out. Raises OSError when `directory` exists but cannot be listed."""
    if not os.path.isdir(directory):
        return []
    steps = [int(name) for name in os.listdir(directory)
             if name.isdigit() and os.path.isdir(os.path.join(directory, name))]
    return sorted(steps, reverse=True)


def latest_checkpoint_step(workdir: str) -> int | None:
    """The newest finalized checkpoint step (``checkpoints/<step>/``), or None."""
    directory = os.path.join(workdir, "checkpoints")
    try:
        steps = finalized_steps(directory)
    except OSError as err:
        raise WorkdirError(f"{directory} cannot be listed ({err}): make it readable") from err
    return next(iter(steps), None)


def read_run_config(workdir: str) -> dict | None:
    """The recorded config's JSON data, or None when the workdir has none yet.

    Raises ``WorkdirConfigError`` naming the file when it cannot be read as a JSON object.
    """
    path = config_path(workdir)
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
                       if key in CONFIG_SECTIONS)):
        raise WorkdirConfigError(f"{path} does not hold a config (an object with a 'model' "
                                 f"section, and each of {', '.join(CONFIG_SECTIONS)} it has an "
                                 "object): restore it, or move the run aside and use a new "
                                 "--workdir")
    return data


def write_run_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Record ``config`` as the workdir's run (atomically)."""
    write_json_atomic(config_path(workdir), config_data(config))


def flatten_fields(data: dict, prefix: str = "") -> dict[str, object]:
    """{dotted path: leaf value} of nested dicts."""
    flat = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_fields(value, path + "."))
        else:
            flat[path] = value
    return flat


def changed_fields(recorded: dict, config: ml_collections.ConfigDict | dict) -> list[str]:
    """Dotted paths whose values differ between two configs (``PROCESS_SECTIONS`` ignored);
    a field present in only one of them counts as changed."""
    old, new = flatten_fields(canonical_config(recorded)), flatten_fields(canonical_config(config))
    missing = object()
    return sorted(k for k in old.keys() | new.keys()
                  if old.get(k, missing) != new.get(k, missing))


def _matches(field: str, patterns: tuple[str, ...]) -> bool:
    """``field`` is one of ``patterns`` or lies in a ``section.*`` among them."""
    return any(field == p or (p.endswith(".*") and field.startswith(p[:-1])) for p in patterns)


def _refusal(workdir: str, recorded: dict, config: ml_collections.ConfigDict,
             refused: list[str], allowed: str) -> WorkdirConfigError:
    old, new = flatten_fields(recorded), flatten_fields(config_data(config))

    def value(flat: dict, key: str) -> str:
        return repr(flat[key]) if key in flat else "absent"

    shown = "; ".join(f"{k}: {value(old, k)} -> {value(new, k)}" for k in refused[:6])
    more = f"; and {len(refused) - 6} more" if len(refused) > 6 else ""
    added = ("; a field absent from the record was added after the run started: if the run "
             f"used its value, add it to {CONFIG_NAME}" if any(k not in old for k in refused)
             else "")
    return WorkdirConfigError(
        f"{workdir} holds a run of a different config ({config_path(workdir)}): {shown}{more}. "
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
            f"{workdir} holds a checkpoint (step {step}) but no {CONFIG_NAME} to check this "
            "config against: restore the file, or move the run aside and use a new --workdir")
    return recorded


def check_run_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Raise ``WorkdirConfigError`` when ``workdir`` holds a checkpoint of a run whose config
    differs from ``config`` outside ``RESUMABLE_FIELDS`` (the message names the fields), or a
    checkpoint without a readable ``config.json``."""
    recorded = _checkpointed_run_config(workdir)
    if recorded is None:
        return
    refused = [k for k in changed_fields(recorded, config)
               if not _matches(k, RESUMABLE_FIELDS)]
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
    refused = [k for k in changed_fields(recorded, config)
               if k.split(".")[0] in EVAL_SECTIONS and not _matches(k, EVAL_FREE_FIELDS)]
    if refused:
        raise _refusal(workdir, recorded, config, refused,
                       "An evaluation needs the run's " + " and ".join(EVAL_SECTIONS)
                       + " sections, except " + ", ".join(EVAL_FREE_FIELDS))
