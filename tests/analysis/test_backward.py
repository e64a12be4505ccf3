"""Thm 3.6 / 3.8(ii) read from logged diagnostics (postnorm.analysis.backward), on records built
by hand, and the experiment's table against its JSON."""

import json
import subprocess
import sys

import numpy as np
import pytest

from postnorm.analysis import backward
from postnorm.workdir.metrics import flatten_diagnostics
from tests.reliability_helpers import REPO


def records_from(dldx_SxK: np.ndarray, c_SxK: np.ndarray, tsim_SxL: np.ndarray,
                 grads_SxLx2: np.ndarray) -> list[dict]:
    """Diagnostic records whose taps are ``dldx`` (sublayer order, the stack output last)."""
    out = []
    for step, (g, c, t, grads) in enumerate(zip(dldx_SxK, c_SxK, tsim_SxL, grads_SxLx2,
                                                strict=True)):
        diag = {"dldx_norm_attn": g[:-1][0::2], "dldx_norm_ffn": g[:-1][1::2],
                "dldx_norm_final": g[-1], "c_mean_attn": c[0::2], "c_mean_ffn": c[1::2],
                "tsim_attn": t, "grad_norm_attn": grads[:, 0], "grad_norm_ffn": grads[:, 1]}
        out.append({"step": 10 * step + 1, **flatten_diagnostics(diag)})
    return out


def test_series_interleave_the_sublayers_and_the_ratios_follow():
    rng = np.random.default_rng(0)
    n_layers, steps = 3, 4
    dldx = rng.uniform(0.1, 1.0, (steps, 2 * n_layers + 1))
    c = rng.uniform(0.5, 1.0, (steps, 2 * n_layers))
    records = records_from(dldx, c, rng.uniform(size=(steps, n_layers)),
                           rng.uniform(size=(steps, n_layers, 2)))
    series = backward.sublayer_series(records)
    np.testing.assert_array_equal(series.steps, [1, 11, 21, 31])
    np.testing.assert_allclose(series.dldx, dldx.T)
    np.testing.assert_allclose(series.contraction, c.T)
    np.testing.assert_allclose(series.ratios(), (dldx[:, :-1] / dldx[:, 1:]).T)


def test_a_geometric_profile_gives_its_rate_and_noise_gives_its_standard_error():
    k = np.arange(97)
    fit = backward.fit_decay(3.0 * 0.9 ** (96 - k))  # g_k / g_k+1 = 0.9
    assert fit.rate == pytest.approx(0.9, rel=1e-12) and fit.rate_stderr < 1e-12
    rng = np.random.default_rng(1)
    slopes = []
    for _ in range(400):
        noisy = 0.9 ** (96 - k) * np.exp(rng.normal(0, 0.3, k.size))
        slopes.append(backward.fit_decay(noisy))
    rates = np.array([f.rate for f in slopes])
    assert rates.mean() == pytest.approx(0.9, rel=2e-3)
    # the stated standard error is the spread of the estimate over noise draws
    assert np.mean([f.rate_stderr for f in slopes]) == pytest.approx(rates.std(), rel=0.15)


def test_gradients_that_underflowed_to_zero_are_left_out_of_the_fit_and_the_ratios():
    """At the paper's width a collapsed Post-Norm run's early taps are exactly 0 in float32:
    the fit uses the sublayers above them, and a ratio with a 0 is unknown, not 0 or inf."""
    g_K = 0.5 ** -np.arange(12.0)  # grows by 2 per sublayer toward the output
    g_K[:4] = 0.0
    fit = backward.fit_decay(g_K)
    assert (fit.rate, fit.sublayers, fit.vanished) == (pytest.approx(0.5), 8, 4)
    assert np.isnan(backward.fit_decay(np.array([0.0, 0.0, 1.0, 2.0])).rate)  # 2 points
    series = backward.SublayerSeries(np.array([1]), g_K[:, None], np.ones((11, 1)))
    ratios = series.ratios()[:, 0]
    assert np.isnan(ratios[:4]).all() and ratios[4:] == pytest.approx(0.5)
    assert backward.geometric_mean(ratios) == pytest.approx(0.5)
    assert np.isnan(backward.geometric_mean(np.array([np.nan, np.nan])))


def test_gradients_by_similarity_split_the_layers_and_read_the_reference_there():
    run = {"tsim": np.array([0.2, 0.995, 0.99, 0.5]), "attn": np.array([1.0, 2.0, 4.0, 3.0]),
           "ffn": np.array([5.0, 6.0, 8.0, 7.0])}
    reference = {k: v * 10 for k, v in run.items()}
    out = backward.grads_by_similarity(run, reference)
    assert out["similar_layers"] == [1, 2]
    assert (out["attn_similar"], out["attn_other"]) == (3.0, 2.0)
    assert (out["ffn_similar"], out["ffn_other"]) == (7.0, 6.0)
    assert (out["attn_similar_reference"], out["ffn_other_reference"]) == (30.0, 60.0)
    alone = backward.grads_by_similarity({**run, "tsim": np.zeros(4)}, None)
    assert alone["attn_similar"] is None and alone["attn_other"] == 2.5


@pytest.mark.slow
def test_the_experiment_table_is_its_json(tmp_path):
    """Two finished tiny runs (post and pre): the table's cells are the JSON's numbers."""
    from tests.reliability_helpers import config_flag, subprocess_env, write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    runs = []
    for norm in ("post", "pre"):
        workdir = tmp_path / norm
        flag = config_flag(corpus, tmp_path / "tfds", model__norm=norm, train__steps=6,
                           diag__every=2, train__eval_every=6)
        result = subprocess.run([sys.executable, "main.py", "--config", flag, "--workdir",
                                 str(workdir)], cwd=REPO, capture_output=True, text=True,
                                timeout=300, env=subprocess_env(None))
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(str(workdir))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "experiments.backward_decay",
                             f"--runs={','.join(runs)}", f"--out_dir={out}"], cwd=REPO,
                            capture_output=True, text=True, timeout=300,
                            env=subprocess_env(None))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    table = (out / "summary.md").read_text()
    for row in summary["runs"]:
        assert row["steps"] == [1, 2, 4, 6]
        fit = backward.fit_decay(np.asarray(row["dldx_last"]))
        assert row["rate"][-1] == pytest.approx(fit.rate, rel=1e-12)
        assert f"{row['rate'][-1]:.4f} ± {row['rate_stderr'][-1]:.4f}" in table
        assert row["reference"] == runs[row["norm"] == "post"]
    assert (out / "backward_decay.png").stat().st_size > 0
