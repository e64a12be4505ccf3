"""Locating and opening a prepared c4/en dataset (array_record) without TensorFlow."""

import hashlib
import json
from pathlib import Path

import tensorflow_datasets as tfds

from postnorm.data.errors import DataError

NAME, CONFIG = "c4", "en"


def c4_dir(data_dir: str, version: str) -> Path:
    """Where the prepared dataset must be: <data_dir>/c4/en/<version>."""
    return Path(data_dir).expanduser() / NAME / CONFIG / version


def how_to_prepare(path: Path, version: str) -> str:
    return (
        f"Convert the public tfrecord copy of {NAME}/{CONFIG} {version} once, in an environment "
        "with TensorFlow: `tfds convert_format --dataset_version_dir=<tfrecord data_dir>/"
        f"{NAME}/{CONFIG}/{version} --out_file_format=array_record --out_dir={path}`; then set "
        f"data.data_dir to {path.parents[2]}. See docs/C4.md."
    )


def _folder_holding_c4(data_dir: str, version: str) -> Path | None:
    """The folder holding c4/ when ``data_dir`` points inside a prepared c4/en/<version>."""
    given = Path(data_dir).expanduser()
    for inside, depth in (((), 3), ((version,), 2), ((CONFIG, version), 1)):
        if given.joinpath(*inside, "dataset_info.json").is_file() and len(given.parents) >= depth:
            return given.parents[depth - 1]
    return None


def check_c4(data_dir: str, version: str) -> None:
    """DataError unless a prepared c4/en/<version> with array_record shards is where expected."""
    path = c4_dir(data_dir, version)
    info_path = path / "dataset_info.json"
    if not info_path.is_file():
        holder = _folder_holding_c4(data_dir, version)
        if holder is not None:
            raise DataError(
                f"data.source='c4': data.data_dir={data_dir!r} points inside a prepared "
                f"dataset; set data.data_dir to {holder}, the folder holding {NAME}/ "
                f"(the dataset must be at <data.data_dir>/{NAME}/{CONFIG}/{version})."
            )
        raise DataError(
            f"data.source='c4': no prepared {NAME}/{CONFIG}:{version} dataset at {path} "
            f"(looked for {info_path}; data.data_dir={data_dir!r}, "
            f"data.c4_version={version!r}). {how_to_prepare(path, version)}"
        )
    try:
        info = json.loads(info_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"data.source='c4': {info_path} is unreadable ({err}): the prepared "
                        f"dataset is damaged. {how_to_prepare(path, version)}") from err
    if not isinstance(info, dict):
        raise DataError(f"data.source='c4': {info_path} holds no dataset description: the "
                        f"prepared dataset is damaged. {how_to_prepare(path, version)}")
    formats = {info.get("fileFormat", "tfrecord"), *info.get("alternativeFileFormats", [])}
    if "array_record" not in formats:
        raise DataError(
            f"data.source='c4': {path} holds {sorted(formats)} shards, but random access needs "
            f"array_record. {how_to_prepare(path, version)}"
        )
    found = (info.get("name"), info.get("configName"), info.get("version"))
    if found != (NAME, CONFIG, version):
        raise DataError(
            f"data.source='c4': {info_path} describes {found}, not {(NAME, CONFIG, version)}. "
            "Point data.data_dir at the folder holding c4/."
        )


def open_c4(data_dir: str, version: str) -> tuple[tfds.core.DatasetBuilder, str]:
    """The read-only builder of the prepared dataset and the sha256 of its dataset_info.json.

    The builder is restored from the files alone (no dataset code is imported), so neither
    TensorFlow nor the network is needed; its data sources read the array_record shards, also
    when they were added beside tfrecord ones (listed in alternativeFileFormats).
    """
    check_c4(data_dir, version)
    path = c4_dir(data_dir, version)
    fingerprint = hashlib.sha256((path / "dataset_info.json").read_bytes()).hexdigest()
    return tfds.builder_from_directory(path), fingerprint
