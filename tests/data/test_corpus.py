"""The embedded corpus: pins, split rule, and (slow) full builds and the default config."""

import math

import numpy as np
import pytest

from postnorm.data import builders, corpus, load_data
from tests.data.test_pipeline import make_config


def test_every_embedded_distribution_is_pinned_and_installed_as_pinned():
    pins = corpus.requirement_pins()
    for name, version in corpus.embedded_versions().items():
        assert corpus.normalize_name(name) in pins
        assert version["installed"] == version["pinned"] == pins[corpus.normalize_name(name)]


def test_split_is_by_key_and_never_leaves_a_split_empty():
    docs = [corpus.Document(f"doc{i}", "text") for i in range(500)]
    splits = corpus.split_documents(docs)
    assert 0 < len(splits["validation"]) < 0.05 * len(docs)
    assert len(splits["train"]) + len(splits["validation"]) == len(docs)
    renamed = corpus.split_documents([corpus.Document(d.key, "other text") for d in docs])
    assert [d.key for d in renamed["validation"]] == [d.key for d in splits["validation"]]
    pair = corpus.split_documents(docs[:2])
    assert (len(pair["train"]), len(pair["validation"])) == (1, 1)
    low = [d for d in docs if corpus._split_hash(d.key) < corpus.VALIDATION_FRACTION][:2]
    both_low = corpus.split_documents(low)  # both keys hash into validation
    assert (len(both_low["train"]), len(both_low["validation"])) == (1, 1)


@pytest.mark.slow
def test_embedded_corpus_is_large_and_identical_across_builds(tmp_path):
    infos, validation_keys = [], []
    for name in ("a", "b"):
        builder = builders.choose_corpus("embedded", "").builder(str(tmp_path / name))
        builder.download_and_prepare()
        infos.append(builder.info)
        records = builder.as_data_source("validation")
        validation_keys.append(sorted(records[i]["key"] for i in range(len(records))))
    first, second = infos
    assert first.metadata["fingerprint"] == second.metadata["fingerprint"]
    assert 8_000_000 <= first.metadata["corpus_bytes"] <= 24_000_000
    assert first.metadata["num_documents"] == second.metadata["num_documents"]
    assert validation_keys[0] == validation_keys[1]
    num_train = first.splits["train"].num_examples
    assert 0.01 < len(validation_keys[0]) / (num_train + len(validation_keys[0])) < 0.04
    docs = corpus.embedded_documents()
    assert first.metadata["fingerprint"] == corpus.corpus_fingerprint(docs)


@pytest.mark.slow
def test_default_embedded_config_loads(tmp_path):
    cfg = make_config(tmp_path, tmp_path / "tfds", source="embedded", text_files="", seq_len=128)
    cfg.vocab_size = 8192
    lm = load_data(cfg)
    assert lm.tokenizer.vocab_size == 8192 and lm.tokenizer.eos_id == 2
    assert lm.info["corpus_bytes"] >= 8_000_000
    assert 3.0 < lm.lfreq < math.log(8192)
    batch = next(lm.train_iterator(batch_size=8, seed=0))
    assert batch["inputs"].shape == (8, 128)
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert len(lm.eval_batches(batch_size=8, num_batches=4)) == 4


def test_a_text_files_corpus_is_prepared_under_its_own_names_without_a_tfds_warning(
        tmp_path, caplog):
    """The builder lists its config, so tfds loads it as a known one (no "custom data
    configuration" warning) into the directory ``prepared_dir`` names."""
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 50)
    chosen = builders.choose_corpus("text_files", str(tmp_path / "*.txt"))
    with caplog.at_level("WARNING"):
        builder = chosen.builder(str(tmp_path / "tfds"))
        builder.download_and_prepare()
    assert not [r for r in caplog.records if "custom data configuration" in r.getMessage()]
    assert builder.name == builders.TextFilesCorpus.name
    assert builder.builder_config is chosen.config
    assert str(chosen.prepared_dir(str(tmp_path / "tfds"))) == str(builder.data_dir)
    assert (chosen.prepared_dir(str(tmp_path / "tfds")) / "dataset_info.json").exists()
