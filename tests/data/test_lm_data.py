"""load_data tests: tokenizer training and caching, user and byte tokenizers, L_freq, info."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from postnorm.data import ByteTokenizer, DataError, load_data, spm_training
from postnorm.data.lfreq import frequency_floor, target_token_counts
from tests.data.test_pipeline import make_config, write_corpus
from tests.reliability_helpers import REPO, subprocess_env
from tests.reliability_helpers import write_corpus as write_corpus_files

TEXT = "rank collapse über café 数据\n    indented line\n"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), num_docs=30, seed=1)


def independent_lfreq(texts: list[str], encode, eos_id: int) -> float:
    """Unigram entropy (nats) of the stream of `texts`, each followed by EOS, by np.unique."""
    stream = np.concatenate([np.append(encode(t), eos_id) for t in texts])
    _, counts = np.unique(stream, return_counts=True)
    p = counts / counts.sum()
    return float(-np.sum(p * np.log(p)))


def train_texts(lm, limit: int | None = None) -> list[str]:
    n = len(lm.train_records) if limit is None else limit
    return [lm.train_records[i]["text"].decode() for i in range(n)]


def test_tokenizer_is_trained_once_then_loaded_from_cache(corpus_dir, tmp_path, monkeypatch):
    cfg = make_config(corpus_dir, tmp_path)
    first = load_data(cfg)
    model_path = Path(first.info["tokenizer"]["path"])
    assert model_path.name == "tokenizer_spm_300.model"
    assert model_path.parent == Path(first.info["path"])
    mtime = model_path.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(spm_training, "train_sentencepiece", fail)
    second = load_data(cfg)
    assert model_path.stat().st_mtime_ns == mtime
    assert second.tokenizer.name == first.tokenizer.name
    np.testing.assert_array_equal(second.tokenizer.encode(TEXT), first.tokenizer.encode(TEXT))
    assert second.lfreq == first.lfreq and second.fingerprint == first.fingerprint
    assert not list(Path(first.info["path"]).glob(".*.tmp"))


def test_trained_sentencepiece_properties(corpus_dir, tmp_path):
    lm = load_data(make_config(corpus_dir, tmp_path))
    tok = lm.tokenizer
    sp = spm.SentencePieceProcessor(model_file=lm.info["tokenizer"]["path"])
    assert tok.vocab_size == 300 == sp.get_piece_size()
    assert tok.eos_id == sp.eos_id() == 2
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and tok.eos_id not in ids
    assert tok.decode(ids) == TEXT  # identity normalization and byte fallback: lossless
    np.testing.assert_array_equal(ids, sp.encode(TEXT))


def test_training_is_deterministic(corpus_dir):
    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))]
    sentences = spm_training.training_sentences(texts)
    first = spm_training.train_sentencepiece(sentences, 300)
    assert hashlib.sha256(first).digest() == hashlib.sha256(
        spm_training.train_sentencepiece(sentences, 300)
    ).digest()


def test_user_tokenizer_path_is_used_as_is(corpus_dir, tmp_path):
    trained = load_data(make_config(corpus_dir, tmp_path / "a"))
    user_model = tmp_path / "user.model"
    shutil.copy(trained.info["tokenizer"]["path"], user_model)
    lm = load_data(make_config(corpus_dir, tmp_path / "b", tokenizer_path=str(user_model)))
    assert lm.info["tokenizer"]["path"] == str(user_model)
    assert lm.tokenizer.name == trained.tokenizer.name
    assert not list((tmp_path / "b").glob("**/tokenizer_spm_*.model"))
    assert lm.lfreq == pytest.approx(trained.lfreq, rel=1e-12)


def test_lfreq_matches_independent_unigram_entropy(corpus_dir, tmp_path):
    lm = load_data(make_config(corpus_dir, tmp_path))
    sp = spm.SentencePieceProcessor(model_file=lm.info["tokenizer"]["path"])
    expected = independent_lfreq(train_texts(lm), sp.encode, sp.eos_id())
    assert lm.lfreq == pytest.approx(expected, rel=1e-12)
    cached = json.loads(next(Path(lm.info["path"]).glob("lfreq_*_all.json")).read_text())
    assert cached["lfreq"] == lm.lfreq and cached["fingerprint"] == lm.fingerprint
    assert load_data(make_config(corpus_dir, tmp_path)).unigram_counts.tolist() == \
        cached["counts"]


def test_target_counts_span_every_encoding_chunk():
    """More documents than two encoding chunks (256 each): every document's tokens and its EOS
    are counted, against one bincount of the whole stream."""
    rng = np.random.default_rng(4)
    texts = ["".join(rng.choice(list("abcdefgh é"), size=rng.integers(1, 30)))
             for _ in range(600)]
    tok = ByteTokenizer()
    stream = np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in texts])
    np.testing.assert_array_equal(target_token_counts(texts, tok),
                                  np.bincount(stream, minlength=tok.vocab_size))


def test_frequency_floor_is_the_unigram_cross_entropy_of_the_targets(corpus_dir, tmp_path):
    lm = load_data(make_config(corpus_dir, tmp_path))
    sp = spm.SentencePieceProcessor(model_file=lm.info["tokenizer"]["path"])
    stream = np.concatenate([np.append(sp.encode(t), sp.eos_id()) for t in train_texts(lm)])
    # The floor of the very stream L_freq counts is its entropy; of a part, its cross-entropy.
    assert frequency_floor(stream, lm.unigram_counts) == pytest.approx(lm.lfreq, rel=1e-12)
    values, counts = np.unique(stream, return_counts=True)
    p = dict(zip(values.tolist(), (counts / counts.sum()).tolist(), strict=True))
    part = stream[:500].reshape(5, 100)
    expected = -np.mean([np.log(p[v]) for v in part.ravel().tolist()])
    assert frequency_floor(part, lm.unigram_counts) == pytest.approx(expected, rel=1e-12)
    unseen = np.argmin(lm.unigram_counts)
    assert lm.unigram_counts[unseen] == 0
    assert frequency_floor(np.array([unseen]), lm.unigram_counts) == pytest.approx(
        np.log(2 * counts.sum()), rel=1e-12)  # scored as half a count


def test_a_damaged_lfreq_cache_is_computed_again(corpus_dir, tmp_path):
    """Also one whose fingerprint is another dataset's."""
    cfg = make_config(corpus_dir, tmp_path, tokenizer="byte")
    first = load_data(cfg)
    cache = next(Path(first.info["path"]).glob("lfreq_*_all.json"))
    other_data = json.dumps({"fingerprint": "0" * 64, "lfreq": 3.0, "counts": [1, 2]})
    for text in ('{"lfreq": 3.', '{"lfreq": 3.0}', "[]", other_data):
        cache.write_text(text)
        again = load_data(cfg)
        assert again.lfreq == first.lfreq
        assert json.loads(cache.read_text())["lfreq"] == first.lfreq


