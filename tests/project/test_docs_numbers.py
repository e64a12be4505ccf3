"""Numbers the docs cite, against the committed outputs of the commands beside them."""

import collections
import csv
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

from configs.default import get_config
from configs.sweeps.leaderboard import method_variants
from configs.sweeps.training_methods import FIELDS, run_name
from postnorm.data import load_data
from postnorm.diagnostics.early_warning import DEFAULT_RULE
from tests.committed import REL_TOL, assert_json_matches, assert_text_matches
from tests.data.test_lm_data import independent_lfreq, train_texts
from tests.reliability_helpers import REPO, subprocess_env

EARLY_WARNING = REPO / "results" / "figures" / "early_warning"


def test_the_early_warning_table_matches_its_replays():
    """docs/DIAGNOSTICS.md quotes the totals line of each replay of the first 12 leaderboard
    runs; each line is its file's rows counted again, and the rows are the replay's JSON."""
    doc = (REPO / "docs" / "DIAGNOSTICS.md").read_text()
    runs = json.loads((EARLY_WARNING / "replay_leaderboard_partial.json").read_text())["runs"]
    by_cell = {(r["method"], f"{r['lr']:g}"): r for r in runs if r["finished"]}
    first_warn = {}
    for name in ("replay_leaderboard_partial.md", "replay_leaderboard_partial_persistence2.md"):
        lines = (EARLY_WARNING / name).read_text().strip().splitlines()
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]
                if line.startswith("|")]
        assert {(r[0], r[2]) for r in rows} == set(by_cell)
        for method, _, lr, _, _, collapsed, step, watch, warn, *_ in rows:
            run = by_cell[(method, lr)]
            # the collapse verdict and the watch level do not depend on the persistence
            assert (collapsed, step, watch) == (
                "yes" if run["collapsed"] else "no",
                *("–" if run[k] is None else str(run[k]) for k in ("collapse_step", "first_watch")))
            first_warn.setdefault(name, {})[(method, lr)] = None if warn == "–" else int(warn)
        collapsing = [r for r in rows if r[5] == "yes"]
        leads = [int(r[9]) for r in collapsing if r[9] != "–" and int(r[9]) > 0]
        alarms = sum(r[11] == "yes" for r in rows if r[5] == "no")
        persistence = int(re.search(r"for (\d+) diagnostic steps", lines[-1]).group(1))
        assert lines[-1].startswith(
            f"{len(collapsing)} collapsing runs: {len(leads)} warned before the collapse step, "
            f"lead time {min(leads)}-{max(leads)} steps; {len(rows) - len(collapsing)} runs that "
            f"did not collapse: {alarms} false alarms (warn). Rule: tsim >= 0.99 in >= 50% of "
            f"the layers for {persistence} diagnostic steps")
        assert lines[-1] in doc, name
    # the default's rows are the JSON's, and a shorter persistence never warns later
    default = first_warn["replay_leaderboard_partial.md"]
    assert default == {cell: r["first_warn"] for cell, r in by_cell.items()}
    for cell, warn in first_warn["replay_leaderboard_partial_persistence2.md"].items():
        assert default[cell] is None or (warn is not None and warn <= default[cell])


