"""The numbers and figures researchers read (run summaries, metrics.jsonl, figures, the report,
the collapse, sweep and batch-floor tables) against hand-computed values of small constructed
inputs."""

import html
import json
import re
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest

from configs.default import get_config
from postnorm.analysis import collapse_figures, figures, report, summary
from postnorm.train import reporter
from postnorm.train.loop import train_and_evaluate
from postnorm.workdir.metrics import layer_key, read_metrics, truncate_jsonl
from tests.reliability_helpers import REPO, tiny_config, write_corpus

LFREQ = 5.0


def _key(name: str, layer: int) -> str:
    """Written out by hand (not with ``layer_key``): the zero-padded key of a 12-layer run."""
    return f"diag/{name}/layer_{layer:02d}"


# ---------------------------------------------------------------- run_summary.summarize
# Train steps 1, 10, 20, 30 with their batches' floors; evals at 10 and 30; diagnostics at
# steps 1 and 30 for 12 layers (layer_10 and layer_11 sort after layer_02 only numerically).
TRAIN = {1: (8.0, 5.5), 10: (6.0, 5.3), 20: (5.6, 5.1), 30: (5.3, 4.8)}
EVALS = {10: (6.5, 5.4), 30: (5.5, 5.1)}
DLDX_FIRST = [1.0 * (layer + 1) for layer in range(12)]
DLDX_LAST = [0.01 * (layer + 1) ** 2 for layer in range(12)]
TSIM_LAST = [0.1] * 8 + [0.99, 0.995, 0.2, 0.999]  # 3 of 12 at >= 0.99 (one exactly)


def write_summary_run(workdir) -> None:
    lines = []
    for step, (loss, floor) in TRAIN.items():
        record = {"step": step, "train/loss": loss, "train/lfreq": LFREQ,
                  "train/freq_floor": floor}
        if step in EVALS:
            record.update({"eval/loss": EVALS[step][0], "eval/freq_floor": EVALS[step][1],
                           "eval/lfreq": LFREQ})
        if step in (1, 30):
            for layer in range(12):
                first = step == 1
                record[_key("dldx_norm_attn", layer)] = (DLDX_FIRST if first
                                                         else DLDX_LAST)[layer]
                record[_key("tsim_attn", layer)] = 0.5 if first else TSIM_LAST[layer]
        lines.append(json.dumps(record))
    (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_summarize_reports_hand_computed_ratios(tmp_path):
    write_summary_run(tmp_path)
    got = summary.summarize(str(tmp_path))
    loss = (6.0 + 5.6 + 5.3) / 3  # the last three logged train losses
    floor = (5.3 + 5.1 + 4.8) / 3  # their batches' floors
    assert got["final_step"] == 30
    assert got["final_train_loss"] == pytest.approx(loss, rel=1e-12)
    assert got["final_train_floor"] == pytest.approx(floor, rel=1e-12)
    assert got["lfreq"] == LFREQ
    assert got["train_loss_over_lfreq"] == pytest.approx(loss / LFREQ, rel=1e-12)
    assert got["train_loss_over_floor"] == pytest.approx(loss / floor, rel=1e-12)
    assert got["final_eval_loss"] == 5.5  # the last eval, not the first
    evals = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "eval/loss" in r]
    assert got["eval_curve"] == [[r["step"], r["eval/loss"]] for r in evals]
    assert len(got["eval_curve"]) > 1 and got["eval_curve"][-1][1] == 5.5
    assert got["eval_floor"] == 5.1
    assert got["eval_loss_over_floor"] == pytest.approx(5.5 / 5.1, rel=1e-12)
    assert got["diag_steps"] == [1, 30]
    np.testing.assert_allclose(got["dldx_first_over_last_early_layers"],
                               [DLDX_FIRST[k] / DLDX_LAST[k] for k in range(4)], rtol=1e-12)
    assert got["dldx_first_over_last_last_layer"] == pytest.approx(12.0 / 1.44, rel=1e-12)
    assert got["fraction_of_layers_tsim_ge_0.99"] == pytest.approx(3 / 12, rel=1e-12)


# ---------------------------------------------------------------- metrics.jsonl
def test_layer_keys_are_zero_padded_so_they_sort_by_layer():
    assert layer_key("diag/tsim_attn", 7, 48) == "diag/tsim_attn/layer_07"
    assert layer_key("diag/tsim_attn", 3, 6) == "diag/tsim_attn/layer_03"
    assert layer_key("diag/tsim_attn", 5, 120) == "diag/tsim_attn/layer_005"
    for n_layers in (2, 6, 12, 48, 120):
        keys = [layer_key("diag/c_mean_ffn", k, n_layers) for k in range(n_layers)]
        assert sorted(keys) == keys, n_layers  # TensorBoard lists keys as text


