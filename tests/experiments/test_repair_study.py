"""The repair study (experiments.repair_study) on two real tiny Post-Norm runs, repair off and
on: its per-layer update norms, true-gradient fall and repair cosines against a numpy reading
of the raw metrics.jsonl records."""

import json
import subprocess
import sys

import numpy as np
import pytest

from postnorm.train.loop import train_and_evaluate
from tests.reliability_helpers import REPO, read_records, tiny_config, write_corpus

LAYERS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repair")
    corpus = write_corpus(tmp / "corpus")
    for repair in (False, True):
        config = tiny_config(corpus, tmp / "tfds", model__n_layers=LAYERS, model__norm="post",
                             train__steps=8, diag__every=4, train__eval_every=8,
                             train__grad_repair=repair)
        train_and_evaluate(config, str(tmp / "runs" / f"repair_{repair}"))
    return tmp / "runs"


def raw(records: list[dict], step: int, name: str) -> np.ndarray:
    """``diag/<name>/layer_XX`` at ``step``, per layer, read straight from the records."""
    (record,) = [r for r in records if r["step"] == step and f"diag/{name}/layer_00" in r]
    return np.array([record[f"diag/{name}/layer_{i:02d}"] for i in range(LAYERS)])


def test_the_study_reads_the_records_as_numpy_does(runs, tmp_path):
    result = subprocess.run([sys.executable, "-m", "experiments.repair_study",
                             f"--runs_under={runs}", f"--out_dir={tmp_path / 'out'}"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    by_repair = {r["repair"]: r for r in summary["runs"]}
    assert set(by_repair) == {False, True} and (tmp_path / "out" / "repair.png").exists()
    early = {}
    for repair, row in by_repair.items():
        records = read_records(runs / f"repair_{repair}")
        assert row["steps"] == [1, 4, 8]
        update = np.sqrt(sum(raw(records, 8, f"update_norm_{g}") ** 2
                             for g in ("attn", "ffn", "norm")))
        np.testing.assert_allclose(row["update_norm_last"], update, rtol=1e-12)
        np.testing.assert_allclose(row["update_norm_early"][-1], update[:4].mean(), rtol=1e-12)
        np.testing.assert_allclose(row["update_norm_late"][-1], update[-4:].mean(), rtol=1e-12)
        fall = raw(records, 1, "dldx_norm_attn")[:4] / raw(records, 8, "dldx_norm_attn")[:4]
        np.testing.assert_allclose(row["true_dldx_first_over_last_early"],
                                   np.exp(np.log(fall).mean()), rtol=1e-12)
        early[repair] = update[:4].mean()
        # AdamW's decoupled decay alone: lr * weight_decay * ||decayed matrices|| (norm gains
        # are not decayed by default)
        config = json.loads((runs / f"repair_{repair}" / "config.json").read_text())
        assert not config["opt"]["decay_norms_and_embeddings"]
        (lr,) = [r["train/lr"] for r in records if r["step"] == 8 and "train/lr" in r]
        decayed = np.sqrt(raw(records, 8, "param_norm_attn") ** 2
                          + raw(records, 8, "param_norm_ffn") ** 2)
        assert row["decay_only_update_early"] == pytest.approx(
            lr * config["opt"]["weight_decay"] * decayed[:4].mean(), rel=1e-12)
        if repair:
            cos = raw(records, 8, "repair_cos")
            assert row["repair_cos_last_median"] == pytest.approx(np.median(cos), rel=1e-12)
            assert row["repair_cos_last_min"] == pytest.approx(cos.min(), rel=1e-12)
            assert -1 <= row["repair_cos_all_last"] <= 1
        else:
            assert row["repair_cos_last_median"] is None and row["repair_cos_all_last"] is None
    (pair,) = summary["pairs"]
    assert pair["early_update_repaired_over_plain"] == pytest.approx(early[True] / early[False],
                                                                     rel=1e-12)
    table = (tmp_path / "out" / "summary.md").read_text()
    assert f"| adamw lr 0.003, {LAYERS} layers | yes |" in table
