"""Numbers the docs cite, against the committed outputs of the commands beside them."""

import collections
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from configs.sweeps.training_methods import FIELDS, run_name
from tests.committed import REL_TOL, assert_json_matches, assert_text_matches
from tests.reliability_helpers import REPO, subprocess_env

EARLY_WARNING = REPO / "docs" / "figures" / "early_warning"


def test_the_early_warning_table_matches_its_replays():
    """docs/DIAGNOSTICS.md's detector table: persistence 3 from the replay's JSON, persistence 2
    from its markdown totals line."""
    rows = json.loads((EARLY_WARNING / "replay_leaderboard_partial.json").read_text())["runs"]
    finished = [r for r in rows if r["finished"]]
    collapsing = [r for r in finished if r["collapsed"]]
    quiet = [r for r in finished if not r["collapsed"]]
    leads = [r["lead_steps"] for r in collapsing]
    assert (len(finished), len(collapsing), len(quiet)) == (12, 3, 9)
    assert not any(r["missed"] for r in collapsing)
    assert (min(leads), max(leads)) == (160, 170)
    assert sum(r["false_alarm"] for r in quiet) == 0
    doc = (REPO / "docs" / "DIAGNOSTICS.md").read_text()
    assert "| 3 (the default) | 3 of 3 | 160–170 steps (16–17 intervals) | 0 |" in doc
    totals = (EARLY_WARNING / "replay_leaderboard_partial_persistence2.md").read_text()
    assert re.search(r"3 collapsing runs: 3 warned before the collapse step, lead time "
                     r"160-180 steps; 9 runs that did not collapse: 2 false alarms", totals)
    alarms = [line for line in totals.splitlines() if line.endswith("| yes |")]
    assert sorted(line.split(" | ")[0].strip("| ") + " " + line.split(" | ")[2]
                  for line in alarms) == ["periln 0.003", "sandwich 0.003"]
    assert "| 2 | 3 of 3 | 160–180 steps (16–18 intervals) | 2: sandwich and Peri-LN at lr 3e-3 |" \
        in doc


def test_the_leaderboard_archive_replay_matches_its_json():
    """docs/DIAGNOSTICS.md's row for the monitor replayed over the leaderboard's archive."""
    rows = json.loads((EARLY_WARNING / "replay_leaderboard_archive.json").read_text())["runs"]
    archived = list((REPO / "docs" / "leaderboard" / "runs").glob("*.json"))
    finished = [r for r in rows if r["finished"]]
    assert len(finished) == len(rows) == len(archived)  # every archived run, all measured
    collapsing = [r for r in finished if r["collapsed"]]
    quiet = [r for r in finished if not r["collapsed"]]
    alarms = collections.Counter(r["method"] for r in quiet if r["false_alarm"])
    leads = [r["lead_steps"] for r in collapsing]
    listed = ", ".join(f"{m} {n}" for m, n in sorted(alarms.items(), key=lambda i: (-i[1], i[0])))
    row = (f"| {len(finished)} of the leaderboard | {sum(not r['missed'] for r in collapsing)} of "
           f"{len(collapsing)} | {min(leads)}–{max(leads)} steps | {sum(alarms.values())} of "
           f"{len(quiet)}: {listed}; none on Pre-Norm |")
    doc = (REPO / "docs" / "DIAGNOSTICS.md").read_text()
    assert row in doc, row
    assert "pre" not in alarms
    # each replayed run's fresh-batch loss, from its archive record
    loss = {r["workdir"]: json.loads((REPO / r["workdir"]).read_text())["measures"][
        "fresh_loss_over_lfreq"] for r in quiet}
    alarmed = [r for r in quiet if r["false_alarm"]]
    at_floor = [r for r in alarmed if loss[r["workdir"]] >= 0.95]
    learned = [r for r in alarmed if loss[r["workdir"]] < 0.95]
    flat = " ".join(doc.split())
    assert f"{len(at_floor)} are on runs that ended at the unigram floor" in doc
    baselines = {"deepnorm", "mixln", "sandwich", "periln", "b2t", "b2t_rescaled",
                 "post_qk_norm", "post_z_loss"}
    # each published baseline's false alarm is named, whether its run learned or not
    assert all(f"`{r['method']}` seed {r['seed']} at lr {r['lr']:g}, {r['n_layers']} layers"
               in flat for r in alarmed if r["method"] in baselines)
    # the runs that learned after a false alarm: the adaptive controller's, and the baselines'
    adaptive = sorted(loss[r["workdir"]] for r in learned if r["method"] == "adaptive")
    assert f"{len(learned)} learned" in flat
    assert f"which then learned ({adaptive[0]:.3f}–{adaptive[-1]:.3f} × L_freq)" in flat
    assert {r["method"] for r in learned} <= baselines | {"adaptive"}
    assert all(f"{r['n_layers']} layers ({loss[r['workdir']]:.3f} × L_freq)" in flat
               for r in learned if r["method"] != "adaptive")


