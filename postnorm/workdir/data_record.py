"""The data a workdir's run was trained on: ``<workdir>/data_info.json``."""

import json

from postnorm.workdir.layout import Workdir, WorkdirError


class WorkdirDataError(WorkdirError):
    """A workdir's run was trained on other data than the config now gives."""


def data_identity(info: dict) -> dict[str, object]:
    """What makes two prepared datasets the same training data."""
    tokenizer = info.get("tokenizer")
    return {"fingerprint": info.get("fingerprint"),
            "tokenizer": tokenizer.get("name") if isinstance(tokenizer, dict) else None}


def read_data_info(workdir: str) -> dict | None:
    """The recorded data summary, or None when the workdir has none."""
    path = Workdir(workdir).data_info
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WorkdirDataError(
            f"{path} is unreadable ({err}): restore it, or delete it to skip the check that "
            "the run continues on the data it was trained on") from err
    if not isinstance(data, dict):
        raise WorkdirDataError(f"{path} holds no data summary: restore it, or delete it to "
                               "skip the check that the run continues on its data")
    return data


def check_run_data(workdir: str, info: dict, data_dir: str, action: str) -> None:
    """Raise ``WorkdirDataError`` when ``workdir`` records training data whose identity
    differs from ``info``'s (the data ``data_dir`` now gives); ``action`` names what would
    use it ("resume", "evaluate")."""
    recorded = read_data_info(workdir)
    if recorded is None:
        return
    old, new = data_identity(recorded), data_identity(info)
    changed = [k for k, value in old.items() if value is not None and value != new[k]]
    if not changed:
        return
    shown = "; ".join(f"{k} {old[k]} -> {new[k]}" for k in changed)
    raise WorkdirDataError(
        f"cannot {action} {workdir} on this data: it was trained on the data its "
        f"data_info.json describes (at {recorded.get('path')}), and data.data_dir={data_dir} "
        f"now gives other data at {info.get('path')} ({shown}). Point data.data_dir at the data "
        "the run was trained on, or use a new --workdir")