def test_truncation_keeps_exactly_the_records_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [f'{{"step": {s}, "a": {s}}}\n' for s in (1, 2, 3, 4)]
    path.write_text("".join(lines))
    truncate_jsonl(str(path), 2)
    assert path.read_text() == "".join(lines[:2])
    truncate_jsonl(str(path), 0)
    assert path.read_text() == ""


def test_the_eta_in_hours_shows_minutes(monkeypatch):
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(reporter.time, "perf_counter", lambda: next(clock))
    progress = reporter.Progress(total_steps=3726, tokens_per_step=1, start_step=0)
    progress.report(0, {"train/loss": 1.0, "train/lr": 0.1}, 0.5)
    line, _ = progress.report(1, {"train/loss": 1.0, "train/lr": 0.1}, 0.5)
    assert line.endswith("ETA 1h02m")  # 3725 steps at 1 step/s = 1 h 2 min 5 s


class StoppedAtProgressError(Exception):
    """Raised in place of building the trainer's Progress, once its arguments are seen."""


def test_the_trainer_counts_batch_size_times_seq_len_tokens_a_step(tmp_path, monkeypatch):
    seen = {}

    def progress(total_steps, tokens_per_step, start_step):
        seen.update(total_steps=total_steps, tokens_per_step=tokens_per_step)
        raise StoppedAtProgressError

    monkeypatch.setattr(reporter, "Progress", progress)
    config = tiny_config(write_corpus(tmp_path / "corpus"), tmp_path / "tfds")
    with pytest.raises(StoppedAtProgressError):
        train_and_evaluate(config, str(tmp_path / "run"))
    assert seen == {"total_steps": 20, "tokens_per_step": 8 * 32}  # batch 8 x 32 tokens


# ---------------------------------------------------------------- figures: their data
@pytest.fixture
def kept_figures(monkeypatch):
    """The figures save_figure is given, kept open: {file name: Figure}."""
    kept = {}

    def keep(fig, path, **kwargs):
        kept[path.rsplit("/", 1)[-1]] = fig

    monkeypatch.setattr(figures, "save_figure", keep)
    monkeypatch.setattr(collapse_figures, "save_figure", keep)
    yield kept
    for fig in kept.values():
        plt.close(fig)


def _lines(ax) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {line.get_label(): (np.asarray(line.get_xdata(), float),
                               np.asarray(line.get_ydata(), float)) for line in ax.get_lines()}


def test_heatmaps_take_log10_of_the_gradients_only(tmp_path, kept_figures):
    steps = np.array([1, 10])
    dldx = np.array([[1e-3, 1e-1], [10.0, 100.0]])
    tsim = np.array([[0.2, 0.5], [0.9, 0.99]])
    figures.plot_heatmaps({"dldx_norm_attn": (steps, dldx), "tsim_attn": (steps, tsim)},
                        str(tmp_path))
    shown_dldx = kept_figures["heatmap_dldx.png"].axes[0].collections[0].get_array()
    np.testing.assert_allclose(np.asarray(shown_dldx).reshape(2, 2), [[-3, -1], [1, 2]])
    shown_tsim = kept_figures["heatmap_tsim.png"].axes[0].collections[0].get_array()
    np.testing.assert_allclose(np.asarray(shown_tsim).reshape(2, 2), tsim)


def test_the_loss_figure_plots_each_series_at_its_own_steps(tmp_path, kept_figures):
    write_summary_run(tmp_path)
    figures.plot_loss(read_metrics(str(tmp_path)), str(tmp_path))
    lines = _lines(kept_figures["loss_vs_lfreq.png"].axes[0])
    np.testing.assert_array_equal(lines["train loss"][0], list(TRAIN))
    np.testing.assert_array_equal(lines["train loss"][1], [v[0] for v in TRAIN.values()])
    np.testing.assert_array_equal(lines["frequency floor of the batch"][1],
                                  [v[1] for v in TRAIN.values()])
    np.testing.assert_array_equal(lines["eval loss"][0], list(EVALS))
    np.testing.assert_array_equal(lines["eval loss"][1], [v[0] for v in EVALS.values()])
    np.testing.assert_array_equal(lines[f"L_freq = {LFREQ:.3f}"][1], [LFREQ, LFREQ])


