"""C4 loading on a tiny dataset written here in the on-disk layout of TFDS c4/en:3.0.1."""

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from postnorm import files
from postnorm.data import DataError, check_data_config, load_data
from tests.data.test_pipeline import WORDS, make_config, window_stream

NUM_TRAIN, NUM_VALIDATION = 60, 10


class C4(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Same name, config, version and features as TFDS c4/en:3.0.1; generated text."""

    name = "c4"
    VERSION = tfds.core.Version("3.0.1")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="en")]
    code_path = None  # nothing to download, so no checksums directory

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({"text": text, "timestamp": text, "url": text}),
        )

    def _split_generators(self, dl_manager):
        return {
            "train": self._generate_examples(0, NUM_TRAIN),
            "validation": self._generate_examples(NUM_TRAIN, NUM_TRAIN + NUM_VALIDATION),
        }

    def _generate_examples(self, start: int, stop: int):
        for i in range(start, stop):
            rng = random.Random(i)
            sentences = [" ".join(rng.choices(WORDS, k=rng.randint(4, 15))) + "." for _ in range(8)]
            yield i, {
                "text": f"Page {i}. " + " ".join(sentences),
                "timestamp": "2019-04-20T00:00:00Z",
                "url": f"https://example.com/{i}",
            }


@pytest.fixture(scope="module")
def c4_data_dir(tmp_path_factory) -> Path:
    data_dir = tmp_path_factory.mktemp("tfds")
    C4(data_dir=str(data_dir), config="en", file_format="array_record").download_and_prepare()
    return data_dir


def c4_config(data_dir: Path, **overrides):
    return make_config(Path("/unused"), data_dir, source="c4", text_files="", **overrides)


def texts(records) -> list[str]:
    return [records[i]["text"].decode() for i in range(len(records))]


@pytest.mark.parametrize("tokenizer", ["byte", "sentencepiece"])
def test_loads_prepared_c4(c4_data_dir, tokenizer):
    lm = load_data(c4_config(c4_data_dir, tokenizer=tokenizer, lfreq_sample_docs=10))
    version_dir = c4_data_dir / "c4" / "en" / "3.0.1"
    assert lm.info["path"] == str(version_dir)
    assert (lm.info["builder"], lm.info["config"], lm.info["version"]) == ("c4", "en", "3.0.1")
    assert lm.info["num_docs"] == {"train": NUM_TRAIN, "validation": NUM_VALIDATION}
    info_bytes = (version_dir / "dataset_info.json").read_bytes()
    assert lm.fingerprint == hashlib.sha256(info_bytes).hexdigest()

    tok = lm.tokenizer
    first_docs = texts(lm.train_records)[:10]
    stream = np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in first_docs])
    _, counts = np.unique(stream, return_counts=True)
    p = counts / counts.sum()
    assert lm.lfreq == pytest.approx(-np.sum(p * np.log(p)), rel=1e-12)

    batch = next(lm.train_iterator(batch_size=4, seed=0))
    assert batch["inputs"].shape == (4, 16)
    validation = texts(lm.validation_records)
    expected = np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in validation])
    stream = window_stream(lm.eval_batches(batch_size=4, num_batches=2))
    np.testing.assert_array_equal(stream, expected[: len(stream)])


def test_missing_c4_names_the_path(tmp_path):
    with pytest.raises(DataError, match="docs/C4.md") as e:
        check_data_config(c4_config(tmp_path))
    assert str(tmp_path / "c4" / "en" / "3.0.1") in str(e.value)
    with pytest.raises(DataError, match=r"3\.0\.2"):
        check_data_config(c4_config(tmp_path, c4_version="3.0.2"))


def test_tfrecord_only_c4_asks_for_conversion(c4_data_dir, tmp_path):
    version_dir = tmp_path / "c4" / "en" / "3.0.1"
    version_dir.mkdir(parents=True)
    info = json.loads((c4_data_dir / "c4" / "en" / "3.0.1" / "dataset_info.json").read_text())
    info["fileFormat"] = "tfrecord"
    (version_dir / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match="convert_format"):
        check_data_config(c4_config(tmp_path))


def test_array_record_alternative_format_is_accepted(c4_data_dir, tmp_path):
    """A dataset converted in place lists array_record among alternativeFileFormats."""
    version_dir = tmp_path / "c4" / "en" / "3.0.1"
    shutil.copytree(c4_data_dir / "c4" / "en" / "3.0.1", version_dir)
    info = json.loads((version_dir / "dataset_info.json").read_text())
    info["fileFormat"], info["alternativeFileFormats"] = "tfrecord", ["array_record"]
    (version_dir / "dataset_info.json").write_text(json.dumps(info))
    lm = load_data(c4_config(tmp_path, tokenizer="byte", lfreq_sample_docs=5))
    assert len(lm.train_records) == NUM_TRAIN


@pytest.mark.parametrize("inside", ["c4/en/3.0.1", "c4/en", "c4"])
def test_a_data_dir_inside_c4_names_the_folder_holding_it(c4_data_dir, inside):
    with pytest.raises(DataError, match=f"points inside a prepared dataset; set data.data_dir "
                                        f"to {c4_data_dir}, the folder holding c4/"):
        check_data_config(c4_config(c4_data_dir / inside))


def damaged_copy(c4_data_dir: Path, tmp_path: Path, damage) -> Path:
    version_dir = tmp_path / "c4" / "en" / "3.0.1"
    shutil.copytree(c4_data_dir / "c4" / "en" / "3.0.1", version_dir)
    damage(version_dir)
    return version_dir


def test_damaged_c4_files_are_named(c4_data_dir, tmp_path):
    version_dir = damaged_copy(c4_data_dir, tmp_path / "info",
                               lambda v: (v / "dataset_info.json").write_text('{"name": "c'))
    with pytest.raises(DataError, match=f"{version_dir}/dataset_info.json is unreadable .*"
                                        "damaged.*convert_format"):
        check_data_config(c4_config(tmp_path / "info"))

    def shard(v: Path) -> Path:
        return next(v.glob("c4-train.array_record-*"))

    for name, damage, message in [
        ("missing", lambda v: shard(v).unlink(), "is missing, but the train split"),
        ("empty", lambda v: shard(v).write_bytes(b""), "is empty, but the train split"),
    ]:
        version_dir = damaged_copy(c4_data_dir, tmp_path / name, damage)
        with pytest.raises(DataError, match=f"{shard(c4_data_dir / 'c4/en/3.0.1').name} "
                                            f"{message} .* at {version_dir}"):
            load_data(c4_config(tmp_path / name, tokenizer="byte", lfreq_sample_docs=5))


@pytest.mark.parametrize("kept", [0.5, 0.9])
def test_a_truncated_shard_is_found_when_the_data_is_loaded(c4_data_dir, tmp_path, kept):
    def truncate(v: Path) -> None:
        path = next(v.glob("c4-train.array_record-*"))
        path.write_bytes(path.read_bytes()[: int(path.stat().st_size * kept)])

    version_dir = damaged_copy(c4_data_dir, tmp_path, truncate)
    with pytest.raises(DataError, match=f"{version_dir}/c4-train.array_record-.* cannot be read "
                                        ".*, but the train split .* lists it.*convert_format"):
        load_data(c4_config(tmp_path, tokenizer="byte", lfreq_sample_docs=5))


def test_a_shard_corrupted_inside_is_a_data_error_when_read(c4_data_dir, tmp_path):
    def flip(v: Path) -> None:  # the footer stays intact: the shard opens, a record does not
        path = next(v.glob("c4-train.array_record-*"))
        data = bytearray(path.read_bytes())
        data[2000:2064] = bytes(b ^ 0xFF for b in data[2000:2064])
        path.write_bytes(bytes(data))

    version_dir = damaged_copy(c4_data_dir, tmp_path, flip)
    with pytest.raises(DataError, match=f"The train split of the dataset prepared at "
                                        f"{version_dir} is damaged: reading it failed "
                                        r"\(Corrupted .*convert_format"):
        lm = load_data(c4_config(tmp_path, tokenizer="byte", lfreq_sample_docs=5))
        batches = lm.train_iterator(batch_size=4, seed=0)
        for _ in range(2 * NUM_TRAIN):
            next(batches)


def test_a_read_only_c4_folder_loses_only_the_caches(c4_data_dir, tmp_path, monkeypatch):
    """C4 often lies on read-only storage: L_freq is then computed without its cache, and a
    tokenizer that would have to be trained and stored there is asked for instead."""
    def without_caches(v: Path) -> None:  # those other tests wrote into the shared dataset
        for cache in [*v.glob("lfreq_*.json"), *v.glob("tokenizer_spm_*.model")]:
            cache.unlink()

    version_dir = damaged_copy(c4_data_dir, tmp_path, without_caches)

    def read_only(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(files, "replace_file", read_only)
    lm = load_data(c4_config(tmp_path, tokenizer="byte", lfreq_sample_docs=5))
    assert lm.lfreq == load_data(c4_config(c4_data_dir, tokenizer="byte",
                                           lfreq_sample_docs=5)).lfreq
    assert not list(version_dir.glob("lfreq_*.json"))
    with pytest.raises(DataError, match=f"the trained tokenizer cannot be stored at "
                                        f"{version_dir}/tokenizer_spm_.*data.tokenizer_path"):
        load_data(c4_config(tmp_path, lfreq_sample_docs=5))
