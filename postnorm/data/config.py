"""Cheap validation of the data config, run before any compilation or dataset building."""

import os

import ml_collections

from postnorm.data import builders, c4, corpus
from postnorm.data.errors import DataError
from postnorm.data.tokenizers import read_user_sentencepiece

SOURCES = ("embedded", "c4", "text_files")
TOKENIZERS = ("sentencepiece", "byte")
# 256 byte-fallback pieces, unk/bos/eos, newline and the characters of any real text.
MIN_SENTENCEPIECE_VOCAB = 300
MAX_VOCAB = 2**31 - 1  # token ids are int32
FIELDS = (
    "source",
    "data_dir",
    "text_files",
    "c4_version",
    "seq_len",
    "tokenizer",
    "vocab_size",
    "tokenizer_path",
    "lfreq_sample_docs",
)


def _check_writable_dir(field: str, path: str) -> None:
    """DataError unless `path` exists as a writable directory or can be created."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(
            f"{field}={path!r}: {existing} is not a writable directory, so the dataset cannot be "
            f"prepared there. Set {field} to a writable directory."
        )


def _already_prepared(cfg: ml_collections.ConfigDict, data_dir: str) -> bool:
    """Whether ``data_dir`` holds this embedded or text-files dataset, prepared."""
    chosen = builders.choose_corpus(cfg.source, cfg.text_files)
    return (chosen.prepared_dir(data_dir) / "dataset_info.json").is_file()


def _check_int(cfg: ml_collections.ConfigDict, field: str, minimum: int,
               maximum: int | None = None) -> None:
    value = cfg[field]
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise DataError(f"data.{field}={value!r}: must be an integer {allowed}.")


def check_batch_shape(cfg: ml_collections.ConfigDict) -> None:
    """The fields that shape a batch of token ids, for programs fed random tokens (the
    benchmarks): data.seq_len and data.vocab_size."""
    _check_int(cfg, "seq_len", 2)
    _check_int(cfg, "vocab_size", 1, MAX_VOCAB)


def check_data_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises DataError, naming the field or path and the fix, for a config that cannot work."""
    missing = [f for f in FIELDS if f not in cfg]
    if missing:
        raise DataError(f"config.data lacks the fields {missing}; see configs/default.py.")
    if cfg.source not in SOURCES:
        raise DataError(f"data.source={cfg.source!r}: must be one of {SOURCES}.")
    if cfg.tokenizer not in TOKENIZERS:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r}: must be one of {TOKENIZERS}.")
    _check_int(cfg, "seq_len", 2)
    _check_int(cfg, "lfreq_sample_docs", 0)
    if not isinstance(cfg.data_dir, str) or not cfg.data_dir.strip():
        raise DataError(f"data.data_dir={cfg.data_dir!r}: must be a directory path (e.g. "
                        "~/tensorflow_datasets).")
    if "://" in cfg.data_dir:
        raise DataError(f"data.data_dir={cfg.data_dir!r}: must be a local path; mount a bucket "
                        "(e.g. with gcsfuse) and give the mounted directory.")
    data_dir = os.path.expanduser(cfg.data_dir)

    if cfg.source == "c4":
        c4.check_c4(data_dir, cfg.c4_version)
    else:
        try:
            _check_writable_dir("data.data_dir", data_dir)
        except DataError:
            if not _already_prepared(cfg, data_dir):  # a prepared one is only read
                raise
    if cfg.source == "text_files":
        if not cfg.text_files:
            raise DataError("data.source='text_files' needs data.text_files, a glob of files.")
        paths = corpus.text_file_paths(cfg.text_files)
        if len(paths) < 2:
            raise DataError(
                f"data.text_files={cfg.text_files!r} matches {len(paths)} files; it must match "
                "at least two (one document per file, and validation needs one). Fix the glob."
            )

    if cfg.tokenizer == "byte":
        if cfg.tokenizer_path:
            raise DataError(
                f"data.tokenizer_path={cfg.tokenizer_path!r} is set but data.tokenizer='byte' "
                "uses none; clear it or set data.tokenizer='sentencepiece'."
            )
    elif cfg.tokenizer_path:
        read_user_sentencepiece(cfg.tokenizer_path)
    else:
        _check_int(cfg, "vocab_size", MIN_SENTENCEPIECE_VOCAB, MAX_VOCAB)
