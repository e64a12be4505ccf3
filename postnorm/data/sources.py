"""Preparing (if needed) and opening the configured dataset as TFDS array_record data sources."""

import concurrent.futures
import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ml_collections
import tensorflow_datasets as tfds
from absl import logging
from array_record.python.array_record_module import ArrayRecordReader
from etils import epath
from google.protobuf import json_format

from postnorm.data import builders, c4
from postnorm.data.errors import DataError

TEXT_FEATURE = "text"
SPLITS = ("train", "validation")
_READ_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class PreparedSource:
    """A prepared dataset: its TFDS builder, content fingerprint, JSON-able summary and the
    random-access records ({'text': bytes, ...}) of its train and validation splits."""

    builder: tfds.core.DatasetBuilder
    fingerprint: str
    info: dict[str, Any]
    splits: dict[str, Sequence[dict[str, Any]]] = dataclasses.field(repr=False)

    @property
    def path(self) -> str:
        """The prepared dataset directory; derived caches are stored here too."""
        return os.fspath(self.builder.data_dir)

    def texts(self, split: str, limit: int = 0) -> Iterator[str]:
        """Texts of the first `limit` documents (0: all) of `split`, in index order."""
        records = self.splits[split]
        stop = min(limit, len(records)) if limit else len(records)
        for start in range(0, stop, _READ_CHUNK):
            for record in records.__getitems__(range(start, min(start + _READ_CHUNK, stop))):
                yield record[TEXT_FEATURE].decode("utf-8")


class CheckedRecords(Sequence):
    """A split's random-access records. A shard that cannot be read, or a record without its
    text (what a truncated shard can give), is a ``DataError`` that names the split's folder
    and ``fix``."""

    def __init__(self, records: Sequence[dict[str, Any]], split: str, path: str, fix: str):
        self._records, self._split, self._path, self._fix = records, split, path, fix

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._checked([index], lambda: [self._records[index]])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return self._checked(indices, lambda: self._records.__getitems__(indices))

    def _checked(self, indices: Sequence[int],
                 read: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        try:
            records = read()
        except RuntimeError as err:  # array_record: a missing, empty or corrupted shard
            raise self._damaged(f"reading it failed ({_first_line(err)})") from err
        for index, record in zip(indices, records, strict=True):
            if not isinstance(record.get(TEXT_FEATURE), bytes):
                raise self._damaged(f"its record {index} has no text")
        return records

    def _damaged(self, what: str) -> DataError:
        return DataError(f"The {self._split} split of the dataset prepared at {self._path} is "
                         f"damaged: {what}. {self._fix}")


def _summary(builder: tfds.core.DatasetBuilder, source: str, fingerprint: str) -> dict:
    info = builder.info
    summary = {
        "source": source,
        "builder": builder.name,
        "config": builder.builder_config.name if builder.builder_config else None,
        "version": str(builder.version),
        "path": os.fspath(builder.data_dir),
        "num_docs": {name: split.num_examples for name, split in info.splits.items()},
        "dataset_bytes": int(info.dataset_size),
        "fingerprint": fingerprint,
    }
    metadata = info.metadata or {}
    summary.update({k: metadata[k] for k in ("corpus_bytes", "distributions") if k in metadata})
    return summary


# What TFDS raises on a prepared folder whose dataset_info.json or metadata.json is damaged
# or incomplete.
_DAMAGED_METADATA = (json.JSONDecodeError, json_format.ParseError, KeyError)


def _prepared_corpus(cfg: ml_collections.ConfigDict,
                     data_dir: str) -> tuple[tfds.core.DatasetBuilder, str, str]:
    """The embedded or text-files dataset, prepared on first use: its builder, fingerprint
    and what to do if its files turn out damaged."""
    chosen = builders.choose_corpus(cfg.source, cfg.text_files)
    path = chosen.prepared_dir(data_dir)
    fix = f"Delete {path} to prepare it again."
    prepared_before = path.exists()
    try:
        builder = chosen.builder(data_dir)
        builder.download_and_prepare()
        return builder, builder.info.metadata["fingerprint"], fix
    except _DAMAGED_METADATA as err:
        if not prepared_before:  # not damage: an error of the preparation itself
            raise
        raise DataError(f"The dataset prepared at {path} is damaged: its dataset_info.json or "
                        f"metadata.json does not parse or lacks a field ({type(err).__name__}: "
                        f"{str(err)[:300]}). {fix}") from err


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:300]


def _shard_problem(path: os.PathLike, expected: int) -> str | None:
    """Why the array_record shard at ``path`` cannot give its ``expected`` records, if so."""
    path = epath.Path(path)
    if not path.exists():
        return "is missing"
    if path.stat().length == 0:
        return "is empty"
    try:
        reader = ArrayRecordReader(os.fspath(path))
        try:
            found = reader.num_records()
        finally:
            reader.close()
    except RuntimeError as err:  # a truncated or corrupted file
        return f"cannot be read ({_first_line(err)})"
    return None if found == expected else f"holds {found} of its {expected} records"


def _check_shard_files(builder: tfds.core.DatasetBuilder, fix: str) -> None:
    """DataError unless every shard file the splits list exists and holds its records (the
    shards' footers are read, a few at a time). Call it after ``as_data_source``, which points
    the dataset info at the array_record files when a dataset also has tfrecord ones."""
    for split in SPLITS:
        info = builder.info.splits[split]
        shards = list(zip(info.filepaths, info.shard_lengths, strict=True))
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            problems = list(pool.map(lambda shard: _shard_problem(*shard), shards))
        for (path, _), problem in zip(shards, problems, strict=True):
            if problem is not None:
                raise DataError(f"{path} {problem}, but the {split} split of the dataset "
                                f"prepared at {builder.data_dir} lists it. {fix}")


def prepare_source(cfg: ml_collections.ConfigDict) -> PreparedSource:
    """Builds the embedded or text-files dataset on first use, or opens the prepared C4;
    checks that every shard file is there."""
    data_dir = os.path.expanduser(cfg.data_dir)
    if cfg.source == "c4":
        builder, fingerprint = c4.open_c4(data_dir, cfg.c4_version)
        fix = c4.how_to_prepare(c4.c4_dir(data_dir, cfg.c4_version), cfg.c4_version)
    else:
        builder, fingerprint, fix = _prepared_corpus(cfg, data_dir)
    summary = _summary(builder, cfg.source, fingerprint)
    if cfg.source == "text_files":
        summary["text_files"] = cfg.text_files
    logging.info(
        "Data source %s: %s/%s:%s at %s, docs %s, fingerprint sha256:%s",
        cfg.source, summary["builder"], summary["config"], summary["version"], summary["path"],
        summary["num_docs"], fingerprint,
    )
    splits = {name: builder.as_data_source(name) for name in SPLITS}
    _check_shard_files(builder, fix)
    checked = {name: CheckedRecords(records, name, summary["path"], fix)
               for name, records in splits.items()}
    return PreparedSource(builder, fingerprint, summary, checked)
