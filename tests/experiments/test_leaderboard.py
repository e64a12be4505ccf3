"""The leaderboard command end to end on a tiny plan: it trains, tabulates every planned run,
resumes without retraining, and two shards give the table one invocation gives."""

import json
import subprocess
import sys

import pytest

from configs.sweeps.leaderboard import _run
from tests.reliability_helpers import REPO, subprocess_env, tiny_overrides, write_corpus

SWEEP = '''
BASE_CONFIG = "configs/default.py"
RUNS = {runs!r}


def get_sweep(arg=None):
    return RUNS
'''


def leaderboard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.leaderboard", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=900,
                          env=subprocess_env(None))


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    fields = tiny_overrides(write_corpus(tmp / "corpus"), tmp / "tfds", train__steps=6,
                            diag__every=2, train__eval_every=6, train__log_every=2)
    runs = [{**_run(method, 3e-3, 0), **fields} for method in ("post", "pre")]
    path = tmp / "tiny_leaderboard.py"
    path.write_text(SWEEP.format(runs=runs))
    return str(path)


def cells(out_dir) -> list[dict]:
    """The table's cells without what differs between invocations (wall times, paths)."""
    entries = json.loads((out_dir / "leaderboard.json").read_text())["cells"]
    return [{k: v for k, v in e.items() if k not in ("wall_s", "runs")} for e in entries]


@pytest.mark.slow
def test_the_leaderboard_trains_resumes_and_shards_alike(sweep_file, tmp_path):
    whole, sharded, archive = tmp_path / "whole", tmp_path / "sharded", tmp_path / "archive"
    first = leaderboard(f"--sweep={sweep_file}", f"--out_dir={whole}", "--fresh_batches=2",
                        "--methods=post", f"--archive={archive}")
    assert first.returncode == 0, first.stderr[-3000:]
    post_only = json.loads((whole / "leaderboard.json").read_text())
    assert [e["method"] for e in post_only["cells"]] == ["post"]
    result = leaderboard(f"--sweep={sweep_file}", f"--out_dir={whole}", "--fresh_batches=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("already finished") == 1  # the post run of the first call
    board = json.loads((whole / "leaderboard.json").read_text())
    assert len(board["runs"]) == 2 and {r["status"] for r in board["runs"]} == {"done"}
    (post, pre) = board["cells"]
    assert (post["method"], pre["method"], post["done"], pre["done"]) == ("post", "pre", 1, 1)
    table = (whole / "leaderboard.md").read_text()
    for entry in board["cells"]:
        assert f"| {entry['method']} | 2 | 0.003 | 2 | 1/1 |" in table
    assert pre["gap_to_pre"] == pytest.approx(0.0, abs=1e-12)
    assert [v["method"] for v in board["methods"]] == ["post", "pre"]
    assert "| post | " in (whole / "leaderboard_methods.md").read_text()
    page = (whole / "leaderboard.html").read_text()
    assert page.count("report.html") == 2 and (whole / "leaderboard.png").stat().st_size > 0
    # the archive: the post run's record written by its worker; the pre run's, trained by a
    # call without --archive, by a report with it; the two rebuild the table without the runs
    report = leaderboard(f"--sweep={sweep_file}", f"--out_dir={whole}", "--fresh_batches=2",
                         f"--archive={archive}", "--report_only")
    assert report.returncode == 0, report.stderr[-3000:]
    rebuilt = leaderboard(f"--sweep={sweep_file}", f"--out_dir={tmp_path / 'rebuilt'}",
                          "--fresh_batches=2", f"--archive={archive}", "--report_only")
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert sorted(p.name for p in archive.iterdir()) == sorted(
        f"{r['run_id']}.json" for r in board["runs"])
    assert cells(tmp_path / "rebuilt") == cells(whole)
    again = leaderboard(f"--sweep={sweep_file}", f"--out_dir={tmp_path / 'again'}",
                        "--fresh_batches=2", f"--archive={archive}")
    assert again.returncode == 0 and again.stderr.count("archived in") == 2, again.stderr[-3000:]
    for shard in ("0/2", "1/2"):
        result = leaderboard(f"--sweep={sweep_file}", f"--out_dir={sharded}",
                             "--fresh_batches=2", f"--shard={shard}")
        assert result.returncode == 0, result.stderr[-3000:]
    assert cells(sharded) == cells(whole)


def test_a_plan_without_the_methods_asked_for_is_one_line(tmp_path):
    result = leaderboard("--sweep=configs/sweeps/stability.py:smoke", "--methods=deepnorm",
                         f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "plans no run of --methods=" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
