"""The training-time groups' table (postnorm.sweep.group_table) on rows made up here: each
setting paired with its control seed by seed."""

import pytest

from postnorm.sweep.group_table import aggregate, markdown


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
