"""The HTML report (postnorm.analysis.report, ``main.py --mode=report``) on synthetic metrics."""

import base64
import json
import re
import subprocess
import sys

import pytest

from configs.default import get_config
from postnorm.analysis import closing, report
from postnorm.analysis.figures import render_run_plots
from postnorm.train import forensics
from postnorm.workdir.config_record import WorkdirConfigError
from postnorm.workdir.metrics import MetricsFileError, layer_key

N_LAYERS, STEPS = 6, list(range(10, 101, 10))
FIGURES = ["loss_vs_lfreq", "tsim", "layers", "dldx", "heatmap_tsim", "heatmap_dldx",
           "heatmap_contraction", "heatmap_y_rms"]


def write_run(workdir, collapse: bool = True, skipped: int = 2, n_layers: int = N_LAYERS) -> None:
    """A Post-Norm-like run: the top layer's tsim -> 1 from step 20, the upper half's and the
    loss -> L_freq = 5 from step 40, early gradients falling 1e4x; ``skipped`` non-finite steps
    skipped by the end."""
    config = get_config(f"layers={n_layers},steps=100")
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    lines = []
    for col, step in enumerate([1] + STEPS):
        late = collapse and step >= 40
        record = {"step": step, "train/loss": 5.1 if late else 8.0 - 0.05 * step,
                  "train/lfreq": 5.0, "train/skipped_steps": skipped if step == 100 else 0}
        for layer in range(n_layers):
            top = collapse and step >= 20 and layer == n_layers - 1
            tsim = 0.999 if top or (late and layer >= n_layers // 2) else 0.1 + 0.05 * layer
            values = {"tsim": tsim, "dldx_norm": 10.0 ** (-col * 0.4 * (layer < 4)),
                      "c_mean": 1 - 0.02 * col, "y_rms_mean": 1 + 0.03 * col}
            for name, value in values.items():
                for kind in ("attn", "ffn"):
                    record[layer_key(f"diag/{name}_{kind}", layer, n_layers)] = value
        if step == 100:
            record.update({"eval/loss": 5.2, "eval/lfreq": 5.0, "eval/freq_floor": 4.0,
                           "eval/loss_over_floor": 1.3})
        lines.append(json.dumps(record))
    (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def embedded_images(text: str) -> dict[str, bytes]:
    return {alt: base64.b64decode(data) for alt, data in
            re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)">', text)}


def test_report_embeds_every_figure_and_warns(tmp_path):
    write_run(tmp_path)
    with open(report.write_report(str(tmp_path))) as f:
        text = f.read()
    images = embedded_images(text)
    assert sorted(images) == sorted(FIGURES)
    assert all(png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000 for png in images.values())
    assert not re.search(r'src="(?!data:)', text)  # self-contained
    # the loss (mean of the last 3 logged) is within 5% of L_freq from step 60
    assert "Collapse detected: from step 60 on" in text and "[20, 60]" in text
    assert "2 non-finite steps were skipped" in text
    assert "Gradient vanishing in the early layers" in text
    assert "&quot;n_layers&quot;: 6" in text  # the config section, HTML-escaped
    for label, value in [("final eval loss / L_freq", "1.04"),
                         ("final eval loss / the frequency floor of the eval batches", "1.3")]:
        assert re.search(re.escape(label) + r"</th><td>" + re.escape(value) + "<", text), label


def test_report_of_a_healthy_run_has_no_collapse_warning(tmp_path):
    write_run(tmp_path, collapse=False, skipped=0)
    text = report.build_report(str(tmp_path))
    assert "Collapse detected" not in text and "non-finite" not in text
    assert "<th>collapsed</th><td>no</td>" in text


def test_main_report_mode_writes_the_html(tmp_path):
    write_run(tmp_path)
    done = subprocess.run([sys.executable, "main.py", "--mode=report", "--config",
                           "configs/default.py", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("report.html")
    assert len(embedded_images((tmp_path / "report.html").read_text())) == len(FIGURES)


def test_report_shows_the_thm38_record_and_the_fresh_batch_loss(tmp_path):
    write_run(tmp_path)
    point = {"loss": 3.0, "lfreq_batch": 3.0, "at_point": {"max_abs_grad": 2.5e-7},
             "control": {"max_abs_grad": 0.4}}
    record = {"checkpoint_step": 100, "stationary_point": point,
              "bound": {"sequences": 64, "w_lm_spectral_norm": 12.5, "mean": {"eps": 4e-5},
                        "bound_holds_fraction": 1.0, "min_slack": 0.25, "kl_pfreq_qbar": 0.1381,
                        "lfreq_corpus": 5.0},
              "next_train_batches": {"batches": 512, "loss": 5.0743, "floor": 4.9876,
                                     "loss_over_lfreq": 1.01486, "loss_over_floor": 1.01738}}
    (tmp_path / "thm38.json").write_text(json.dumps(record))
    with open(report.write_report(str(tmp_path))) as f:
        text = f.read()
    assert "Theorem 3.8 on the final checkpoint" in text
    for label, value in [("KL(p_freq || mean model output)", "0.1381"),
                         ("next 512 training batches (not trained on): loss / L_freq", "1.01486"),
                         ("next 512 training batches (not trained on): loss / floor", "1.01738")]:
        assert re.search(re.escape(label) + r"</t[dh]>\s*<td>" + re.escape(value), text), label


def test_the_report_leaves_the_runs_own_plots_as_they_were(tmp_path):
    """--mode=report writes its figures under plots/report/, not over the trainer's plots/
    (whose loss_vs_lfreq.png is another figure)."""
    write_run(tmp_path)
    render_run_plots(str(tmp_path))
    before = {p.name: p.read_bytes() for p in (tmp_path / "plots").glob("*.png")}
    report.write_report(str(tmp_path))
    assert {p.name: p.read_bytes() for p in (tmp_path / "plots").glob("*.png")} == before
    assert sorted(p.stem for p in (tmp_path / "plots" / "report").glob("*.png")) == sorted(FIGURES)
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.slow
def test_a_damaged_thm38_record_or_sparse_config_is_reported_not_fatal(tmp_path):
    write_run(tmp_path)
    for text in ("{bad", "{}"):
        (tmp_path / "thm38.json").write_text(text)
        html_text = report.build_report(str(tmp_path))
        assert re.search(f"{tmp_path}/thm38.json is unreadable or incomplete .*rerun "
                         "experiments/collapse.py", html_text)
    (tmp_path / "config.json").write_text('{"model": {"norm": "post"}}')
    assert "<td>post-norm, ? layers, d=?</td>" in report.build_report(str(tmp_path))


def test_dumps_of_an_earlier_attempt_are_set_aside_by_a_fresh_start(tmp_path):
    aside = tmp_path / "earlier_attempts"
    for attempt, name in enumerate(["nonfinite_step_3.json", "nonfinite_step_3-1.json"]):
        (tmp_path / "nonfinite_step_3.json").write_text(f'{{"attempt": {attempt}}}')
        assert forensics.set_aside_dumps(str(tmp_path)) == [f"{aside}/{name}"]
    assert [json.loads((aside / name).read_text())["attempt"] for name in
            ("nonfinite_step_3.json", "nonfinite_step_3-1.json")] == [0, 1]
    write_run(tmp_path, skipped=0)
    assert "Non-finite step dump" not in report.build_report(str(tmp_path))


def test_an_unfinished_last_line_is_left_out_and_warned_about(tmp_path):
    """A record cut short (its writer stopped mid-line) is not read, and the report says so: it
    may be the last eval."""
    write_run(tmp_path)
    whole = (tmp_path / "metrics.jsonl").read_bytes()
    assert "unfinished line" not in report.build_report(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_bytes(whole[:-20])
    text = report.build_report(str(tmp_path))
    assert "metrics.jsonl ends in an unfinished line of " in text
    cut = len(whole[:-20]) - whole[:-20].rfind(b"\n") - 1
    assert f"unfinished line of {cut} bytes" in text
    assert "<th>final eval loss</th><td>–</td>" in text  # the step-100 record was the cut one


def test_a_config_or_metrics_file_of_the_wrong_shape_is_a_clear_error(tmp_path):
    write_run(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["train"]["steps"] = "100"  # not a number: the completeness check is skipped
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "The run is incomplete" not in report.build_report(str(tmp_path))
    config["train"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WorkdirConfigError, match="config.json does not hold a config .* each "
                       "of model, data, opt, train, diag, monitor, runtime, mesh it has an object"):
        report.build_report(str(tmp_path))
    write_run(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [{k: v for k, v in json.loads(line).items() if not k.endswith("lfreq")}
               for line in lines]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(MetricsFileError, match="metrics.jsonl holds no train/lfreq or eval/lfreq"):
        report.build_report(str(tmp_path))


def test_early_layer_labels_and_a_config_given_on_the_command_line(tmp_path):
    """With 2 layers the early layers are 0-1; a workdir without config.json is reported with
    the config given, and says so."""
    write_run(tmp_path, n_layers=2)
    text = report.build_report(str(tmp_path))
    assert "ratio across the window, layers 0-1</th>" in text
    assert "at layers 0-1 fell by" in text and "layers 0-3" not in text
    assert "does not exist: the config shown" not in text
    (tmp_path / "config.json").unlink()
    text = report.build_report(str(tmp_path), fallback_config=get_config().to_dict())
    assert f"{tmp_path}/config.json does not exist: the config shown is the one --config gave" \
        in text


def test_the_closing_summary_of_a_collapsed_run(tmp_path):
    """write_run: from step 60 the last 3 logged losses are all 5.1, within 5% of L_freq = 5
    (no per-batch floors: the floor is L_freq) with layers 3-5 at tsim 0.999 (layer 5 from step
    20: the window [20, 60]); layers 0-3's ||dL/dX|| is 10^(-0.4 i) at the i-th diagnostic
    step, so 1 at step 1 and 1e-4 at step 100."""
    write_run(tmp_path)
    plots = render_run_plots(str(tmp_path))
    lines = closing.closing_summary(str(tmp_path), plots, str(tmp_path / "report.html"))
    assert lines == [
        f"== done: step 100 in {tmp_path}",
        "collapse: yes, from step 60 (window [20, 60]; rule: >= 50% of the layers at tsim >= "
        "0.99 and the loss within 5% of its batches' floor)",
        "layers alike at step 100: 3 of 6 (tsim >= 0.99)",
        "loss: 5.1000 = 1.0200 x L_freq (5.0000) = 1.0200 x its batches' floor (train, last 3 "
        "logged steps); eval 5.2000 = 1.0400 x L_freq",
        "early-layer gradient: ||dL/dX|| of layers 0-3 fell 1e+04x to 1e+04x from step 1 to 100 "
        "(vanishing: over 100x)",
        f"plots: {tmp_path}/plots/ (heatmap_tsim, heatmap_dldx, heatmap_contraction, "
        "heatmap_y_rms, loss_vs_lfreq)",
        f"report: {tmp_path}/report.html"]
    assert closing.closing_summary(str(tmp_path), None, None)[-2:] == [
        "plots: not written (the error above says why)",
        "report: not written (the error above says why)"]


def test_every_figure_of_the_report_has_a_caption_in_words(tmp_path):
    write_run(tmp_path)
    text = report.build_report(str(tmp_path))
    captions = dict(re.findall(r'<img alt="([^"]+)"[^>]*><figcaption>([^<]+)</figcaption>', text))
    assert sorted(captions) == sorted(FIGURES)
    for name, words in captions.items():
        assert len(words.split()) >= 6 and not re.search(rf"(?<!\w){name}(?![\w(])", words), name
