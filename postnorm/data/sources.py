"""Preparing (if needed) and opening the configured dataset as TFDS array_record data sources."""

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

import ml_collections
import tensorflow_datasets as tfds
from absl import logging

from postnorm.data import builders, c4, corpus

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


def prepare_source(cfg: ml_collections.ConfigDict) -> PreparedSource:
    """Builds the embedded or text-files dataset on first use, or opens the prepared C4."""
    data_dir = os.path.expanduser(cfg.data_dir)
    if cfg.source == "c4":
        builder, fingerprint = c4.open_c4(data_dir, cfg.c4_version)
    else:
        if cfg.source == "embedded":
            builder = builders.embedded_builder(data_dir)
        else:
            builder = builders.text_files_builder(data_dir, corpus.text_file_paths(cfg.text_files))
        builder.download_and_prepare()
        fingerprint = builder.info.metadata["fingerprint"]
    summary = _summary(builder, cfg.source, fingerprint)
    if cfg.source == "text_files":
        summary["text_files"] = cfg.text_files
    logging.info(
        "Data source %s: %s/%s:%s at %s, docs %s, fingerprint sha256:%s",
        cfg.source, summary["builder"], summary["config"], summary["version"], summary["path"],
        summary["num_docs"], fingerprint,
    )
    splits = {name: builder.as_data_source(name) for name in SPLITS}
    return PreparedSource(builder, fingerprint, summary, splits)
