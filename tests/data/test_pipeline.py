"""grain pipeline tests on a small text_files corpus: packing, order, sharding, resumption."""

import json
import random
from pathlib import Path

import grain
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sentencepiece as spm

from postnorm.data import LMData, load_data
from postnorm.data.errors import ShortSplitError
from postnorm.data.tokenizers import ByteTokenizer

SEQ_LEN = 16
WORDS = [
    "the", "a", "rank", "collapse", "of", "deep", "post", "norm", "transformers", "layer",
    "token", "model", "gradient", "signal", "attention", "residual", "stream", "entropy",
    "loss", "training", "step", "batch", "naïve", "Größe", "数据", "über", "café",
]  # fmt: skip


def write_corpus(directory: Path, num_docs: int = 40, seed: int = 0) -> Path:
    """`num_docs` distinct multi-line text files of 20-300 words; returns the directory."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(num_docs):
        num_lines = rng.randint(2, 25)
        lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(num_lines)]
        (directory / f"doc_{i:03d}.txt").write_text(f"document {i}\n" + "\n".join(lines) + "\n")
    return directory


def make_config(corpus_dir: Path, data_dir: Path, **overrides) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(
        dict(
            source="text_files",
            data_dir=str(data_dir),
            text_files=str(corpus_dir / "*.txt"),
            c4_version="3.0.1",
            seq_len=SEQ_LEN,
            tokenizer="sentencepiece",
            vocab_size=300,
            tokenizer_path="",
            lfreq_sample_docs=0,
        )
    )
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def lm(corpus_dir, tmp_path_factory) -> LMData:
    return load_data(make_config(corpus_dir, tmp_path_factory.mktemp("tfds")))


@pytest.fixture(scope="module")
def reference_sp(lm) -> spm.SentencePieceProcessor:
    """The cached model, loaded directly by SentencePiece (independent of postnorm)."""
    return spm.SentencePieceProcessor(model_file=lm.info["tokenizer"]["path"])


def window_stream(batches: list[dict]) -> np.ndarray:
    """The token stream covered by consecutive batches (window = inputs + last target)."""
    rows = [
        np.concatenate([inputs, targets[-1:]])
        for b in batches
        for inputs, targets in zip(b["inputs"], b["targets"], strict=True)
    ]
    return np.concatenate(rows)


def take(iterator, n: int) -> list[dict]:
    return [next(iterator) for _ in range(n)]


def assert_batches_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])


def record_keys(records) -> list[str]:
    return [records[i]["key"].decode() for i in range(len(records))]


def train_keys(lm: LMData) -> list[str]:
    return record_keys(lm.train_records)


def reference_stream(sp, corpus_dir: Path, keys: list[str], eos_id: int) -> np.ndarray:
    """The files `keys` tokenized directly by SentencePiece, each followed by EOS."""
    docs = [np.append(sp.encode((corpus_dir / k).read_text()), eos_id) for k in keys]
    return np.concatenate(docs)


def test_batches_are_shifted_full_windows(lm):
    batches = take(lm.train_iterator(batch_size=8, seed=0), 5)
    for b in batches:
        assert set(b) == {"inputs", "targets"}
        assert b["inputs"].shape == b["targets"].shape == (8, SEQ_LEN)
        assert b["inputs"].dtype == b["targets"].dtype == np.int32
        np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
        assert b["inputs"].max() < lm.tokenizer.vocab_size


def test_stream_is_shuffled_documents_each_followed_by_eos(lm, corpus_dir, reference_sp):
    seed = 3
    stream = window_stream(take(lm.train_iterator(batch_size=8, seed=seed), 200))
    n = len(lm.train_records)
    order = list(grain.MapDataset.range(n).shuffle(seed=seed).repeat()[: 2 * n])
    assert sorted(order[:n]) == list(range(n)) and order[:n] != list(range(n))
    assert order[:n] != order[n:]  # reshuffled in the second epoch
    keys = [train_keys(lm)[i] for i in order]
    expected = reference_stream(reference_sp, corpus_dir, keys, lm.tokenizer.eos_id)
    assert len(stream) < len(expected)  # 200 batches lie within two epochs
    np.testing.assert_array_equal(stream, expected[: len(stream)])


def test_same_seed_same_batches_other_seed_other_batches(lm):
    a = take(lm.train_iterator(batch_size=4, seed=7), 6)
    assert_batches_equal(a, take(lm.train_iterator(batch_size=4, seed=7), 6))
    b = take(lm.train_iterator(batch_size=4, seed=8), 6)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b, strict=True))


def epoch_documents(lm, reference_sp, corpus_dir, process_index: int) -> list[list[str]]:
    """The document keys of the first two epochs seen by one of two processes."""
    by_tokens = {
        tuple(reference_sp.encode((corpus_dir / key).read_text())): key for key in train_keys(lm)
    }
    shard_size = len(range(process_index, len(lm.train_records), 2))
    it = lm.train_iterator(batch_size=4, seed=1, process_index=process_index, process_count=2)
    stream = np.zeros((0,), np.int32)
    while np.count_nonzero(stream == lm.tokenizer.eos_id) < 2 * shard_size:
        stream = np.concatenate([stream, window_stream([next(it)])])
    docs = np.split(stream, np.flatnonzero(stream == lm.tokenizer.eos_id) + 1)[: 2 * shard_size]
    keys = [by_tokens[tuple(doc[:-1].tolist())] for doc in docs]
    return [keys[:shard_size], keys[shard_size:]]


def test_two_processes_get_disjoint_shards_covering_all_documents(lm, reference_sp, corpus_dir):
    epochs = [epoch_documents(lm, reference_sp, corpus_dir, i) for i in (0, 1)]
    for first, second in epochs:
        assert len(set(first)) == len(first) and set(first) == set(second)
        assert first != second  # each epoch in a new order
    shard0, shard1 = set(epochs[0][0]), set(epochs[1][0])
    assert not shard0 & shard1
    assert shard0 | shard1 == set(train_keys(lm))


@pytest.mark.parametrize("k", [0, 1, 7])
def test_restored_iterator_continues_identically(lm, k):
    """A restored iterator continues as the original would; so does one restored from a
    position saved right after a restore, before the packer fetched a new document (a second
    preemption soon after a resume)."""
    it = lm.train_iterator(batch_size=4, seed=5)
    take(it, k)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 5)
    resumed = lm.train_iterator(batch_size=4, seed=5)
    resumed.set_state(state)
    again = json.loads(json.dumps(resumed.get_state()))
    assert_batches_equal(take(resumed, 5), expected)
    twice = lm.train_iterator(batch_size=4, seed=5)
    twice.set_state(again)
    assert_batches_equal(take(twice, 5), expected)


@pytest.mark.parametrize("state", [{}, {"offset": 3}, []])
def test_a_saved_position_without_its_fields_is_refused_by_name(lm, state):
    """A damaged data position names what it lacks and where it came from (the trainer's
    log line for the unusable checkpoint step), not a bare KeyError."""
    it = lm.train_iterator(batch_size=4, seed=5)
    with pytest.raises(ValueError, match=r"the saved data position has no .*sequence_parent_"
                                         r"state: its file \(data/process_"):
        it.set_state(state)


def test_orbax_checkpoint_round_trip_of_iterator(lm, tmp_path):
    it = lm.train_iterator(batch_size=4, seed=2)
    take(it, 3)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
        expected = take(it, 4)
        take(it, 2)  # moves on past the checkpoint; restoring must rewind
        resumed = lm.train_iterator(batch_size=4, seed=2)
        restore = grain.checkpoint.CheckpointRestore(resumed)
        manager.restore(3, args=ocp.args.Composite(data=restore))
    assert_batches_equal(take(resumed, 4), expected)


def test_eval_batches_are_deterministic_validation_windows(lm, corpus_dir, reference_sp):
    a = lm.eval_batches(batch_size=2, num_batches=3)
    assert_batches_equal(a, lm.eval_batches(batch_size=2, num_batches=3))
    keys = record_keys(lm.validation_records)
    expected = reference_stream(reference_sp, corpus_dir, keys, lm.tokenizer.eos_id)
    stream = window_stream(a)
    np.testing.assert_array_equal(stream, expected[: len(stream)])
    assert not set(keys) & set(train_keys(lm))


DOCS = ["ab", "cde", "fghij", "k", "lmnopq", "rs", "tuvwxyz", "é数", "0123456789", "!?"]
EOS = 256


def byte_stream(docs: list[str]) -> np.ndarray:
    return np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8), EOS) for d in docs])


def packed_batches(stream: np.ndarray, seq_len: int, batch_size: int) -> list[dict]:
    """Non-overlapping windows of seq_len + 1 tokens, shifted, in full batches."""
    n_windows = len(stream) // (seq_len + 1)
    windows = stream[: n_windows * (seq_len + 1)].reshape(n_windows, seq_len + 1)
    n_batches = n_windows // batch_size
    return [{"inputs": windows[i * batch_size:(i + 1) * batch_size, :-1],
             "targets": windows[i * batch_size:(i + 1) * batch_size, 1:]}
            for i in range(n_batches)]


def memory_lm(validation: list[str], seq_len: int) -> LMData:
    records = [{"text": d.encode()} for d in validation]
    return LMData(tokenizer=ByteTokenizer(), lfreq=0.0, unigram_counts=np.zeros(257),
                  fingerprint="", info={"path": "memory"}, seq_len=seq_len, seed=0,
                  train_records=records, validation_records=records)


def test_byte_stream_reference_is_what_it_claims():
    np.testing.assert_array_equal(byte_stream(["ab", "cde"]), [97, 98, 256, 99, 100, 101, 256])


@pytest.mark.parametrize("process_index", [0, 1])
def test_each_process_evaluates_its_own_validation_documents(process_index):
    """Validation documents i, i + 2, ... on process i of 2: no process re-evaluates another's."""
    data = memory_lm(DOCS, seq_len=3)
    expected = packed_batches(byte_stream(DOCS[process_index::2]), 3, 2)
    got = data.eval_batches(batch_size=2, num_batches=len(expected),
                            process_index=process_index, process_count=2)
    assert_batches_equal(got, expected)


def test_eval_batch_count_boundary():
    """Exactly the full batches are available; one more is refused (no partial batch)."""
    data = memory_lm(DOCS, seq_len=3)
    stream = byte_stream(DOCS)
    n_windows = len(stream) // 4
    assert n_windows % 2 == 1  # a partial last batch exists and must not be used
    expected = packed_batches(stream, 3, 2)
    assert_batches_equal(data.eval_batches(batch_size=2, num_batches=len(expected)), expected)
    with pytest.raises(ShortSplitError):
        data.eval_batches(batch_size=2, num_batches=len(expected) + 1)