def test_the_backward_decay_section_matches_its_json():
    """docs/RESULTS.md's Theorem 3.6 / 3.8(ii) figures, from docs/figures/backward_decay."""
    runs = json.loads((REPO / "docs" / "figures" / "backward_decay" / "summary.json")
                      .read_text())["runs"]
    by = {(r["norm"], r["lr"]): r for r in runs}
    doc = (REPO / "docs" / "RESULTS.md").read_text()
    post1, post3, pre1, pre3 = (by[k] for k in (("post", 1e-3), ("post", 3e-3), ("pre", 1e-3),
                                                 ("pre", 3e-3)))
    q = [r["ratio_over_c_quantiles"] for r in (post1, post3)]
    assert f"median of {q[0]['p50']:.3f} (lr 1e-3) and {q[1]['p50']:.3f} (lr 3e-3)" in doc
    assert f"5th percentile is {q[0]['p5']:.3f} and {q[1]['p5']:.3f}" in doc
    pre_r = [r["ratio_quantiles"]["p50"] for r in (pre1, pre3)]
    assert f"r_k has a median of {pre_r[0]:.3f} and {pre_r[1]:.3f}" in doc
    for r, text in ((post1, "{:.3f} ± {:.3f} (lr 1e-3)"), (post3, "{:.3f} ± {:.3f} (lr 3e-3)")):
        assert text.format(r["rate"][-1], r["rate_stderr"][-1]) in doc
    assert f"Pre-Norm: {pre1['rate'][-1]:.3f} and {pre3['rate'][-1]:.3f}" in doc
    ends = [r["dldx_last"][0] / r["dldx_last"][-1] for r in (post1, post3, pre1, pre3)]
    assert f"is {ends[0]:.1e} and {ends[1]:.1e}".replace("e-0", "e-") in doc
    assert f"is {ends[2]:.1f} and {ends[3]:.1f}" in doc
    similar = [r["similarity"] for r in (post1, post3)]
    assert [s["similar_layers"] for s in similar] == [list(range(23, 48)), list(range(16, 48))]
    assert (f"average {similar[0]['attn_similar']:.1e} and {similar[1]['attn_similar']:.1e}"
            .replace("e-0", "e-")) in doc
    assert (f"average {similar[0]['attn_other']:.1e} and {similar[1]['attn_other']:.1e}"
            .replace("e-0", "e-")) in doc
    assert (f"carry {similar[0]['attn_similar_reference']:.1e} / "
            f"{similar[0]['attn_other_reference']:.1e} (lr 1e-3) and "
            f"{similar[1]['attn_similar_reference']:.1e} / "
            f"{similar[1]['attn_other_reference']:.1e} (lr 3e-3)").replace("e-0", "e-") in doc


def _pct(x: float) -> str:
    return f"{x * 100:+.1f} %".replace("-", "−")


def _errors(found: dict) -> str:
    return (f"{_pct(found['worst_rel_err'])} ({found['worst_layer']}) / "
            f"{found['mean_abs_rel_err'] * 100:.1f} % / {found['layers_beyond_10pct']}")


