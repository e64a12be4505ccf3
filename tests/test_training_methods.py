"""The training-time groups' table end to end on a tiny grouped sweep: the controls trained into
one archive, a group into another with the runs the first records left out
(``experiments.sweep --skip_archived``), and ``experiments.training_methods`` reading both,
checked against the records and the runs' own metrics files."""

import json
import subprocess
import sys

import numpy as np
import pytest

from configs.sweeps.training_methods import _run
from postnorm.sweep.group_table import aggregate, markdown
from tests.reliability_helpers import REPO, subprocess_env, tiny_overrides, write_corpus

SWEEP = '''
from configs.sweeps.training_methods import run_name

BASE_CONFIG = "configs/default.py"
FIELDS = {fields!r}
GROUPS = {groups!r}
CONTROLS = {controls!r}


def get_sweep(arg=None):
    if arg == "controls":
        return CONTROLS
    return GROUPS[arg] if arg else [run for runs in GROUPS.values() for run in runs]
'''


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    if module == "experiments.sweep":
        args = (*args, "--override=runtime.allocator=system")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env=subprocess_env(None))


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    fields = tiny_overrides(write_corpus(tmp / "corpus"), tmp / "tfds", train__steps=6,
                            diag__every=2, train__eval_every=6, train__log_every=1,
                            opt__lr=1e-3)
    del fields["runtime.allocator"]  # one per process: given by --override
    plain = {**_run(seed=0), **fields}
    groups = {"regulariser": [{**_run(opt__diversity_weight=0.3, seed=0), **fields}, plain]}
    path = tmp / "tiny_training_methods.py"
    path.write_text(SWEEP.format(fields=plain, groups=groups, controls=[plain]))
    return str(path)


def last_mean(workdir, key: str, tail: int = 3) -> float:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return float(np.mean([r[key] for r in records if key in r][-tail:]))


