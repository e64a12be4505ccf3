"""Every seed-paired interval, equivalence test and verdict the committed results state,
recomputed from the archived run records with an independent formula: scipy.stats's t-interval
and one-sample t-tests (or plain numpy), never ``postnorm.analysis.paired`` or the table code
that wrote them. Compared with the committed JSON (to 1e-9) and markdown (as printed)."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from configs.default import get_config
from configs.sweeps import training_methods
from configs.sweeps.leaderboard import method_label
from tests.paired_reference import scipy_gap
from tests.reliability_helpers import REPO

# docs/PROTOCOL.md, stated before the runs: two losses within this many nats are the same model
MARGIN_NATS = 0.05
ALPHA = 0.05
JSON_TOL = 1e-9
LEADERBOARD = REPO / "results" / "leaderboard"
TRAINING_METHODS = REPO / "results" / "figures" / "training_methods"
# the training methods' table finds a run in the first of these holding its config
ARCHIVES = (REPO / "results" / "training_methods" / "runs", LEADERBOARD / "runs")
# a setting's control: the same norm, depth, optimizer, lr and weight decay, with no remedy
CONTROL_FIELDS = ("model.norm", "model.n_layers", "opt.optimizer", "opt.lr", "opt.weight_decay")


def _records(archive: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(archive.glob("*.json"))]


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _table_rows(markdown: str) -> list[list[str]]:
    """The body rows of the markdown tables in ``markdown`` (no header, no rule), as cells."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    rule = [set(line) <= set("|-") for line in lines]
    return [[c.strip() for c in line.strip("|").split("|")]
            for i, line in enumerate(lines) if not rule[i] and not rule[min(i + 1, len(lines) - 1)]]


def _close(actual: object, expected: object) -> bool:
    """Floats (or lists of them, None alike) within ``JSON_TOL``."""
    if isinstance(expected, list):
        return (isinstance(actual, list) and len(actual) == len(expected)
                and all(_close(a, e) for a, e in zip(actual, expected, strict=True)))
    if expected is None or actual is None:
        return actual is expected
    return abs(actual - expected) <= JSON_TOL


def _paired(d_N: np.ndarray) -> dict:
    """Mean, 95% t-interval, TOST p against ``MARGIN_NATS`` and verdict of paired gaps."""
    n, mean = d_N.size, float(np.mean(d_N))
    if n < 2 or float(np.std(d_N)) == 0:
        return {"n": n, "mean": mean, "ci95": None, "tost_p": None, "verdict": "inconclusive"}
    low, high, tost_p, verdict = scipy_gap(d_N, MARGIN_NATS, ALPHA)
    return {"n": n, "mean": mean, "ci95": [low, high], "tost_p": tost_p, "verdict": verdict}


@pytest.fixture(scope="module")
def leaderboard_gaps() -> dict[tuple, dict]:
    """Per leaderboard cell (method, layers, lr, warmup) with >= 2 seeds finished by it and by
    Pre-Norm, from the archived records: the seed-paired gap of the fresh-batch loss (nats)."""
    fresh_batches = json.loads((LEADERBOARD / "leaderboard.json").read_text())["fresh_batches"]
    loss: dict[tuple, dict[int, float]] = {}
    for record in _records(LEADERBOARD / "runs"):
        measures, config = record.get("measures") or {}, record["config"]
        if record["result"]["status"] != "done" or measures.get("fresh_batches") != fresh_batches:
            continue
        key = (method_label(config), config["model"]["n_layers"], config["opt"]["lr"],
               config["opt"]["warmup_steps"])
        assert config["seed"] not in loss.get(key, {}), f"two records of {key} {config['seed']}"
        loss.setdefault(key, {})[config["seed"]] = measures["fresh_loss"]
    gaps = {}
    for key, by_seed in loss.items():
        pre = loss.get(("pre", *key[1:]), {})
        seeds = sorted(set(by_seed) & set(pre))
        if key[0] != "pre" and len(seeds) >= 2:
            d_N = np.array([by_seed[s] for s in seeds]) - np.array([pre[s] for s in seeds])
            gaps[key] = {"seeds": seeds, **_paired(d_N)}
    return gaps