def test_the_run_loss_figure_divides_each_loss_by_its_batch_floor(tmp_path, kept_figures):
    write_summary_run(tmp_path)
    records = read_metrics(str(tmp_path))
    collapse_figures.plot_loss_runs({"post_seed0": records}, str(tmp_path / "loss.png"))
    ax, ax_ratio = kept_figures["loss.png"].axes[:2]
    np.testing.assert_allclose(_lines(ax)["post_seed0"][1], [v[0] for v in TRAIN.values()])
    np.testing.assert_allclose(_lines(ax_ratio)["post_seed0"][1],
                               [8.0 / 5.5, 6.0 / 5.3, 5.6 / 5.1, 5.3 / 4.8], rtol=1e-12)


def test_layer_lines_plot_one_over_y_rms_and_c_and_gradients_on_a_log_scale(tmp_path,
                                                                             kept_figures):
    steps = np.array([1, 10, 20])
    y_rms = np.array([[1.0, 2.0, 4.0], [0.5, 0.25, 0.125]])
    c = np.array([[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]])
    grad = np.array([[1.0, 1e-2, 1e-4], [2.0, 3.0, 4.0]])
    series = {f"y_rms_mean_{k}": (steps, y_rms) for k in ("attn", "ffn")}
    series |= {f"c_mean_{k}": (steps, c) for k in ("attn", "ffn")}
    series |= {f"dldx_norm_{k}": (steps, grad) for k in ("attn", "ffn")}
    collapse_figures.plot_layer_lines(series, (1, 10), str(tmp_path / "layers.png"))
    collapse_figures.plot_dldx_lines(series, (1, 10), str(tmp_path / "dldx.png"))
    layers_fig, dldx_fig = kept_figures["layers.png"], kept_figures["dldx.png"]
    panels = [ax for ax in layers_fig.axes if ax.get_lines()]  # the colour bars hold none
    for ax, want in zip(panels, [1 / y_rms, 1 / y_rms, c, c], strict=True):
        ydata = [line.get_ydata() for line in ax.get_lines()]
        np.testing.assert_allclose(ydata, want, rtol=1e-12)  # layer k is line k
        assert ax.get_yscale() == "linear"
    panels = [ax for ax in dldx_fig.axes if ax.get_lines()]
    assert len(panels) == 2
    for ax in panels:
        np.testing.assert_allclose([line.get_ydata() for line in ax.get_lines()], grad)
        assert ax.get_yscale() == "log"


# ---------------------------------------------------------------- report.html summary
REPORT_TRAIN = {1: (8.0, 5.5), 10: (6.5, 5.3), 20: (5.9, 5.2), 30: (5.6, 5.0), 40: (5.3, 4.9)}