@pytest.mark.slow
def test_the_groups_table_reads_two_archives_against_the_runs(sweep_file, tmp_path):
    controls, group = tmp_path / "controls_archive", tmp_path / "group_archive"
    first = run("experiments.sweep", f"--sweep={sweep_file}:controls",
                f"--out_dir={tmp_path / 'controls'}", f"--archive={controls}",
                "--fresh_batches=2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = run("experiments.sweep", f"--sweep={sweep_file}", f"--out_dir={tmp_path / 'runs'}",
                 f"--archive={group}", "--fresh_batches=2", f"--skip_archived={controls}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "--skip_archived records 1 runs" in second.stderr
    (trained,) = [p.stem for p in group.iterdir()]  # the control was not trained again
    assert trained.startswith("post_layers2_adamw_lr0.001_diversity0.3")
    out = tmp_path / "table"
    table = run("experiments.training_methods", f"--sweep={sweep_file}",
                f"--archive={group},{controls}", f"--out_dir={out}")
    assert table.returncode == 0, table.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    settings = {(e["group"], e["setting"]): e for e in summary["settings"]}
    regularised = settings[("regulariser", "post_layers2_adamw_lr0.001_diversity0.3")]
    plain = settings[("regulariser", "post_layers2_adamw_lr0.001")]
    control = settings[("controls", "post_layers2_adamw_lr0.001")]
    assert (regularised["done"], plain["done"], control["done"]) == (1, 1, 1)
    record = json.loads((group / f"{trained}.json").read_text())
    (control_record,) = [json.loads(p.read_text()) for p in controls.iterdir()]
    assert regularised["gap_to_control"] == pytest.approx(
        record["measures"]["fresh_loss_over_lfreq"]
        - control_record["measures"]["fresh_loss_over_lfreq"], rel=1e-12)
    # a plain run is its own control: no gap, though its control's run is there
    assert plain["gap_to_control"] is None and plain["fresh_mean"] == pytest.approx(
        control_record["measures"]["fresh_loss_over_lfreq"])
    # D at the end: the mean of the last three logged train/diversity of the run itself
    assert regularised["final_diversity"] == [pytest.approx(
        last_mean(tmp_path / "runs" / trained, "train/diversity"), rel=1e-9)]
    assert control["final_diversity"] == [None]
    assert "| regulariser | `post_layers2_adamw_lr0.001_diversity0.3` | 0 | 1/1 |" in table.stdout


def made_up_row(setting: str, seed: int, fresh: float | None, *, control=("post", 48, "adamw",
                0.001, 0.1), plain=False, status="done", **extra) -> dict:
    return {"group": "g", "run_id": f"{setting}_seed{seed}", "setting": setting, "seed": seed,
            "control": list(control), "plain": plain, "status": status,
            "fresh_loss_over_lfreq": fresh, "collapsed": status == "done" and fresh > 1.0,
            **extra}


def test_each_setting_is_paired_with_its_control_seed_by_seed():
    """Gaps to the control of the same norm, depth, optimizer, lr and decay, over the seeds
    both finished; a missing or non-finite seed is shown as such, never averaged."""
    sgd = ("post", 48, "sgd", 0.1, 1e-4)
    rows = [made_up_row("post", 0, 1.02, plain=True), made_up_row("post", 1, 1.04, plain=True),
            made_up_row("post", 2, None, plain=True, status="missing"),
            made_up_row("post_x", 0, 0.90), made_up_row("post_x", 1, None, status="nonfinite"),
            made_up_row("post_x", 2, 0.95),
            made_up_row("sgd", 0, 1.10, control=sgd, plain=True),
            made_up_row("sgd_x", 0, 1.05, control=sgd),
            made_up_row("pre_x", 0, 0.80, control=("pre", 48, "adamw", 0.001, 0.1))]
    entries = {e["setting"]: e for e in aggregate(rows)}
    post_x = entries["post_x"]
    # only seed 0 has both runs: 0.90 - 1.02; seed 2's control is missing, seed 1 diverged
    assert post_x["gap_to_control"] == pytest.approx(0.90 - 1.02) and post_x["paired_seeds"] == 1
    assert post_x["fresh_loss_over_lfreq"] == [0.90, None, 0.95]
    assert post_x["fresh_mean"] == pytest.approx(0.925) and post_x["status"] == {
        "done": 2, "nonfinite": 1}
    assert entries["sgd_x"]["gap_to_control"] == pytest.approx(1.05 - 1.10)
    assert entries["pre_x"]["gap_to_control"] is None  # no Pre-Norm control at all
    assert entries["post"]["gap_to_control"] is None  # a control is not compared with itself
    table = markdown(list(entries.values()), 512)
    assert "| g | `post_x` | 0, 1, 2 | 2/3 (1 non-finite) | 0/2 | – | 0.900, –, 0.950 |" in table
    assert "| g | `post` | 0, 1, 2 | 2/3 (1 not run yet) | 2/2 |" in table


def test_the_groups_table_without_records_or_groups_is_one_line(tmp_path):
    empty = run("experiments.training_methods", f"--archive={tmp_path}",
                f"--out_dir={tmp_path / 'out'}")
    assert empty.returncode == 2 and "no run of configs/sweeps/training_methods.py is in" in \
        empty.stderr.strip().splitlines()[-1]
    ungrouped = run("experiments.training_methods", "--sweep=configs/sweeps/stability.py",
                    f"--archive={tmp_path}", f"--out_dir={tmp_path / 'out'}")
    assert ungrouped.returncode == 2 and "defines no GROUPS dict" in \
        ungrouped.stderr.strip().splitlines()[-1]
    nowhere = run("experiments.training_methods", f"--archive={tmp_path / 'nowhere'}",
                  f"--out_dir={tmp_path / 'out'}")
    assert nowhere.returncode == 2 and "--archive: " in nowhere.stderr.strip().splitlines()[-1]
    bad = run("experiments.sweep", "--sweep=configs/sweeps/training_methods.py:z_loss",
              f"--out_dir={tmp_path / 'runs'}", f"--skip_archived={tmp_path / 'nowhere'}")
    assert bad.returncode == 2 and "--skip_archived" in bad.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
