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