@pytest.mark.parametrize("damage", ["metadata.json", "dataset_info.json", "no dataset_info.json",
                                    "empty shard", "missing shard"])
def test_a_damaged_prepared_corpus_names_its_folder_and_is_rebuilt_once_deleted(
        corpus_dir, tmp_path, damage):
    cfg = make_config(corpus_dir, tmp_path, tokenizer="byte")
    first = load_data(cfg)
    folder = Path(first.info["path"])
    shard = next(folder.glob("*-train.array_record-*"))
    if damage == "no dataset_info.json":
        (folder / "dataset_info.json").unlink()
    elif damage == "empty shard":
        shard.write_bytes(b"")
    elif damage == "missing shard":
        shard.unlink()
    else:
        (folder / damage).write_text('{"fingerprint": "')
    expected = (f"{shard} is {damage.split()[0]}, but the train split" if "shard" in damage
                else f"The dataset prepared at {folder} is damaged: its dataset_info.json or "
                     "metadata.json does not parse or lacks a field")
    with pytest.raises(DataError, match=f"{expected}.* Delete {folder} to prepare it again"):
        load_data(cfg)
    shutil.rmtree(folder)
    again = load_data(cfg)
    assert (again.fingerprint, again.lfreq) == (first.fingerprint, first.lfreq)


def test_lfreq_sample_docs_uses_the_first_training_documents(corpus_dir, tmp_path):
    lm = load_data(make_config(corpus_dir, tmp_path, tokenizer="byte", lfreq_sample_docs=5))
    expected = independent_lfreq(train_texts(lm, 5), ByteTokenizer().encode, 256)
    assert lm.lfreq == pytest.approx(expected, rel=1e-12)
    full = load_data(make_config(corpus_dir, tmp_path, tokenizer="byte"))
    assert full.lfreq != lm.lfreq


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert tok.decode(np.append(ids, tok.eos_id)) == TEXT


def test_info_and_fingerprint(corpus_dir, tmp_path):
    lm = load_data(make_config(corpus_dir, tmp_path, tokenizer="byte"))
    info = json.loads(json.dumps(lm.info))
    assert info["source"] == "text_files" and info["builder"] == "postnorm_text_files"
    assert info["num_docs"]["train"] + info["num_docs"]["validation"] == 30
    assert info["num_docs"]["validation"] >= 1
    assert info["corpus_bytes"] == sum(p.stat().st_size for p in corpus_dir.glob("*.txt"))
    assert info["fingerprint"] == lm.fingerprint and len(lm.fingerprint) == 64
    assert info["lfreq"] == lm.lfreq and info["tokenizer"]["vocab_size"] == 257
    # The prepared name depends on the file set: a different glob gets its own dataset.
    other = load_data(
        make_config(corpus_dir, tmp_path, tokenizer="byte", text_files=str(corpus_dir / "doc_00*"))
    )
    assert other.info["path"] != info["path"] and other.fingerprint != lm.fingerprint
    assert other.info["num_docs"]["train"] + other.info["num_docs"]["validation"] == 10
    assert os.path.isdir(info["path"]) and os.path.isdir(other.info["path"])


LOAD = """
import json, sys
from pathlib import Path
from postnorm.data import load_data
from tests.reliability_helpers import tiny_config
data = load_data(tiny_config(Path(sys.argv[1]), Path(sys.argv[2])).data)
print(json.dumps({"fingerprint": data.fingerprint, "lfreq": data.lfreq}))
"""


def test_runs_starting_together_on_a_fresh_data_dir_share_one_build(tmp_path):
    """Three processes prepare the same text-files dataset at once: one builds it while the
    others wait for the data_dir's lock, and all load the same data (without the lock, the
    dataset build's final rename collided: FileExistsError)."""
    corpus = write_corpus_files(tmp_path / "corpus", num_docs=3000)  # a build of a few seconds
    processes = [subprocess.Popen([sys.executable, "-c", LOAD, str(corpus), str(tmp_path / "data")],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=subprocess_env(None))
                 for _ in range(3)]
    outputs = [process.communicate(timeout=300) for process in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-3000:]
    loaded = [json.loads(stdout.splitlines()[-1]) for stdout, _ in outputs]
    assert loaded[0] == loaded[1] == loaded[2]
