"""A run's identity: its config as JSON, the digest of that, and the fields a resume may change."""

import hashlib
import json

import ml_collections

from postnorm.config.fields import FIELDS, RESUMABLE_SECTIONS, VERSIONS

# Sections that choose how the process runs, not what it computes: left out of a run's
# identity, so changing them (or a run recorded before they existed) is the same run.
PROCESS_SECTIONS = ("runtime",)


def _resumable_fields() -> tuple[str, ...]:
    """The declared ``resumable`` fields outside ``PROCESS_SECTIONS``, in the config's order,
    those of a ``RESUMABLE_SECTIONS`` section as ``section.*``."""
    paths = [f"{f.section}.*" if f.section in RESUMABLE_SECTIONS else f.path
             for f in FIELDS if f.resumable and f.section not in PROCESS_SECTIONS]
    return tuple(dict.fromkeys(paths))


# Fields a resume may change (``Field.resumable``): they set what is logged, evaluated,
# diagnosed and kept, what is done about a non-finite step (finite steps are the same under every
# policy), where the prepared data is stored, and how the same model is computed and laid out
# over the devices (``mesh.*``), not the function any finite step computes. (A run recorded
# before one of them existed resumes too.)
RESUMABLE_FIELDS = _resumable_fields()

# Fields added with a default that computes what runs recorded before them computed
# (``Field.added``): a record without one of them matches a config that keeps its default.
# (Other fields absent from a record are changes: their default then may not be what the run
# used.) Grouped by the version that added them (``fields.VERSIONS``), oldest first, so that the
# config a run was recorded with can be rebuilt as each earlier version wrote it
# (``earlier_versions``).
FIELDS_ADDED = tuple(tuple(f.path for f in FIELDS if f.added == version) for version in VERSIONS)
DEFAULTS_KEEP_EARLIER_RUNS = tuple(field for added in FIELDS_ADDED for field in added)


def earlier_versions(data: dict, defaults: dict[str, object]) -> list[dict]:
    """``data`` (a config as JSON) as each earlier version of the schema recorded the same run:
    without the fields added since, where they hold their default (``defaults``: flattened);
    a version before a field that does not hold its default could not have run this config."""
    versions = []
    for since in range(len(FIELDS_ADDED)):
        later = [f for added in FIELDS_ADDED[since:] for f in added]
        flat = flatten_fields(data)
        if any(f in flat and flat[f] != defaults[f] for f in later):
            continue
        older = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
        for field in later:
            section, name = field.split(".")
            older.get(section, {}).pop(name, None)
        versions.append({k: v for k, v in older.items() if v != {}})
    return versions


# Sections an evaluation of a checkpoint must share with the run that trained it, and the
# fields of them it may still choose.
EVAL_SECTIONS = ("model", "data")
EVAL_FREE_FIELDS = ("data.data_dir", "data.batch_size", "model.remat", "model.scan_unroll",
                    "model.attention", "model.attention_block")


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


def matches(field: str, patterns: tuple[str, ...]) -> bool:
    """``field`` is one of ``patterns`` or lies in a ``section.*`` among them."""
    return any(field == p or (p.endswith(".*") and field.startswith(p[:-1])) for p in patterns)