def test_theorem_32_at_the_nominal_s_and_theorem_34_match_the_stage1_outputs():
    """docs/THEORY.md's per-setting table from summary.json, and its per-layer excerpts from
    layers.csv (both from ``python -m experiments.init_similarity``)."""
    import csv

    stage1 = REPO / "docs" / "figures" / "stage1"
    figures = json.loads((stage1 / "summary.json").read_text())["figures"]
    doc = (REPO / "docs" / "THEORY.md").read_text()
    settings = ("post/real", "post/gaussian", "pre/real", "pre/gaussian")
    rows = {
        "s_nominal at the first, last layer":
            lambda f: f"{f['s_nominal_first']:.4f}, {f['s_nominal_last']:.4f}",
        "±W Δattn vs the closed form at s_nominal: worst (layer) / mean \\|error\\| / layers "
        "beyond 10 %": lambda f: _errors(f["attn_pm_vs_closed_s_nominal"]),
        "±W Δattn vs the exact Δ of the measured state at s_nominal":
            lambda f: _errors(f["attn_pm_vs_exact_s_nominal"]),
        "exact Δ vs the closed form, both at s_nominal (the EC assumption alone)":
            lambda f: _errors(f["attn_exact_vs_closed_s_nominal"]),
        "±W ΔFFN vs its closed form at the measured (t, ξ)":
            lambda f: _errors(f["ffn_pm_vs_closed"]),
        "ΔFFN within 10 % of its closed form from layer":
            lambda f: str(f["ffn_pm_vs_closed"]["within_10pct_from_layer"]),
    }
    for label, text in rows.items():
        assert f"| {label} | " + " | ".join(text(figures[s]) for s in settings) + " |" in doc
    with open(stage1 / "layers.csv") as f:
        layers = [r for r in csv.DictReader(f) if r["norm"] == "post"]
    keys = ("t_attn", "rho_ec", "corr_sd", "s_inferred", "s_nominal", "d_attn_pm",
            "d_attn_closed_s_inferred", "d_attn_closed_s_nominal", "d_attn_exact_s_nominal",
            "d_ffn_pm", "d_ffn_closed")
    for source in ("real", "gaussian"):
        for r in layers:
            if r["input"] == source and int(r["layer"]) in (0, 1, 2, 4, 8, 16, 24, 32, 40, 47):
                line = f"| {r['layer']} | " + " | ".join(f"{float(r[k]):.4g}" for k in keys)
                assert line + " |" in doc, line


def test_the_stability_map_replay_matches_its_json():
    """The 17 cells replayed with the map and its last cell, replayed in a later sitting."""
    rows = [r for name in ("replay_stability_partial.json", "replay_stability_last_cell.json")
            for r in json.loads((EARLY_WARNING / name).read_text())["runs"] if r["finished"]]
    collapsing = [r for r in rows if r["collapsed"]]
    quiet = [r for r in rows if not r["collapsed"]]
    assert (len(rows), len(collapsing), len(quiet)) == (18, 3, 15)
    assert len({(r["method"], r["n_layers"], r["lr"]) for r in rows}) == 18  # the whole grid
    assert {(r["method"], r["n_layers"], r["lr"]) for r in collapsing} == {
        ("post", 24, 3e-3), ("post", 48, 1e-3), ("post", 48, 3e-3)}
    assert sorted(r["lead_steps"] for r in collapsing) == [160, 160, 170]
    assert not any(r["false_alarm"] for r in quiet)
    assert sum(r["method"] == "pre" for r in quiet) == 9
    assert sum(r["n_layers"] == 12 for r in quiet) == 6
    doc = (REPO / "docs" / "DIAGNOSTICS.md").read_text()
    assert "| 160–170 steps | 0 of 15, among them all 9 Pre-Norm runs and all 6 12-layer runs |" \
        in doc


LEADERBOARD = REPO / "docs" / "leaderboard"