def test_the_leaderboard_json_pairs_are_their_records(leaderboard_gaps):
    """leaderboard.json's "paired": the same cells as the records allow, each with the records'
    seeds, mean gap, 95% interval, TOST p and verdict."""
    committed = {(g["method"], g["layers"], g["lr"], g["warmup"]): g for g in
                 json.loads((LEADERBOARD / "leaderboard.json").read_text())["paired"]}
    assert set(committed) == set(leaderboard_gaps)
    for key, mine in leaderboard_gaps.items():
        theirs = committed[key]
        assert theirs["margin"] == MARGIN_NATS
        assert (theirs["seeds"], theirs["n"], theirs["verdict"]) == (
            mine["seeds"], mine["n"], mine["verdict"]), key
        for name in ("mean", "ci95", "tost_p"):
            assert _close(theirs[name], mine[name]), (key, name, theirs[name], mine[name])


def test_the_leaderboard_paired_table_is_its_records(leaderboard_gaps):
    """leaderboard_paired.md: one row per cell the records allow, each printing the records'
    seed count, mean gap, 95% interval and verdict, against the 0.05-nat margin."""
    text = (LEADERBOARD / "leaderboard_paired.md").read_text()
    assert f"verdict (margin {MARGIN_NATS:g} nats)" in text.splitlines()[0]
    printed = {(r[0], int(r[1]), r[2], int(r[3])): r for r in _table_rows(text)}
    expected = {}
    for (method, layers, lr, warmup), g in leaderboard_gaps.items():
        ci = "–" if g["ci95"] is None else "[{:+.3f}, {:+.3f}]".format(*g["ci95"])
        expected[(method, layers, f"{lr:g}", warmup)] = [
            method, str(layers), f"{lr:g}", str(warmup), str(g["n"]), f"{g['mean']:+.3f}", ci,
            g["verdict"]]
    assert printed == expected


@pytest.fixture(scope="module")
def training_method_records() -> dict[str, dict | None]:
    """Per planned run id of configs/sweeps/training_methods.py (its groups and controls), the
    record of its config in the first archive holding one; a run id the plan repeats (the
    controls) maps to the same record."""
    default = _flat(json.loads(get_config().to_json_best_effort()))
    archives = [_records(a) for a in ARCHIVES]

    def matches(record: dict, overrides: dict) -> bool:
        recorded = _flat({k: v for k, v in record["config"].items() if k != "runtime"})
        wanted = {**default, **overrides}
        return (all(k in recorded for k in overrides)
                and all(k == "model.attention" or (k in wanted and wanted[k] == v)
                        for k, v in recorded.items()))

    found = {}
    for group in [*training_methods.GROUPS, "controls"]:
        for overrides in training_methods.get_sweep(group):
            found[training_methods.run_name(overrides)] = None
            for records in archives:
                hits = [r for r in records if matches(r, overrides)]
                assert len(hits) <= 1, [r["run_id"] for r in hits]
                if hits:
                    found[training_methods.run_name(overrides)] = hits[0]
                    break
    return found


def _fresh(record: dict | None) -> float | None:
    if record is None or record["result"]["status"] != "done":
        return None
    return (record.get("measures") or {}).get("fresh_loss_over_lfreq")


