"""The leaderboard's tables (postnorm.sweep.leaderboard_table): each method's verdict, the
final lambda profiles, and the seed-paired gaps to Pre-Norm, on rows made up here."""

import numpy as np
import pytest


def test_each_methods_verdict_over_the_cells_where_post_collapses():
    """Judged only where Post-Norm collapsed (lr 3e-3 here, not 1e-3): a method with a
    collapsed or non-finite run there did not prevent it; one whose runs there are all done
    and none collapsed did, and meets the goal if no cell is more than 0.05 above Pre-Norm."""
    from postnorm.sweep.leaderboard_table import aggregate, method_verdicts, verdicts_markdown

    def run(method, lr, seed, loss, collapsed=False, status="done"):
        return {"method": method, "layers": 48, "lr": lr, "warmup": 20, "status": status,
                "seed": seed,
                "collapsed": collapsed if status == "done" else None, "workdir": f"{method}{seed}",
                "fresh_loss_over_lfreq": loss if status == "done" else None}

    rows = [run("post", 1e-3, 0, 0.95), run("post", 3e-3, 0, 1.02, True),
            run("post", 3e-3, 1, 1.03, True),
            run("pre", 1e-3, 0, 0.85), run("pre", 3e-3, 0, 0.80), run("pre", 3e-3, 1, 0.82),
            run("mixln", 1e-3, 0, 1.04, True),  # outside Post's collapse cells: not judged
            run("mixln", 3e-3, 0, 0.84), run("mixln", 3e-3, 1, 0.85),
            run("sandwich", 3e-3, 0, 0.90), run("sandwich", 3e-3, 1, 0.0, status="missing"),
            run("adaptive", 3e-3, 0, 0.83), run("adaptive", 3e-3, 1, 0.0, status="nonfinite"),
            run("deepnorm", 3e-3, 0, 0.86), run("deepnorm", 3e-3, 1, 1.01, True)]
    order = ["post", "pre", "deepnorm", "mixln", "sandwich", "adaptive"]
    verdicts = {v["method"]: v for v in method_verdicts(aggregate(rows, order))}
    assert list(verdicts) == order
    assert verdicts["post"]["prevented"] == "no" and verdicts["post"]["collapsed"] == 2
    mixln = verdicts["mixln"]
    assert (mixln["cells"], mixln["done"], mixln["collapsed"], mixln["prevented"],
            mixln["meets_goal"]) == (1, 2, 0, "yes", "yes")
    assert mixln["largest_gap_to_pre"] == pytest.approx(0.845 - 0.81)
    assert mixln["fresh_loss_over_lfreq_range"] == [0.84, 0.85]
    sandwich = verdicts["sandwich"]  # 0.09 above Pre, one seed missing
    assert (sandwich["prevented"], sandwich["meets_goal"]) == ("so far", "not so far")
    assert (verdicts["adaptive"]["prevented"], verdicts["adaptive"]["nonfinite"]) == ("no", 1)
    assert (verdicts["deepnorm"]["prevented"], verdicts["deepnorm"]["meets_goal"]) == ("no", "no")
    table = verdicts_markdown(list(verdicts.values()), 512)
    assert "| mixln | 1 | 2/2 | 0/2 | 0 | yes | 0.840–0.850 | 0/2 | +0.035 | yes |" in table
    # at the floor: loss / L_freq >= 0.95 (the collapse rule's band), collapsed or not
    assert [verdicts[m]["at_floor"] for m in order] == [2, 0, 1, 0, 0, 0]
    # nothing final while a run that could change the verdict is missing: Pre-Norm's in a
    # judged cell (the gap is unknown there), or Post-Norm's in a cell the method ran
    # (it would add that cell to those judged)
    pre_missing = [r for r in rows if r["method"] != "pre" or r["seed"] != 1] + [
        run("pre", 3e-3, 1, 0.0, status="missing")]
    mixln = {v["method"]: v for v in method_verdicts(aggregate(pre_missing, order))}["mixln"]
    assert (mixln["prevented"], mixln["meets_goal"]) == ("so far", "so far")
    post_missing = rows + [run("post", 1e-3, 1, 0.0, status="missing")]
    mixln = {v["method"]: v for v in method_verdicts(aggregate(post_missing, order))}["mixln"]
    assert (mixln["prevented"], mixln["meets_goal"]) == ("so far", "so far")


def test_a_final_lambda_profile_is_counted_sublayer_by_sublayer():
    """``profile_summary`` against a loop over the sublayers of a random profile with exact
    0s and 1s, and ``profiles_markdown`` lists only the runs that recorded a profile."""
    from postnorm.sweep.leaderboard_table import profile_summary, profiles_markdown

    rng = np.random.default_rng(0)
    profile = rng.choice([0.0, 1.0, 0.3, 0.995, 0.005], size=(12, 2)).tolist()
    profile[0] = [1.0, 1.0]
    summary = profile_summary(profile)
    at_post = at_pre = 0
    first = None
    for layer, pair in enumerate(profile):
        for value in pair:
            at_post += value >= 0.99
            at_pre += value <= 0.01
            if value <= 0.01 and first is None:
                first = layer
    assert (summary["at_post"], summary["at_pre"], summary["first_layer_at_pre"]) == (
        at_post, at_pre, first)
    assert summary["between"] == 24 - at_post - at_pre
    assert summary["mean_attn"] == pytest.approx(sum(p[0] for p in profile) / 12, rel=1e-12)
    assert profile_summary([[1.0, 1.0]] * 3)["first_layer_at_pre"] is None
    row = dict(method="adaptive_two_way", layers=12, lr=1e-3, warmup=20, seed=1,
               fresh_loss_over_lfreq=0.9, collapsed=False)
    table = profiles_markdown([{**row, "final_post_mix": profile}, {**row, "seed": 2}])
    assert table.count("| adaptive_two_way |") == 1
    assert f"| {at_post}/{at_pre}/{24 - at_post - at_pre} | {first} | 0.900 | no |" in table


def test_each_cells_paired_gap_is_a_t_interval_over_the_seeds_both_finished():
    """``paired_gaps`` against scipy's t interval of the per-seed differences, on seeds both
    the method and Pre-Norm finished (a seed only one of them finished is left out)."""
    from scipy import stats

    from postnorm.sweep.leaderboard_table import paired_gaps, paired_markdown

    def row(method, seed, loss, status="done"):
        return dict(method=method, layers=48, lr=1e-3, warmup=20, seed=seed, fresh_loss=loss,
                    status=status)

    pre = {0: 4.91, 1: 4.95, 2: 4.90, 3: 4.97}
    mixln = {0: 5.02, 1: 5.00, 2: 5.11}
    rows = ([row("pre", s, v) for s, v in pre.items()]
            + [row("mixln", s, v) for s, v in mixln.items()]
            + [row("mixln", 3, 9.0, "nonfinite"), row("post", 0, 5.9)])
    (gap,) = paired_gaps(rows)  # post has one seed: no interval, no row
    d = np.array([mixln[s] - pre[s] for s in (0, 1, 2)])
    low, high = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    assert (gap["method"], gap["n"], gap["seeds"]) == ("mixln", 3, [0, 1, 2])
    assert gap["mean"] == pytest.approx(d.mean(), rel=1e-12)
    assert gap["ci95"] == pytest.approx([low, high], rel=1e-9)
    assert gap["verdict"] == ("worse" if low > 0 else "inconclusive")
    assert f"| mixln | 48 | 0.001 | 20 | 3 | {d.mean():+.3f} | [{low:+.3f}, {high:+.3f}] |" \
        in paired_markdown([gap], ["pre", "mixln"])
