"""A workdir's run continues, and is evaluated, only on the data it was trained on."""

import json

import pytest

from postnorm.train.experiment import restore_run
from postnorm.train.loop import evaluate_checkpoint, train_and_evaluate
from postnorm.workdir import data_record as run_data
from postnorm.workdir.data_record import WorkdirDataError
from tests.reliability_helpers import read_records, tiny_config, write_corpus
from tests.workdir.test_config_record import listing

INFO = {"path": "/data/a", "fingerprint": "f" * 64,
        "tokenizer": {"name": "spm_0123", "path": "/data/a/tok.model", "vocab_size": 64}}


def recorded(tmp_path, info: dict = INFO):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "data_info.json").write_text(json.dumps(info))
    return str(workdir)


def test_the_same_data_elsewhere_passes_and_other_data_is_refused(tmp_path):
    workdir = recorded(tmp_path)
    moved = {**INFO, "path": "/data/b", "lfreq": 3.0,
             "tokenizer": {**INFO["tokenizer"], "path": "/data/b/tok.model"}}
    run_data.check_run_data(workdir, moved, "/data", "resume")
    other_text = {**moved, "fingerprint": "e" * 64}
    with pytest.raises(WorkdirDataError, match=rf"cannot resume {workdir} on this data: .* "
                       r"\(at /data/a\), and data.data_dir=/data now gives other data at "
                       rf"/data/b \(fingerprint f{{64}} -> e{{64}}\)\. .*new --workdir"):
        run_data.check_run_data(workdir, other_text, "/data", "resume")
    other_tokenizer = {**moved, "tokenizer": {**moved["tokenizer"], "name": "spm_4567"}}
    with pytest.raises(WorkdirDataError, match=r"cannot evaluate .*tokenizer spm_0123 -> "
                                               r"spm_4567\)"):
        run_data.check_run_data(workdir, other_tokenizer, "/data", "evaluate")


def test_a_missing_record_passes():
    run_data.check_run_data("/nonexistent/run", INFO, "/data", "resume")


def measure_restore(config, workdir):
    """The restore the Theorem 3.8 measurement starts from."""
    return restore_run(config, workdir, "measure", data_position=True)


@pytest.mark.parametrize("text", ['{"fingerprint": "f', "[1]"])
def test_a_damaged_record_is_named(tmp_path, text):
    workdir = recorded(tmp_path)
    path = f"{workdir}/data_info.json"
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(WorkdirDataError, match=f"{path} .*restore it, or delete it"):
        run_data.check_run_data(workdir, INFO, "/data", "resume")


@pytest.mark.slow
def test_resume_and_eval_refuse_a_corpus_changed_after_training(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    config = tiny_config(corpus, tmp_path / "tfds", train__steps=4, train__ckpt_every=4,
                         train__eval_every=4)
    workdir = str(tmp_path / "run")
    train_and_evaluate(config, workdir)
    first_doc = corpus / "doc000.txt"
    original = first_doc.read_text()
    first_doc.write_text(original + "\nan edited line.")
    before = listing(tmp_path / "run")
    for entry, action in ((train_and_evaluate, "resume"), (evaluate_checkpoint, "evaluate"),
                          (measure_restore, "measure")):
        with pytest.raises(WorkdirDataError, match=f"cannot {action} {workdir} on this data: "
                                                   ".*fingerprint"):
            entry(config, workdir)
    after = listing(tmp_path / "run")
    assert after.pop(".train.lock") and before.pop(".train.lock")  # the lock records its holder
    assert after == before
    first_doc.write_text(original)  # the same text again (a new mtime): the same data
    logged = [r["eval/loss"] for r in read_records(tmp_path / "run") if "eval/loss" in r]
    assert evaluate_checkpoint(config, workdir) == pytest.approx(logged[-1], rel=1e-6)