def write_report_run(workdir, last_step: int = 40) -> None:
    (workdir / "config.json").write_text(
        get_config("layers=4,steps=40").to_json_best_effort(indent=2))
    lines = []
    skipped = {1: 0, 10: 1, 20: 1, 30: 3, 40: 3}  # cumulative, as the trainer logs it
    for step, (loss, floor) in REPORT_TRAIN.items():
        if step > last_step:
            break
        record = {"step": step, "train/loss": loss, "train/lfreq": LFREQ,
                  "train/freq_floor": floor, "train/skipped_steps": skipped[step]}
        for layer in range(4):
            # layer 0 falls 1000x, layers 1-3 only 2x: no vanishing in the early layers
            fall = 1000.0 if layer == 0 else 2.0
            record[f"diag/dldx_norm_attn/layer_{layer:02d}"] = 1.0 if step == 1 else 1 / fall
            record[f"diag/tsim_attn/layer_{layer:02d}"] = 0.3
        lines.append(json.dumps(record))
    (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _summary_cells(text: str) -> dict[str, str]:
    return {html.unescape(k): html.unescape(v)
            for k, v in re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", text)}


def test_the_report_summary_and_warnings_hold_hand_computed_values(tmp_path):
    write_report_run(tmp_path)
    point = {"loss": 3.25, "lfreq_batch": 3.0, "at_point": {"max_abs_grad": 1e-7},
             "control": {"max_abs_grad": 0.4}}
    thm = {"checkpoint_step": 40, "stationary_point": point,
           "bound": {"sequences": 8, "w_lm_spectral_norm": 2.0, "mean": {"eps": 1e-5},
                     "bound_holds_fraction": 1.0, "min_slack": 0.1, "kl_pfreq_qbar": 0.2,
                     "lfreq_corpus": 5.0}}
    (tmp_path / "thm38.json").write_text(json.dumps(thm))
    text = report.build_report(str(tmp_path))
    cells = _summary_cells(text)
    assert float(cells["train loss at the last logged step"]) == 5.3
    assert float(cells["train loss at the last logged step / L_freq"]) == pytest.approx(
        5.3 / LFREQ, rel=1e-5)
    smoothed = [key for key in cells if key.startswith("mean train loss of the last 3")]
    assert len(smoothed) == 1
    assert float(cells[smoothed[0]]) == pytest.approx(
        ((5.9 + 5.6 + 5.3) / 3) / ((5.2 + 5.0 + 4.9) / 3), rel=1e-5)
    assert float(cells["p_freq point: loss - L_freq(batch)"]) == pytest.approx(0.25, rel=1e-5)
    assert "3 non-finite steps were skipped" in text  # the cumulative count, not a sum
    assert "Gradient vanishing" not in text  # only layer 0 of layers 0-3 fell 100x or more
    assert "The run is incomplete" not in text  # metrics end at train.steps


def test_the_report_says_where_an_incomplete_run_ends(tmp_path):
    write_report_run(tmp_path, last_step=30)
    assert "The run is incomplete: metrics end at step 30 of 40." in report.build_report(
        str(tmp_path))


def run_script(source: str) -> subprocess.CompletedProcess:
    """``python -c source`` from the repository root: experiments.collapse and
    experiments.sweep define the same absl flags, so each script imports one of them alone."""
    return subprocess.run([sys.executable, "-c", source], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


# ---------------------------------------------------------------- experiments.collapse
COLLAPSE_CHECK = r"""
import math
import numpy as np
from experiments.collapse import markdown, norm_summary, run_row
from postnorm.analysis.collapse import Collapse

def result(status, over_lfreq, over_floor):
    return {"status": status, "final_train_loss": over_lfreq * 5.0, "lfreq": 5.0,
            "train_loss_over_lfreq": over_lfreq, "final_train_floor": 5.1,
            "train_loss_over_floor": over_floor, "eval_loss_over_floor": 1.5,
            "wall_s": 1.0, "skipped_steps": 0, "rollbacks": 0}

def collapse(collapsed):
    return Collapse(collapsed=collapsed, collapse_step=40 if collapsed else None,
                    onset_step=None, first_hit_step=None, similar_layers_step=None,
                    pre_window_step=None, grad_ratio_early=None, grad_ratio_last=None,
                    diag_steps=[], fraction_collapsed=[], meets_criterion=[])

rows = [run_row("post_seed0", result("done", 1.01, 0.97), collapse(True)),
        run_row("post_seed1", result("done", 1.05, 0.99), collapse(False)),
        run_row("post_seed2", result("done", 1.03, 1.00), collapse(True)),
        run_row("post_seed3", result("nonfinite", math.nan, math.nan), None)]
assert [r["loss_over_lfreq"] for r in rows[:3]] == [1.01, 1.05, 1.03]
assert [r["loss_over_floor"] for r in rows[:3]] == [0.97, 0.99, 1.00]
post = norm_summary(rows, ["post"])["post"]
assert (post["runs"], post["done"], post["stopped"], post["collapsed"]) == (4, 3, 1, 2), post
assert math.isclose(post["loss_over_lfreq_mean"], 1.03, rel_tol=1e-12)
# sample sd (ddof=1) of 1.01, 1.03, 1.05: sqrt((0.02**2 + 0 + 0.02**2) / 2) = 0.02
assert math.isclose(post["loss_over_lfreq_sd"], 0.02, rel_tol=1e-9), post
assert post["loss_over_floor"] == [0.97, 0.99, 1.00], post

table = markdown(rows, [], {"invocation_s": 1.0, "train_sum_s": 4.0})
lines = [l for l in table.splitlines() if l.startswith("|")]
cells = [[c.strip() for c in l.strip("|").split("|")] for l in lines]
header, body = cells[0], cells[2:]
assert all(len(row) == len(header) for row in cells), cells
first = dict(zip(header, body[0]))
assert first["run"] == "post_seed0"
assert first["loss/L_freq"] == "1.010" and first["loss/floor"] == "0.970", first
assert first["final train loss"] == "5.0500" and first["floor of those batches"] == "5.1000"
assert first["eval loss/floor"] == "1.500" and first["collapsed"] == "yes", first
assert dict(zip(header, body[1]))["collapsed"] == "no"
print("ok")
"""


def test_the_collapse_tables_average_and_label_hand_computed_values():
    """In a subprocess: experiments.collapse and experiments.sweep define the same flags."""
    result = run_script(COLLAPSE_CHECK)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# ---------------------------------------------------------------- experiments.sweep
SWEEP_CHECK = r"""
import numpy as np
import matplotlib.pyplot as plt
from postnorm.sweep import summary as sweep_summary
from postnorm.sweep.plan import RunSpec

spec = RunSpec("n_layers=2", (("model.n_layers", 2),))
result = {"status": "done", "config_digest": "D", "final_train_loss": 6.0, "lfreq": 5.0,
          "train_loss_over_lfreq": 1.2, "train_loss_over_floor": 1.1,
          "collapse": {"collapsed": False, "collapse_step": None}, "skipped_steps": 0,
          "rollbacks": 0, "wall_s": 3.0}
row = sweep_summary.table_row(spec, {"model": {"n_layers": 2}}, result, ["model.n_layers"], {"D"})
assert (row["loss_over_lfreq"], row["loss_over_floor"]) == (1.2, 1.1), row

def cell(depth, lr, status, ratio, norm="post"):
    return {"model.n_layers": depth, "opt.lr": lr, "model.norm": norm, "status": status,
            "loss_over_lfreq": ratio, "collapsed": False, "skipped_steps": 0}

rows = [cell(2, 1e-3, "done", 1.1), cell(2, 3e-3, "done", 1.4),
        cell(4, 1e-3, "done", 1.2), cell(4, 3e-3, "stale", 9.0),
        cell(2, 1e-3, "done", 0.8, "pre"), cell(2, 3e-3, "done", 0.9, "pre"),
        cell(4, 1e-3, "done", 0.7, "pre"), cell(4, 3e-3, "done", 0.6, "pre")]
kept = {}
sweep_summary.save_figure = lambda fig, path, **kw: kept.setdefault("fig", fig)
sweep_summary.stability_map(rows, "unused.png")
ax, pre_ax = kept["fig"].axes[:2]
grid = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
# rows: depth 2, 4 (origin lower); columns: lr 1e-3, 3e-3; a stale result is not coloured
np.testing.assert_array_equal(grid, [[1.1, 1.4], [1.2, np.nan]])
pre_grid = np.ma.filled(pre_ax.images[0].get_array().astype(float), np.nan)
np.testing.assert_array_equal(pre_grid, [[0.8, 0.9], [0.7, 0.6]])  # each panel its own runs
assert [t.get_text() for t in ax.get_yticklabels()] == ["2", "4"]
assert [t.get_text() for t in ax.get_xticklabels()] == ["0.001", "0.003"]
print("ok")
"""


def test_the_sweep_table_and_map_show_each_runs_own_loss_over_lfreq():
    result = run_script(SWEEP_CHECK)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# ---------------------------------------------------------------- experiments.batch_floors
BATCH_FLOORS_CHECK = r"""
import contextlib, io, json, types
import numpy as np
from absl import app
import experiments.batch_floors as bf
from postnorm.config.args import parse_flags

# floor of the batch of step s (1-based) is s**2; no data is read
bf.floors_per_step = lambda config, seed, steps: np.arange(1, steps + 1, dtype=float) ** 2
bf.load_data = lambda data, **kw: types.SimpleNamespace(
    lfreq=5.0, fingerprint="0" * 64, tokenizer=types.SimpleNamespace(vocab_size=300), info={})
bf.check_data_config = lambda data: None
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    app.run(bf.main, argv=["bf", "--config", "configs/default.py:train.steps=20,train.log_every=10",
                           "--next", "3"],
            flags_parser=parse_flags)
print(out.getvalue())
"""


def test_batch_floor_statistics_are_hand_computed():
    result = run_script(BATCH_FLOORS_CHECK)
    assert result.returncode == 0, result.stderr[-3000:]
    seed = json.loads(result.stdout[result.stdout.index("{"):])["seeds"]["0"]
    squares = [float(s * s) for s in range(1, 21)]
    assert seed["mean"] == pytest.approx(143.5, rel=1e-12)  # 20 * 21 * 41 / 6 / 20
    assert seed["sd"] == pytest.approx(np.std(squares, ddof=1), rel=1e-12)
    assert (seed["min"], seed["max"]) == (1.0, 400.0)
    assert seed["last_logged_steps"] == [1, 10, 20]
    assert seed["mean_last_logged"] == pytest.approx((1 + 100 + 400) / 3, rel=1e-12)
    assert seed["mean_next"] == {"3": pytest.approx((21**2 + 22**2 + 23**2) / 3, rel=1e-12)}