def test_the_leaderboard_archive_replay_is_the_archive_replayed(tmp_path):
    """results/figures/early_warning/replay_leaderboard_archive.{md,json}, which DIAGNOSTICS.md
    cites, are what the command beside it gives from the committed archive: every archived
    run, replayed."""
    result = subprocess.run(
        [sys.executable, "-m", "experiments.early_warning", "--archive=results/leaderboard/runs",
         f"--out={tmp_path / 'replay.md'}", f"--json={tmp_path / 'replay.json'}"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=subprocess_env(None))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_text_matches((tmp_path / "replay.md").read_text(),
                        (EARLY_WARNING / "replay_leaderboard_archive.md").read_text())
    committed = json.loads((EARLY_WARNING / "replay_leaderboard_archive.json").read_text())
    assert_json_matches(json.loads((tmp_path / "replay.json").read_text()), committed)
    archived = [json.loads(p.read_text()) for p in (REPO / "results" / "leaderboard" / "runs")
                .glob("*.json")]
    # every run that trained its steps (a run stopped on a non-finite step has no end to replay)
    assert len(committed["runs"]) == sum(a["result"]["status"] == "done" for a in archived)
    assert all(r["finished"] for r in committed["runs"])


def _decay_table(figures) -> list[str]:
    """The per-run table of an ``experiments.backward_decay`` summary.md, each row checked
    against the summary.json beside it."""
    runs = json.loads((figures / "summary.json").read_text())["runs"]
    text = (figures / "summary.md").read_text()
    section = text.split("## Per run", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(runs)

    def quantiles(q):
        return f"{q['p50']:.3f} [{q['p5']:.3f}, {q['p95']:.3f}]"

    def pair(s, a, b):
        return " / ".join("–" if s.get(k) is None else f"{s[k]:.3g}" for k in (a, b))

    for run, line in zip(runs, lines[2:], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        s = run["similarity"]
        assert cells[:2] == [run["norm"], str(run["n_layers"])]
        assert cells[4] == ("yes" if run["collapsed"] else "no")
        expected = [f"{run['rate'][-1]:.4f} ± {run['rate_stderr'][-1]:.4f}",
                    quantiles(run["ratio_quantiles"]), quantiles(run["ratio_over_c_quantiles"]),
                    f"{run['dldx_last'][0] / run['dldx_last'][-1]:.3g}",
                    str(len(s["similar_layers"])), pair(s, "attn_similar", "attn_other"),
                    pair(s, "attn_similar_reference", "attn_other_reference")]
        assert all(e in cells for e in expected), (line, expected)
    return lines


def _includes_table(doc: str, lines: list[str]) -> None:
    start = doc.index(lines[0])
    assert doc[start:].splitlines()[:len(lines)] == lines


def test_the_backward_decay_section_matches_its_json():
    """docs/RESULTS.md's Theorem 3.6 / 3.8(ii) section includes the per-run table of
    results/figures/backward_decay/summary.md, whose rows are its summary.json."""
    figures = REPO / "results" / "figures" / "backward_decay"
    _includes_table((REPO / "docs" / "RESULTS.md").read_text(), _decay_table(figures))
    runs = json.loads((figures / "summary.json").read_text())["runs"]
    for run in runs:
        similar = run["similarity"]["similar_layers"]
        # the layers at tsim >= 0.99 are the deep ones, a contiguous top of the stack
        assert similar == list(range(run["n_layers"] - len(similar), run["n_layers"]))
        assert bool(similar) == run["collapsed"] == (run["norm"] == "post")


def _report_only(module: str, committed, tmp_path, table: str) -> str:
    """``table`` as ``python -m <module> --report_only`` rewrites it from a copy of the committed
    summary.json, checked against the committed file, which is returned."""
    out = tmp_path / committed.name
    out.mkdir()
    shutil.copy(committed / "summary.json", out)
    result = subprocess.run([sys.executable, "-m", module, f"--out_dir={out}", "--report_only"],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=subprocess_env(None))
    assert result.returncode == 0, result.stderr[-3000:]
    text = (committed / table).read_text()
    assert_text_matches((out / table).read_text(), text)
    return text


def _delta_attn(s, t, n):
    """Thm 3.2's closed form (docs/MATH.md §1b), written out again."""
    h_n = np.sum(1.0 / np.arange(1, n + 1))
    f1 = (1 - t) * (t + 1 / n) * (n - h_n) / (n - 1)
    f2 = t + (1 - t) * (h_n - 1) / (n - 1)
    return s * f1 / (1 + s * f2)


def test_theorem_32_and_34_table_is_the_stage1_summary_tabulated(tmp_path):
    """docs/THEORY.md includes results/figures/stage1/theory_table.md verbatim, which
    ``experiments.init_similarity --report_only`` rewrites from summary.json; the summary's
    amounts are the init's closed forms, and its errors those of the per-layer layers.csv."""
    stage1 = REPO / "results" / "figures" / "stage1"
    table = _report_only("experiments.init_similarity", stage1, tmp_path, "theory_table.md")
    assert table.strip() in (REPO / "docs" / "THEORY.md").read_text()
    summary = json.loads((stage1 / "summary.json").read_text())
    # torch_default at d = 512, d_ff = 1536: every entry variance 1/(3 d_in), so s = xi = 1/9,
    # a = 1/sqrt(3), and xi m(1) = xi E[SiLU(a u)^2] by Gauss-Hermite quadrature
    u, w = np.polynomial.hermite_e.hermegauss(120)
    a = 1 / np.sqrt(3)
    silu = a * u / (1 + np.exp(-a * u))
    m1 = np.sum(w * silu**2) / np.sqrt(2 * np.pi)
    assert [summary["amounts"][k] for k in ("s", "xi", "a", "xi_m1")] == pytest.approx(
        [1 / 9, 1 / 9, a, m1 / 9], rel=1e-6)
    layers = collections.defaultdict(lambda: collections.defaultdict(list))
    with open(stage1 / "layers.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("norm", "input", "layer") and value:
                    layers[f"{row['norm']}/{row['input']}"][key].append(float(value))
    assert set(layers) == set(summary["figures"])
    for setting, fig in summary["figures"].items():
        col = {k: np.asarray(v) for k, v in layers[setting].items()}
        # the closed form at (t, s_nominal), recomputed from the layer's seed-mean t and
        # s_nominal: the CSV holds the mean over seeds (real inputs: sequences of different
        # tsim) of each seed's closed form, hence 1%
        np.testing.assert_allclose(col["d_attn_closed_s_nominal"],
                                   _delta_attn(col["s_nominal"], col["t_attn"], 2048), rtol=1e-2)
        # each error of the summary is its layers' relative error
        for key, measured, reference in (
                ("attn_pm_vs_closed_s_nominal", "d_attn_pm", "d_attn_closed_s_nominal"),
                ("attn_pm_vs_exact_s_nominal", "d_attn_pm", "d_attn_exact_s_nominal"),
                ("attn_exact_vs_closed_s_nominal", "d_attn_exact_s_nominal",
                 "d_attn_closed_s_nominal"),
                ("ffn_pm_vs_closed", "d_ffn_pm", "d_ffn_closed")):
            rel = col[measured] / col[reference] - 1
            assert fig[key]["worst_layer"] == int(np.argmax(np.abs(rel))), (setting, key)
            assert fig[key]["mean_abs_rel_err"] == pytest.approx(np.mean(np.abs(rel)), abs=1e-4)
            assert fig[key]["layers_beyond_10pct"] == int(np.sum(np.abs(rel) > 0.1))
        assert fig["tsim_final"] == pytest.approx(col["t_out"][-1], rel=1e-5)
        assert fig["s_nominal_first"] == pytest.approx(col["s_nominal"][0], rel=1e-5)


def test_the_paper_width_and_three_seed_tables_are_their_summaries_tabulated(tmp_path):
    """docs/RESULTS.md includes the table.md of results/figures/collapse3 and paper_width48
    verbatim, which ``experiments.collapse --report_only`` rewrites from each summary.json;
    each summary's ratios are its losses', Theorem 3.8's bound is its formula, and the
    paper-width Theorem 3.6 table is its backward_decay JSON."""
    doc = (REPO / "docs" / "RESULTS.md").read_text()
    for name in ("collapse3", "paper_width48"):
        figures = REPO / "results" / "figures" / name
        table = _report_only("experiments.collapse", figures, tmp_path, "table.md")
        assert table.strip() in doc, name
        summary = json.loads((figures / "summary.json").read_text())
        for run in summary["runs"]:
            assert run["loss_over_lfreq"] == pytest.approx(
                run["final_train_loss"] / run["lfreq"], rel=REL_TOL)
            assert run["loss_over_floor"] == pytest.approx(
                run["final_train_loss"] / run["final_train_floor"], rel=REL_TOL)
            assert run["collapsed"] == run["run"].startswith("post")
        for t in summary["thm38"]:
            # (i): L_freq(p_hat) - (2/sqrt(n)) ||W_lm||_2 eps, linear in eps, so also in the means
            assert t["mean_bound"] == pytest.approx(
                t["mean_lfreq_seq"] - 2 / np.sqrt(t["n"]) * t["w_lm_spectral_norm"]
                * t["mean_eps"], rel=1e-9, abs=1e-9)
            assert t["bound_holds_fraction"] == 1.0 and t["min_slack"] >= 0
            assert t["next_loss_over_lfreq"] == pytest.approx(t["next_loss"] / t["next_lfreq"],
                                                              rel=REL_TOL)
    figures = REPO / "results" / "figures" / "paper_width48"
    _includes_table(doc, _decay_table(figures / "backward_decay"))
    decay = {r["method"]: r for r in json.loads(
        (figures / "backward_decay" / "summary.json").read_text())["runs"]}
    post = decay["post"]
    # the taps that read exactly 0 are the bottom of the stack, and cover every layer below the
    # alike ones, whose attention gradients are then exactly 0 too
    vanished = post["vanished"][-1]
    assert all(g == 0 for g in post["dldx_last"][:vanished])
    assert all(g > 0 for g in post["dldx_last"][vanished:])
    similar = post["similarity"]["similar_layers"]
    assert similar == list(range(post["n_layers"] - len(similar), post["n_layers"]))
    assert 2 * similar[0] <= vanished and post["similarity"]["attn_other"] == 0.0


def test_the_stability_map_replay_matches_its_json():
    """docs/DIAGNOSTICS.md quotes the totals line of the stability map's two replays (the map's
    cells, and its last cell trained on its own); each is its JSON counted again, and together
    they cover the map."""
    doc = (REPO / "docs" / "DIAGNOSTICS.md").read_text()
    cells = []
    for name in ("replay_stability_partial", "replay_stability_last_cell"):
        runs = [r for r in json.loads((EARLY_WARNING / f"{name}.json").read_text())["runs"]
                if r["finished"]]
        cells += [(r["method"], r["n_layers"], r["lr"]) for r in runs]
        collapsing = [r for r in runs if r["collapsed"]]
        leads = [r["lead_steps"] for r in collapsing if not r["missed"]]
        quiet = [r for r in runs if not r["collapsed"]]
        lead = f"{min(leads)}-{max(leads)} steps" if leads else "none"
        totals = (EARLY_WARNING / f"{name}.md").read_text().strip().splitlines()[-1]
        assert totals.startswith(
            f"{len(collapsing)} collapsing runs: {len(leads)} warned before the collapse step, "
            f"lead time {lead}; {len(quiet)} runs that did not collapse: "
            f"{sum(r['false_alarm'] for r in quiet)} false alarms (warn).")
        assert totals in doc, name
    # the whole map, once: Post and Pre at 12, 24, 48 layers and lr 3e-4, 1e-3, 3e-3
    assert sorted(cells) == sorted((m, n, lr) for m in ("post", "pre") for n in (12, 24, 48)
                                   for lr in (3e-4, 1e-3, 3e-3))
    # no 12-layer or Pre-Norm run raised a warn
    runs = [r for name in ("replay_stability_partial.json", "replay_stability_last_cell.json")
            for r in json.loads((EARLY_WARNING / name).read_text())["runs"]]
    assert all(r["first_warn"] is None for r in runs if r["method"] == "pre" or r["n_layers"] == 12)


def test_the_batch_floor_table_is_its_summary_tabulated(tmp_path):
    """docs/RESULTS.md includes results/figures/batch_floors/table.md verbatim, which
    ``experiments.batch_floors --report_only`` rewrites from summary.json; the summary's
    statistics are its per-step floors', and those floors are the batches' unigram
    cross-entropy, recomputed here from the data pipeline's batches and a sentencepiece
    encoding of the training documents."""
    figures = REPO / "results" / "figures" / "batch_floors"
    table = _report_only("experiments.batch_floors", figures, tmp_path, "table.md")
    assert table.strip() in (REPO / "docs" / "RESULTS.md").read_text()
    summary = json.loads((figures / "summary.json").read_text())
    steps = summary["steps"]
    for seed in summary["seeds"].values():
        floors = np.asarray(seed["floors"])
        assert len(floors) == steps
        assert [seed[k] for k in ("mean", "sd", "min", "max", "mean_last_logged")] == \
            pytest.approx([floors.mean(), floors.std(ddof=1), floors.min(), floors.max(),
                           floors[np.asarray(seed["last_logged_steps"]) - 1].mean()],
                          rel=REL_TOL)
        # one batch's floor varies more than the collapse rule's tolerance around L_freq
        assert seed["sd"] > DEFAULT_RULE.loss_rtol * summary["lfreq"]
    # the unigram distribution of the training targets: every document's tokens and its EOS
    config = get_config()
    data = load_data(config.data, seed=1)
    sp = spm.SentencePieceProcessor(model_file=data.info["tokenizer"]["path"])
    texts = train_texts(data)
    stream = np.concatenate([np.append(ids, sp.eos_id()) for ids in sp.encode(texts)])
    tokens, counts = np.unique(stream, return_counts=True)
    neg_log_p = dict(zip(tokens.tolist(), (-np.log(counts / counts.sum())).tolist(),
                         strict=True))
    assert summary["data"] == {"fingerprint": data.fingerprint, "vocab_size": sp.get_piece_size(),
                               "corpus_bytes": data.info["corpus_bytes"]}
    assert summary["lfreq"] == pytest.approx(independent_lfreq(texts, sp.encode, sp.eos_id()),
                                             rel=1e-9)
    # data order 1 (not the default 0): the first two batches and the last
    batches = data.train_iterator(batch_size=config.data.batch_size, seed=1)
    for step, batch in enumerate(batches, start=1):
        if step in (1, 2, steps):
            targets = np.asarray(batch["targets"]).ravel().tolist()
            assert summary["seeds"]["1"]["floors"][step - 1] == pytest.approx(
                np.mean([neg_log_p[t] for t in targets]), rel=1e-9), step
        if step == steps:
            break


def test_the_stability_pivot_is_its_summary_tabulated(tmp_path):
    """docs/RESULTS.md includes results/figures/stability/pivot.md verbatim, which
    ``experiments.sweep --from_summary`` rewrites from summary.json; each cell's verdict and
    collapse step are the replays' of the map's runs, the (48, 1e-3) cells are the three-seed
    study's seed-0 runs, and the prose's reading of the map holds."""
    figures = REPO / "results" / "figures" / "stability"
    out = tmp_path / "stability"
    out.mkdir()
    shutil.copy(figures / "summary.json", out)
    result = subprocess.run([sys.executable, "-m", "experiments.sweep", f"--out_dir={out}",
                             "--from_summary"], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env=subprocess_env(None))
    assert result.returncode == 0, result.stderr[-3000:]
    pivot = (figures / "pivot.md").read_text()
    assert_text_matches((out / "pivot.md").read_text(), pivot)
    assert pivot.strip() in (REPO / "docs" / "RESULTS.md").read_text()
    rows = {(r["model.norm"], r["model.n_layers"], r["opt.lr"]): r
            for r in json.loads((figures / "summary.json").read_text())}
    assert len(rows) == 18 and all(r["status"] == "done" for r in rows.values())
    for r in rows.values():
        assert r["loss_over_lfreq"] == pytest.approx(r["final_train_loss"] / r["lfreq"],
                                                     rel=REL_TOL)
    replays = [r for name in ("replay_stability_partial", "replay_stability_last_cell")
               for r in json.loads((EARLY_WARNING / f"{name}.json").read_text())["runs"]]
    assert sorted((r["method"], r["n_layers"], r["lr"]) for r in replays) == sorted(rows)
    for r in replays:
        row = rows[(r["method"], r["n_layers"], r["lr"])]
        assert (row["collapsed"], row["collapse_step"]) == (r["collapsed"], r["collapse_step"])
    three_seeds = {r["run"]: r for r in json.loads(
        (REPO / "results" / "figures" / "collapse3" / "summary.json").read_text())["runs"]}
    for norm in ("post", "pre"):
        # the same run, its loss averaged in float32 there and float64 here
        run, row = three_seeds[f"{norm}_seed0"], rows[(norm, 48, 1e-3)]
        assert row["final_train_loss"] == pytest.approx(run["final_train_loss"], rel=1e-6)
        assert row["collapse_step"] == run["collapse_step"]
    lrs, depths = (3e-4, 1e-3, 3e-3), (12, 24, 48)
    # Post collapses only at high depth and lr (a collapsed cell's deeper and higher-lr
    # neighbours collapse too), Pre never, and a higher lr always lowers Pre's loss
    for (norm, n, lr), r in rows.items():
        assert not (r["collapsed"] and norm == "pre")
        if r["collapsed"]:
            assert all(rows[(norm, m, x)]["collapsed"] for m in depths for x in lrs
                       if m >= n and x >= lr)
    assert any(r["collapsed"] for r in rows.values())
    for n in depths:
        losses = [rows[("pre", n, lr)]["loss_over_lfreq"] for lr in lrs]
        assert losses == sorted(losses, reverse=True)
    # at 12 layers Post and Pre train alike: closer than any lr step moves either
    for lr in lrs:
        gap = abs(rows[("post", 12, lr)]["loss_over_lfreq"] - rows[("pre", 12, lr)]
                  ["loss_over_lfreq"])
        assert all(gap < abs(rows[(norm, 12, a)]["loss_over_lfreq"]
                             - rows[(norm, 12, b)]["loss_over_lfreq"])
                   for norm in ("post", "pre") for a, b in zip(lrs[:-1], lrs[1:], strict=True))
    # at lr 3e-4 no cell collapses and every one is still above L_freq
    assert all(not rows[(norm, n, 3e-4)]["collapsed"] and rows[(norm, n, 3e-4)]
               ["loss_over_lfreq"] > 1 for norm in ("post", "pre") for n in depths)


LEADERBOARD = REPO / "results" / "leaderboard"


def test_the_committed_leaderboard_is_its_archive_tabulated(tmp_path):
    """The command LEADERBOARD.md gives rebuilds every committed table of results/leaderboard/
    and its JSON from the committed archive alone; the page includes the generated per-method
    and lambda-profile tables verbatim."""
    board = json.loads((LEADERBOARD / "leaderboard.json").read_text())
    table = (LEADERBOARD / "leaderboard.md").read_text()
    doc = (REPO / "docs" / "LEADERBOARD.md").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "experiments.leaderboard", f"--out_dir={tmp_path}",
         "--archive=results/leaderboard/runs", "--sweep=configs/sweeps/leaderboard.py:grid",
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
    assert len(finished) == len(runs)
    # the cost columns: each method's train step over post's in each side-by-side benchmark
    # run that times it, geometric mean over those runs, recomputed from the benchmark files
    variants = method_variants()
    cost_dir = REPO / "results" / "perf" / "methods_cost_amd_zen4"
    assert set(board["costs"]) == set(variants)
    for method, variant in variants.items():
        if method == "post":
            continue
        ratios = []
        for name in (f"{method}.json", f"{method}_reversed.json"):
            bench = json.loads((cost_dir / name).read_text())["variants"]
            ratios.append(bench[variant]["programs"]["train"]["median_s"]
                          / bench[variants["post"]]["programs"]["train"]["median_s"])
        assert board["costs"][method]["step_time_vs_post"] == pytest.approx(
            (ratios[0] * ratios[1]) ** 0.5, rel=REL_TOL)
        assert board["costs"][method]["benchmark_runs"] == 2
    # the generated tables the page includes, and the JSON's verdicts
    for name in ("leaderboard_methods.md", "leaderboard_profiles.md"):
        committed = (LEADERBOARD / name).read_text()
        assert committed.strip() in doc, name
        assert_text_matches((tmp_path / name).read_text(), committed)
    assert_json_matches(json.loads((tmp_path / "leaderboard.json").read_text())["methods"],
                        board["methods"])
    assert all(v["prevented"] in ("yes", "no") and v["meets_goal"] in ("yes", "no")
               for v in board["methods"])
    # every run of a two-way controller records its final profile, and its control ran it
    profiles = {(r["lr"], r["seed"]): r["final_post_mix"] for r in runs
                if r["method"] == "adaptive_two_way"}
    controls = {(r["lr"], r["seed"]) for r in runs if r["method"] == "adaptive_own_profile"}
    assert len(profiles) == 6 and all(len(p) == 48 for p in profiles.values())
    assert controls == set(profiles)
    # so does every one-way run where Post-Norm collapses (48 and 96 layers)
    one_way = [r for r in runs if r["method"] == "adaptive" and r["layers"] >= 48]
    assert len(one_way) == 13
    assert all(len(r["final_post_mix"]) == r["layers"] for r in one_way)


def test_the_repair_section_matches_its_runs():
    """Each run's verdict and fresh-batch loss in results/figures/repair/summary.json are its
    archive record's, its pairs' ratios are its runs', and docs/METHODS.md includes
    summary.md's table of repaired over plain runs verbatim. (experiments.repair_study is not
    imported: its absl flags would clash with other commands' in a test worker.)"""
    figures = REPO / "results" / "figures" / "repair"
    summary = json.loads((figures / "summary.json").read_text())
    committed = (figures / "summary.md").read_text()
    paired = committed.split("## Repaired over plain", 1)[1].splitlines()
    _includes_table((REPO / "docs" / "METHODS.md").read_text(),
                    [line for line in paired if line.startswith("|")])
    runs = {}
    for row in summary["runs"]:
        run_id = run_name({**FIELDS, "model.n_layers": row["n_layers"],
                           "opt.optimizer": row["optimizer"], "opt.lr": row["lr"],
                           "train.grad_repair": row["repair"], "seed": row["seed"]})
        record = json.loads((REPO / "results" / "training_methods" / "runs" / f"{run_id}.json")
                            .read_text())
        assert record["measures"]["fresh_loss_over_lfreq"] == row["fresh_loss_over_lfreq"]
        assert record["result"]["collapse"]["collapsed"] == row["collapsed"]
        runs[(row["optimizer"], row["n_layers"], row["repair"])] = row
    for pair in summary["pairs"]:
        plain, repaired = (runs[(pair["optimizer"], pair["n_layers"], r)] for r in (False, True))
        assert pair["early_update_repaired_over_plain"] == pytest.approx(
            repaired["update_norm_early"][-1] / plain["update_norm_early"][-1], rel=REL_TOL)
    # without repair, the early layers of a collapsed AdamW stack move by the decay step alone
    for layers in (48, 96):
        off = runs[("adamw", layers, False)]
        assert off["update_norm_early"][-1] == pytest.approx(off["decay_only_update_early"],
                                                             rel=0.05)
    # with it the update follows a gradient close to the true one; under SGD the true early
    # gradient underflows; at 96 layers the plain fall is steeper and repair moves less
    assert runs[("adamw", 48, True)]["repair_cos_last_min"] > 0.95
    assert runs[("sgd", 48, True)]["true_dldx_vanished_early"] == DEFAULT_RULE.early_layers
    falls = [runs[("adamw", n, False)]["true_dldx_first_over_last_early"] for n in (48, 96)]
    ratio = {p["n_layers"]: p["early_update_repaired_over_plain"] for p in summary["pairs"]
             if p["optimizer"] == "adamw"}
    assert falls[1] > falls[0] and ratio[96] < ratio[48]


def test_the_training_methods_tables_are_their_archives_tabulated(tmp_path):
    """results/figures/training_methods/summary.md is what the command beside it rebuilds from the
    two archives alone, docs/METHODS.md includes it verbatim, and its JSON holds what the page
    says of the regulariser, the z-loss and the monitor's actions."""
    figures = REPO / "results" / "figures" / "training_methods"
    table = (figures / "summary.md").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "experiments.training_methods", f"--out_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=subprocess_env(None))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_text_matches((tmp_path / "summary.md").read_text(), table)
    assert table.strip() in (REPO / "docs" / "METHODS.md").read_text()
    settings = {e["setting"]: e for e in
                json.loads((figures / "summary.json").read_text())["settings"]}
    post, pre = "post_layers48_adamw_lr0.001", "pre_layers48_adamw_lr0.001"
    # every monitor action ends at the unigram floor, its first warn the plain run's
    for action in ("lr_scale", "layer_lr", "clip"):
        entry = settings[f"{post}_monitor-{action}-rollback"]
        assert entry["done"] == 3 and min(entry["fresh_loss_over_lfreq"]) >= 0.95
        assert entry["first_warn"] == settings[post]["first_warn"]
    # the regulariser: D ends at 0 on Post-Norm, above it on Pre-Norm, where the loss moves
    # by less than the seeds' spread; the z-loss is Post-Norm to three decimals
    for weight in ("0.1", "0.3"):
        assert all(d is None or d < 5e-4
                   for d in settings[f"{post}_diversity{weight}"]["final_diversity"])
        entry = settings[f"{pre}_diversity{weight}"]
        assert min(entry["final_diversity"]) > 0.1
        assert abs(entry["gap_to_control"]) < settings[pre]["fresh_sd"]
    assert abs(settings[f"{post}_zloss0.0001"]["gap_to_control"]) < 5e-4


def test_every_method_trains_on_the_blocked_kernel_as_on_the_cpp_one():
    """docs/METHODS.md's kernel check: each blocked-kernel record against the leaderboard's
    record of the same config on the C++ kernel, found by its config, whatever the files' names."""

    def without_kernel(config: dict) -> str:
        """The config over the schema's defaults (a record written before a field existed
        ran it at its default), its kernel left out."""
        full = get_config().to_dict()
        for section, fields in config.items():
            full[section] = {**full[section], **fields} if isinstance(fields, dict) else fields
        full["model"].pop("attention")
        return json.dumps(full, sort_keys=True)

    cpp_runs = collections.defaultdict(list)
    for path in (LEADERBOARD / "runs").glob("*.json"):
        run = json.loads(path.read_text())
        cpp_runs[without_kernel(run["config"])].append(run)
    blocked = sorted((LEADERBOARD / "blocked").glob("*.json"))
    assert blocked
    for path in blocked:
        run = json.loads(path.read_text())
        assert run["config"]["model"]["attention"] == "blocked"
        [cpp] = cpp_runs[without_kernel(run["config"])]
        assert cpp["config"]["model"]["attention"] in ("auto", "cpu")
        for record in (run["result"], cpp["result"]):
            assert (record["status"], record["skipped_steps"], record["rollbacks"]) == \
                ("done", 0, 0)
        assert run["result"]["collapse"]["collapsed"] == cpp["result"]["collapse"]["collapsed"]
        gap = abs(run["result"]["train_loss_over_lfreq"] - cpp["result"]["train_loss_over_lfreq"])
        # the runs furthest from the floor amplify the two kernels' different summation orders
        wide = run["config"]["model"]["norm"] in ("mixln", "sandwich", "periln")
        assert gap < (0.02 if wide else 0.003), path.name


def test_a_config_trained_in_two_archives_gives_the_same_run():
    """docs/LEADERBOARD.md's determinism claim: every config archived both by the leaderboard and
    by the training-time study (other sittings, other commits) has the same record and measures
    but for its wall time."""
    by_digest = collections.defaultdict(list)
    for archive in ("leaderboard", "training_methods"):
        for path in (REPO / "results" / archive / "runs").glob("*.json"):
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