def test_the_committed_leaderboard_is_its_archive_tabulated(tmp_path):
    """docs/LEADERBOARD.md's table is the committed leaderboard.md, and the command beside it
    rebuilds that table and its JSON from the committed archive alone."""
    board = json.loads((LEADERBOARD / "leaderboard.json").read_text())
    table = (LEADERBOARD / "leaderboard.md").read_text()
    doc = (REPO / "docs" / "LEADERBOARD.md").read_text()
    assert table.strip() in doc
    result = subprocess.run(
        [sys.executable, "-m", "experiments.leaderboard", f"--out_dir={tmp_path}",
         "--archive=docs/leaderboard/runs", "--sweep=configs/sweeps/leaderboard.py:grid",
         "--report_only"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=subprocess_env(None))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_text_matches((tmp_path / "leaderboard.md").read_text(), table)
    assert_json_matches(json.loads((tmp_path / "leaderboard.json").read_text())["cells"],
                        board["cells"])
    runs = board["runs"]
    finished = [r for r in runs if r["status"] in ("done", "nonfinite")]
    # every archived run is one of the grid's, and tabulated
    archived = {p.stem for p in (LEADERBOARD / "runs").glob("*.json")}
    assert archived == {r["run_id"] for r in finished} and all(r.get("archived") for r in finished)
    # the plan is complete: every run finished, so no verdict is provisional
    assert len(finished) == len(runs) and f"All {len(runs)} of the plan's runs" in doc
    # the cost columns: each method's train step over post's in each side-by-side benchmark
    # run that times it, geometric mean over those runs, recomputed from the benchmark files
    architecture = ("intel_methods_overhead.json", "intel_methods_overhead_reversed.json")
    training = ("intel_methods_overhead_training.json",
                "intel_methods_overhead_training_reversed.json")
    for method, variant, files in (
            ("pre", "pre", architecture), ("post_qk_norm", "post,model.qk_norm=true", architecture),
            ("adaptive", "model.norm=adaptive", architecture),
            ("b2t_rescaled", "model.norm=b2t,model.b2t_rescaled_init=true", training),
            ("post_grad_repair", "post,train.grad_repair=true", training)):
        ratios = []
        for name in files:
            bench = json.loads((REPO / "docs" / "perf" / name).read_text())["variants"]
            ratios.append(bench[variant]["programs"]["train"]["median_s"]
                          / bench["post"]["programs"]["train"]["median_s"])
        assert board["costs"][method]["step_time_vs_post"] == pytest.approx(
            (ratios[0] * ratios[1]) ** 0.5, rel=REL_TOL)
        assert board["costs"][method]["benchmark_runs"] == 2
    # the per-method verdicts: the committed table and the JSON's
    verdicts = (LEADERBOARD / "leaderboard_methods.md").read_text()
    assert verdicts.strip() in doc
    assert_text_matches((tmp_path / "leaderboard_methods.md").read_text(), verdicts)
    assert_json_matches(json.loads((tmp_path / "leaderboard.json").read_text())["methods"],
                        board["methods"])
    by_method = {v["method"]: v for v in board["methods"]}
    prevented = [m for m, v in by_method.items()
                 if v["prevented"] == "yes" and m != "pre"]
    assert sorted(prevented) == sorted(["mixln", "sandwich", "periln", "post_budget_scale",
                                        "post_budget_penalty", "adaptive"])
    assert not any(v["meets_goal"] == "yes" for m, v in by_method.items() if m != "pre")
    assert all(v["prevented"] in ("yes", "no") and v["meets_goal"] in ("yes", "no")
               for v in by_method.values())
    # the prose's figures, from the cells and the runs' rows
    grid = {(e["method"], e["layers"], e["lr"], e["warmup"]): e for e in board["cells"]}
    flat = " ".join(doc.split())

    def loss(method, layers, lr, warmup):
        values = grid[(method, layers, lr, warmup)]["fresh_loss_over_lfreq"]
        return f"{np.mean(values):.3f}" + (f" ± {np.std(values):.3f}" if len(values) > 1 else "")

    # the default config's cells (48 layers, warmup 20), as most of the prose cites them
    def mean_sd(method, lr):
        return loss(method, 48, lr, 20)

    def gap(method, lr):
        return f"+{grid[(method, 48, lr, 20)]['gap_to_pre']:.3f}"

    assert (f"at {mean_sd('adaptive', 1e-3)} (lr 1e-3) and {mean_sd('adaptive', 3e-3)} (lr "
            f"3e-3) ×\n   L_freq, gaps **{gap('adaptive', 1e-3)} and {gap('adaptive', 3e-3)}**"
            ) in doc
    assert (f"{mean_sd('periln', 1e-3)} and {mean_sd('sandwich', 1e-3)} × L_freq at lr 1e-3 "
            f"(Pre-Norm {mean_sd('pre', 1e-3)})") in flat
    assert f"gaps of {gap('periln', 1e-3)}/{gap('sandwich', 1e-3)} and {gap('periln', 3e-3)}" \
        in flat
    assert gap("periln", 3e-3) == gap("sandwich", 3e-3)
    assert f"Mix-LN** is within it at lr 1e-3 ({gap('mixln', 1e-3)}; {mean_sd('mixln', 1e-3)})" \
        in flat
    row = {(r["method"], r["lr"], r["seed"]): r for r in runs
           if r["status"] == "done" and (r["layers"], r["warmup"]) == (48, 20)}
    scale = row[("post_budget_scale", 1e-3, 0)]
    assert f"seed 0: **{scale['min_c']:.7f}**" in doc and not scale["collapsed"]
    assert min(row[("post_budget_scale", 1e-3, s)]["min_c"] for s in range(3)) > 0.89999
    low = sorted(row[("post_budget_scale", 3e-3, s)]["min_c"] for s in range(3))
    assert f"{low[0]:.3f}–{low[-1]:.3f}" in doc
    # the grid's prose, 96 layers and warmup 100, from its cells and runs
    deepnorm = grid[("deepnorm", 96, 1e-3, 20)]
    assert (f"only **DeepNorm** learns, at {loss('deepnorm', 96, 1e-3, 20)} "
            f"(+{deepnorm['gap_to_pre']:.3f} to Pre-Norm)") in flat
    assert (f"**Mix-LN** ({loss('mixln', 96, 1e-3, 20)}) and the **adaptive placement** "
            f"({loss('adaptive', 96, 1e-3, 20)})") in flat
    assert f"{loss('post', 48, 1e-3, 100)} (lr 1e-3) and {loss('post', 48, 3e-3, 100)} (lr 3e-3)" \
        in flat
    post_long = [r for r in runs if r["method"] == "post" and r["status"] == "done"
                 and (r["layers"], r["warmup"]) == (48, 100)]
    assert (f"the rule calls {sum(not r['collapsed'] for r in post_long)} of its "
            f"{len(post_long)} runs not collapsed") in flat
    assert f"Pre-Norm is at {loss('pre', 48, 1e-3, 100)} and {loss('pre', 48, 3e-3, 100)}" in flat
    mixln_long = {lr: grid[("mixln", 48, lr, 100)]["gap_to_pre"] for lr in (1e-3, 3e-3)}
    assert (f"Mix-LN gains the most: {loss('mixln', 48, 3e-3, 100)} at lr 3e-3 "
            f"({loss('mixln', 48, 3e-3, 20)} at warmup 20), a gap of +{mixln_long[3e-3]:.3f}, and "
            f"{loss('mixln', 48, 1e-3, 100)} at 1e-3 (+{mixln_long[1e-3]:.3f})") in flat
    assert max(mixln_long.values()) < 0.05
    # 24 layers: Post-Norm's collapse at lr 3e-3 and its long warmup at lr 1e-3
    assert (f"{loss('post', 24, 3e-3, 20)}, +{grid[('post', 24, 3e-3, 20)]['gap_to_pre']:.3f} to "
            f"Pre-Norm ({loss('pre', 24, 3e-3, 20)})") in flat
    assert grid[("post", 24, 3e-3, 20)]["collapsed"] >= 1
    assert (f"it ends at {loss('post', 24, 1e-3, 100)}, "
            f"+{grid[('post', 24, 1e-3, 100)]['gap_to_pre']:.3f} to Pre-Norm") in flat
    focus_24 = [grid[(m, 24, lr, w)]["gap_to_pre"] for m in ("mixln", "adaptive")
                for lr in (1e-3, 3e-3) for w in (20, 100)]
    assert max(focus_24) < 0.05  # "within 0.05 of Pre-Norm in every 24-layer cell"
    assert ("(Mix-LN {:+.3f} and {:+.3f} at warmup 20, {:+.3f} and {:+.3f} at warmup 100; adaptive "
            "{:+.3f}, {:+.3f}, {:+.3f}, {:+.3f})").format(
                *[grid[(m, 24, lr, w)]["gap_to_pre"] for m in ("mixln", "adaptive")
                  for w in (20, 100) for lr in (1e-3, 3e-3)]) in flat

    def signed(method, layers, lr, key="gap_to_pre"):
        value = grid[(method, layers, lr, 20)][key]
        return ("−" if value < 0 else "+") + f"{abs(value):.3f}"

    # 12 layers: no Post-Norm run collapses; sandwich and Peri-LN end behind Post-Norm itself
    assert not any(r["collapsed"] for r in runs if r["method"] == "post" and r["layers"] == 12)
    assert (f"{loss('post', 12, 1e-3, 20)} at lr 1e-3 ({signed('post', 12, 1e-3)} to Pre-Norm's "
            f"{loss('pre', 12, 1e-3, 20)}) and {loss('post', 12, 3e-3, 20)} at 3e-3 "
            f"({signed('post', 12, 3e-3)}; Pre-Norm {loss('pre', 12, 3e-3, 20)})") in flat
    for method, name in (("mixln", "Mix-LN"), ("adaptive", "adaptive placement"),
                         ("sandwich", "sandwich"), ("periln", "Peri-LN")):
        assert f"{name} ({signed(method, 12, 1e-3)}, {signed(method, 12, 3e-3)})" in flat
    behind = [signed(m, 12, lr, "gap_to_post") for m in ("sandwich", "periln")
              for lr in (1e-3, 3e-3)]
    assert (f"({behind[0]}/{behind[1]} and {behind[2]}/{behind[3]} to Post-Norm)" in flat
            and all(b.startswith("+") for b in behind))


def test_the_paper_width_section_matches_its_outputs():
    """docs/RESULTS.md's paper-width section, from docs/figures/paper_width48."""
    figures = REPO / "docs" / "figures" / "paper_width48"
    summary = json.loads((figures / "summary.json").read_text())
    runs = {r["run"]: r for r in summary["runs"]}
    thm38 = {r["run"]: r for r in summary["thm38"]}
    post, pre = runs["post_seed0"], runs["pre_seed0"]
    assert (post["collapsed"], post["collapse_step"], post["window"]) == (True, 290, [10, 290])
    assert not pre["collapsed"]
    doc = (REPO / "docs" / "RESULTS.md").read_text()
    rows = {name: next(line for line in doc.splitlines()
                       if line.startswith(f"| {name}, seed 0 | {r['loss_over_lfreq']:.3f} |"))
            for name, r in (("post", post), ("pre", pre))}
    for name, run in (("post", post), ("pre", pre)):
        t = thm38[f"{name}_seed0"]
        assert (f"| **{t['next_loss_over_lfreq']:.3f}** | {t['next_loss_over_floor']:.3f} | "
                f"{run['eval_loss_over_floor']:.3f} | "
                f"{run['fraction_tsim_ge_0.99_final']:.0%} |") in rows[name]
        assert t["bound_holds_fraction"] == 1.0
    early = post["grad_ratio_early"]
    assert (f"{min(early):.1e}–{max(early):.1e}× down | {post['grad_ratio_last']:.0f}× down"
            .replace("e+", "e")) in rows["post"]
    assert f"**{post['train_wall_s']:,.0f} s (Post) and {pre['train_wall_s']:,.0f} s (Pre)**" \
        in doc
    assert f"{summary['wall']['invocation_s']:,.0f} s for the whole invocation" in doc
    decay = {r["method"]: r for r in json.loads(
        (figures / "backward_decay" / "summary.json").read_text())["runs"]}
    post_d, pre_d = decay["post"], decay["pre"]
    assert post_d["vanished"][-1] == 47 and len(post_d["dldx_last"]) == 97
    assert f"**{post_d['rate'][-1]:.3f} ± {post_d['rate_stderr'][-1]:.3f} per sublayer**" in doc
    assert f"median of {post_d['ratio_over_c_quantiles']['p50']:.2f}" in doc
    assert f"decay is {pre_d['rate'][-1]:.3f} ± {pre_d['rate_stderr'][-1]:.3f}" in doc
    similar = post_d["similarity"]
    assert similar["similar_layers"] == list(range(8, 48)) and similar["attn_other"] == 0.0
    assert f"gradients of\n  {similar['attn_similar']:.1e}".replace("e-0", "e-") in doc
    assert f"ε is {thm38['post_seed0']['mean_eps']:.1e}".replace("e-0", "e-") in doc


def test_the_repair_section_matches_its_runs():
    """docs/METHODS.md's gradient-repair table, from docs/figures/repair and the runs' archive
    records (the fresh-batch loss)."""
    summary = json.loads((REPO / "docs" / "figures" / "repair" / "summary.json").read_text())
    doc = (REPO / "docs" / "METHODS.md").read_text()
    names = {"adamw": "AdamW", "sgd": "SGD + momentum"}
    plain = {}
    for row in summary["runs"]:
        run_id = run_name({**FIELDS, "model.n_layers": row["n_layers"],
                           "opt.optimizer": row["optimizer"], "opt.lr": row["lr"],
                           "train.grad_repair": row["repair"], "seed": row["seed"]})
        record = json.loads((REPO / "docs" / "training_methods" / "runs" / f"{run_id}.json")
                            .read_text())
        assert record["measures"]["fresh_loss_over_lfreq"] == row["fresh_loss_over_lfreq"]
        early = row["update_norm_early"][-1]
        key = (row["optimizer"], row["n_layers"])
        ratio = "" if not row["repair"] else f"{early / plain[key]:.3g}×"
        plain.setdefault(key, early)
        line = (f"| {names[row['optimizer']]}, {row['n_layers']} layers | "
                f"{'on' if row['repair'] else 'off'} | {'yes' if row['collapsed'] else 'no'} | "
                f"{row['fraction_tsim_ge_0.99_last']:.0%} | {row['fresh_loss_over_lfreq']:.3f} | "
                f"{early:.2e} |{f' {ratio} ' if ratio else ' '}|").replace("e-0", "e-")
        assert line in doc, line
    assert len(summary["runs"]) == 6 and len(summary["pairs"]) == 3
    runs = {(r["optimizer"], r["n_layers"], r["repair"]): r for r in summary["runs"]}
    on, off = runs[("adamw", 48, True)], runs[("adamw", 48, False)]
    assert (f"cosine {on['repair_cos_all_last']:.3f} over every parameter, at least\n  "
            f"{on['repair_cos_last_min']:.3f} per layer") in doc
    share = [r["update_norm_early"][-1] / r["update_norm_late"][-1] for r in (on, off)]
    assert f"({share[0]:.2f} of theirs, against {share[1]:.3f} without)" in doc
    assert runs[("sgd", 48, True)]["true_dldx_vanished_early"] == 4
    off96 = runs[("adamw", 96, False)]
    assert (f"update by {off['update_norm_early'][-1]:.2e} per step at step 300; AdamW's "
            f"decoupled\n  decay step alone, lr · λ · ‖W‖ over their decayed matrices, is "
            f"{off['decay_only_update_early']:.2e} there (at 96 layers\n  "
            f"{off96['update_norm_early'][-1]:.2e} and {off96['decay_only_update_early']:.2e}"
            ).replace("e-0", "e-") in doc
    falls = [f"{r['true_dldx_first_over_last_early']:.1e}".replace("e+0", "e")
             for r in (off, off96)]
    assert f"fell {falls[0]}× (48 layers) and {falls[1]}× (96)" in doc


def test_the_training_methods_tables_are_their_archives_tabulated(tmp_path):
    """docs/METHODS.md's monitor and regulariser tables are rows of the committed
    docs/figures/training_methods/summary.md, which the command beside them rebuilds from the
    two archives alone."""
    figures = REPO / "docs" / "figures" / "training_methods"
    table = (figures / "summary.md").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "experiments.training_methods", f"--out_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=subprocess_env(None))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_text_matches((tmp_path / "summary.md").read_text(), table)
    doc = (REPO / "docs" / "METHODS.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith(
        ("| monitor |", "| regulariser |", "| z_loss |", "| controls |"))]
    assert len(rows) >= 4 and all(row in table.splitlines() for row in rows)
    settings = {e["setting"]: e for e in
                json.loads((figures / "summary.json").read_text())["settings"]}
    gap = {action: settings[f"post_layers48_adamw_lr0.001_monitor-{action}-rollback"]
           for action in ("lr_scale", "layer_lr", "clip")}
    assert all(e["done"] == 3 and e["gap_to_control"] is not None for e in gap.values())
    assert (f"({gap['layer_lr']['gap_to_control']:+.3f} and {gap['clip']['gap_to_control']:+.3f} "
            f"on average), and `lr_scale` above it ({gap['lr_scale']['gap_to_control']:+.3f})"
            ) in " ".join(doc.split())
    rescued = [e for e in gap.values() for loss in e["fresh_loss_over_lfreq"] if loss < 0.95]
    assert not rescued and "**No action rescues the run on any seed.**" in doc
    not_collapsed = sum(e["done"] - e["collapsed"] for e in gap.values())
    words = {3: "three", 4: "four"}
    assert f"The rule calls {words[not_collapsed]} of the nine runs not collapsed" in doc
    # the regulariser and the z-loss: paired gaps, the collapses, D at the end
    post, pre = "post_layers48_adamw_lr0.001", "pre_layers48_adamw_lr0.001"
    flat = " ".join(doc.split())
    for name in (f"{post}_diversity0.1", f"{post}_diversity0.3", f"{pre}_diversity0.1",
                 f"{pre}_diversity0.3", f"{post}_zloss0.0001"):
        assert settings[name]["done"] == 3
        assert f"{settings[name]['gap_to_control']:+.3f}" in flat
    regularised = [settings[f"{post}_diversity{w}"] for w in ("0.1", "0.3")]
    assert sum(e["collapsed"] for e in regularised) == 5 and "five of the six runs collapse" in flat
    assert all(d is None or d < 5e-4 for e in regularised for d in e["final_diversity"])
    for weight, text in (("0.1", "0.55–0.60"), ("0.3", "0.70–0.75")):
        d = settings[f"{pre}_diversity{weight}"]["final_diversity"]
        assert f"{min(d):.2f}–{max(d):.2f}" == text and text in flat