def test_the_training_methods_gaps_are_their_records(training_method_records):
    """results/figures/training_methods (summary.json, summary.md and its copy in
    docs/METHODS.md): per setting the per-seed fresh-batch loss / L_freq, its mean ± sd, and its
    seed-paired gap to its control's run of the same seed, from the archived records."""
    fields = training_methods.FIELDS
    expected = {}
    for group in [*training_methods.GROUPS, "controls"]:
        settings: dict[str, list[dict]] = {}
        for run in training_methods.get_sweep(group):
            settings.setdefault(re.sub(r"_seed\d+$", "", training_methods.run_name(run)),
                                []).append(run)
        for setting, runs in settings.items():
            runs = sorted(runs, key=lambda r: r["seed"])
            fresh = {r["seed"]: _fresh(training_method_records[training_methods.run_name(r)])
                     for r in runs}
            plain = all(v == fields[k] for k, v in runs[0].items()
                        if k not in (*CONTROL_FIELDS, "seed"))
            gaps = []
            for r in runs:
                control = {**fields, **{k: r[k] for k in CONTROL_FIELDS}, "seed": r["seed"]}
                base = _fresh(training_method_records.get(training_methods.run_name(control)))
                if fresh[r["seed"]] is not None and base is not None:
                    gaps.append(fresh[r["seed"]] - base)
            values = np.array([v for v in fresh.values() if v is not None])
            expected[(group, setting)] = {
                "fresh": list(fresh.values()), "mean": float(values.mean()),
                "sd": float(np.sqrt(np.mean((values - values.mean()) ** 2)))
                if values.size > 1 else None,
                "gap": None if plain or not gaps else float(np.mean(gaps)), "paired": len(gaps)}
    committed = {(s["group"], s["setting"]): s for s in
                 json.loads((TRAINING_METHODS / "summary.json").read_text())["settings"]}
    assert set(committed) == set(expected)
    for key, mine in expected.items():
        theirs = committed[key]
        for name, mine_name in (("fresh_loss_over_lfreq", "fresh"), ("fresh_mean", "mean"),
                                ("fresh_sd", "sd"), ("gap_to_control", "gap")):
            assert _close(theirs[name], mine[mine_name]), (key, name, theirs[name],
                                                           mine[mine_name])
        if mine["gap"] is not None:
            assert theirs["paired_seeds"] == mine["paired"], key
    printed_cells = {
        key: [", ".join("–" if v is None else f"{v:.3f}" for v in mine["fresh"]),
              f"{mine['mean']:.3f}" + ("" if mine["sd"] is None else f" ± {mine['sd']:.3f}"),
              "–" if mine["gap"] is None else f"{mine['gap']:+.3f} ({mine['paired']})"]
        for key, mine in expected.items()}
    for path in (TRAINING_METHODS / "summary.md", REPO / "docs" / "METHODS.md"):
        text = path.read_text()
        table = text[text.index("| group | setting |"):]
        rows = {(r[0], r[1].strip("`")): r[6:9] for r in _table_rows(table.split("\n\n")[0])}
        assert rows == printed_cells, path


def test_the_repair_pairs_collapse_as_their_records(training_method_records):
    """results/figures/repair/summary.md, "Repaired over plain": each pair's collapse verdicts
    (plain, repaired) are its two archived records' (the update-norm ratios beside them come
    from the run directories' per-layer diagnostics, which the records do not keep)."""
    section = (REPO / "results" / "figures" / "repair" / "summary.md").read_text().split(
        "## Repaired over plain", 1)[1]
    rows = _table_rows(section)
    runs = training_methods.get_sweep("repair") + training_methods.get_sweep("depth96")
    assert len(rows) == len(runs) // 2
    for setting, collapsed, *_ in rows:
        optimizer, lr, layers = re.fullmatch(r"(\w+) lr ([\d.e-]+), (\d+) layers",
                                             setting).groups()
        verdicts = []
        for repair in (False, True):
            (run,) = [r for r in runs if r["opt.optimizer"] == optimizer
                      and f"{r['opt.lr']:g}" == lr and r["model.n_layers"] == int(layers)
                      and r["train.grad_repair"] == repair]
            record = training_method_records[training_methods.run_name(run)]
            verdicts.append("yes" if record["result"]["collapse"]["collapsed"] else "no")
        assert collapsed == ", ".join(verdicts), setting
