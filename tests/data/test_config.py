"""check_data_config: each bad setting raises a DataError naming the field or path."""

import os
import re
from pathlib import Path

import pytest

from postnorm.data import DataError, check_data_config, load_data
from postnorm.data import config as data_config
from tests.data.test_pipeline import make_config, write_corpus


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), num_docs=3)


def test_valid_configs_pass(corpus_dir, tmp_path):
    check_data_config(make_config(corpus_dir, tmp_path))
    check_data_config(make_config(corpus_dir, tmp_path, tokenizer="byte", vocab_size=0))
    check_data_config(make_config(corpus_dir, tmp_path, source="embedded", text_files=""))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"source": "wiki"}, "data.source='wiki'.*'embedded', 'c4', 'text_files'"),
        ({"tokenizer": "bpe"}, "data.tokenizer='bpe'.*'sentencepiece', 'byte'"),
        ({"seq_len": 1}, "data.seq_len=1"),
        ({"vocab_size": 100}, "data.vocab_size=100.*in \\[300, 2147483647\\]"),
        ({"vocab_size": 10**12}, "data.vocab_size=1000000000000.*in \\[300, 2147483647\\]"),
        ({"lfreq_sample_docs": -1}, "data.lfreq_sample_docs=-1"),
        ({"tokenizer": "byte", "tokenizer_path": "/x.model"}, "data.tokenizer_path='/x.model'"),
        ({"text_files": ""}, "needs data.text_files"),
    ],
)
def test_bad_fields_are_named(corpus_dir, tmp_path, overrides, expected):
    with pytest.raises(DataError, match=expected):
        check_data_config(make_config(corpus_dir, tmp_path, **overrides))


def test_missing_field_is_named(corpus_dir, tmp_path):
    cfg = make_config(corpus_dir, tmp_path)
    del cfg["seq_len"]
    with pytest.raises(DataError, match="seq_len"):
        check_data_config(cfg)


def test_glob_matching_nothing(corpus_dir, tmp_path):
    glob = str(tmp_path / "nowhere" / "*.txt")
    with pytest.raises(DataError, match="matches 0 files") as e:
        load_data(make_config(corpus_dir, tmp_path, text_files=glob))
    assert glob in str(e.value)


def test_a_binary_file_in_the_glob_names_it_and_the_byte(corpus_dir, tmp_path):
    """A file that is not UTF-8 (here gzip data among the text) is refused, not decoded with
    replacement characters and trained on."""
    files = tmp_path / "mixed"
    files.mkdir()
    for doc in sorted(corpus_dir.glob("*.txt")):
        (files / doc.name).write_bytes(doc.read_bytes())
    (files / "doc_999.txt").write_bytes(b"text, then \x1f\x8b\x08 gzip bytes")
    with pytest.raises(DataError, match=r"doc_999.txt \(matched by data.text_files\) is not "
                       r"UTF-8 text: byte 12 \(0x8b\) cannot be decoded. Narrow the"):
        load_data(make_config(corpus_dir, tmp_path, text_files=str(files / "*.txt")))


def test_glob_matching_one_file(corpus_dir, tmp_path):
    cfg = make_config(corpus_dir, tmp_path, text_files=str(corpus_dir / "doc_000.txt"))
    with pytest.raises(DataError, match="matches 1 files"):
        check_data_config(cfg)


def test_missing_tokenizer_file(corpus_dir, tmp_path):
    path = tmp_path / "missing.model"
    with pytest.raises(DataError, match="data.tokenizer_path") as e:
        load_data(make_config(corpus_dir, tmp_path, tokenizer_path=str(path)))
    assert str(path) in str(e.value)
    assert not (tmp_path / "postnorm_text_files").exists()  # failed before building anything


@pytest.mark.parametrize("content", [b"", b"not a sentencepiece model"])
def test_invalid_tokenizer_file(corpus_dir, tmp_path, content):
    path = tmp_path / "bad.model"
    path.write_bytes(content)
    with pytest.raises(DataError, match="not a valid SentencePiece model") as e:
        check_data_config(make_config(corpus_dir, tmp_path, tokenizer_path=str(path)))
    assert str(path) in str(e.value)


def test_tokenizer_path_that_is_a_directory(corpus_dir, tmp_path):
    with pytest.raises(DataError, match="cannot read") as e:
        check_data_config(make_config(corpus_dir, tmp_path, tokenizer_path=str(tmp_path)))
    assert str(tmp_path) in str(e.value)


def test_data_dir_that_is_a_file(corpus_dir, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(DataError, match="data.data_dir"):
        check_data_config(make_config(corpus_dir, not_a_dir / "tfds"))


@pytest.mark.parametrize("source", ["text_files", "c4"])
@pytest.mark.parametrize("data_dir,message", [
    ("", "data.data_dir='': must be a directory path"),
    ("  ", "data.data_dir='  ': must be a directory path"),
    ("gs://bucket/tfds", "data.data_dir='gs://bucket/tfds': must be a local path; mount a bucket"),
])
def test_data_dir_that_is_empty_or_a_url(corpus_dir, source, data_dir, message):
    with pytest.raises(DataError, match=re.escape(message)):
        check_data_config(make_config(corpus_dir, data_dir, source=source))


def test_cached_tokenizer_that_is_corrupt(corpus_dir, tmp_path):
    cfg = make_config(corpus_dir, tmp_path)
    model_path = Path(load_data(cfg).info["tokenizer"]["path"])
    model_path.write_bytes(b"truncated")
    with pytest.raises(DataError, match="Delete") as e:
        load_data(cfg)
    assert str(model_path) in str(e.value)


def test_empty_text_files_name_the_field(corpus_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("a.txt", "b.txt"):
        (empty / name).write_text("")
    with pytest.raises(DataError, match=r"got no text.*data.text_files: files that are not empty"):
        load_data(make_config(corpus_dir, tmp_path, text_files=str(empty / "*.txt")))


def test_a_read_only_data_dir_is_refused_unless_prepared(corpus_dir, tmp_path, monkeypatch):
    cfg = make_config(corpus_dir, tmp_path / "tfds", tokenizer="byte")
    read_only = lambda path, mode: not mode & os.W_OK  # as root, chmod would be moot
    monkeypatch.setattr(data_config.os, "access", read_only)
    with pytest.raises(DataError, match="is not a writable directory"):
        check_data_config(cfg)
    monkeypatch.undo()
    prepared = load_data(cfg)
    monkeypatch.setattr(data_config.os, "access", read_only)
    check_data_config(cfg)  # a prepared dataset is only read
    assert load_data(cfg).fingerprint == prepared.fingerprint