def test_every_method_trains_on_the_blocked_kernel_as_on_the_cpp_one():
    """docs/METHODS.md's kernel check: each blocked-kernel record against the leaderboard's
    record of the same method, lr 3e-3, seed 0 (the C++ kernel)."""
    blocked = sorted((REPO / "docs" / "leaderboard" / "blocked").glob("*.json"))
    assert len(blocked) == 18
    gaps = {}
    for path in blocked:
        run = json.loads(path.read_text())
        assert run["config"]["model"]["attention"] == "blocked"
        cpp = json.loads((LEADERBOARD / "runs" / path.name.replace("_blocked", "")).read_text())
        assert cpp["config"]["model"]["attention"] in ("auto", "cpu")
        for record in (run["result"], cpp["result"]):
            assert (record["status"], record["skipped_steps"], record["rollbacks"]) == \
                ("done", 0, 0)
        assert run["result"]["collapse"]["collapsed"] == cpp["result"]["collapse"]["collapsed"]
        gaps[path.name.split("_layers")[0]] = abs(run["result"]["train_loss_over_lfreq"]
                                                  - cpp["result"]["train_loss_over_lfreq"])
    wide = {"mixln", "sandwich", "periln"}
    assert max(gaps.values()) < 0.0155 and max(gaps[m] for m in gaps if m not in wide) < 0.003
    assert f"{max(gaps.values()):.3f} (Mix-LN, sandwich and Peri-LN" in \
        " ".join((REPO / "docs" / "METHODS.md").read_text().split())


def test_a_config_trained_in_two_archives_gives_the_same_run():
    """docs/LEADERBOARD.md's determinism claim: every config archived both by the leaderboard and
    by the training-time study (other sittings, other commits) has the same record and measures
    but for its wall time."""
    by_digest = collections.defaultdict(list)
    for archive in ("leaderboard", "training_methods"):
        for path in (REPO / "docs" / archive / "runs").glob("*.json"):
            run = json.loads(path.read_text())
            by_digest[run["result"]["config_digest"]].append(run)
    pairs = [runs for runs in by_digest.values() if len(runs) > 1]
    assert len(pairs) >= 2
    timing = {"finished_at", "wall_s", "resumed_from_step"}
    for first, second in pairs:
        assert first["config"] == second["config"]
        # a field one record lacks is one its commit did not keep yet (postnorm.sweep.record)
        shared = (first["result"].keys() & second["result"].keys()) - timing
        assert {"final_train_loss", "collapse", "diag_steps", "lfreq"} <= shared
        assert {k: first["result"][k] for k in shared} == {k: second["result"][k] for k in shared}
        assert first["measures"] == second["measures"]
    assert f"{len(pairs)} configs trained in both" in " ".join(
        (REPO / "docs" / "LEADERBOARD.md").read_text().split())
