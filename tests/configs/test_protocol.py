"""The long-horizon protocol's plan (configs/sweeps/protocol.py): every run builds, is named
once, and clips, warms up and evaluates as the protocol states."""

import json
import math

import pytest

from configs.sweeps import leaderboard, protocol
from postnorm.config import config_data, config_digest
from postnorm.sweep.archive import ArchiveError
from postnorm.sweep.plan import RunSpec, build_config
from postnorm.train.validate import check_all_but_data


@pytest.mark.parametrize("variant", ["calibration", "bracket", "stress"])
def test_every_run_builds_and_has_its_own_name(variant):
    plan = protocol.get_sweep(variant)
    names = [protocol.run_name(overrides) for overrides in plan]
    assert len(set(names)) == len(plan)
    for overrides in plan[:: max(1, len(plan) // 12)]:
        spec = ",".join(f"{k}={v}" for k, v in overrides.items())
        config = build_config(f"{protocol.BASE_CONFIG}:{spec}", RunSpec("", ()))
        check_all_but_data(config, device_count=1)
        assert config.opt.warmup_steps < config.train.steps
        assert config.train.eval_batches == protocol.EVAL_BATCHES


def test_the_bracket_clips_by_the_protocol_unless_the_method_clips_itself(tmp_path):
    runs = protocol.planned_runs("bracket", str(tmp_path)) + protocol.planned_runs("stress")
    plan = [run.overrides for run in runs]
    for overrides in plan:
        method = protocol.method_of(overrides)
        own = leaderboard.ALL_METHODS[method].get("opt.clip_norm")
        assert overrides["opt.clip_norm"] in ({protocol.CLIP, 0.0} if own is None else {own, 0.0})
        warmup = overrides["opt.warmup_steps"] / overrides["train.steps"]
        long = method == "post"
        assert warmup == pytest.approx(protocol.LONG_WARMUP_FRACTION if long
                                       else protocol.WARMUP_FRACTION, abs=1 / 300)
    clipped = [o for o in plan if o["opt.clip_norm"] != 0.0]
    stress = [o for o in plan if o["opt.clip_norm"] == 0.0]
    assert len(clipped) == len(stress)
    # B2T as published clips at 0.1; without clipping it is the rescaled-init row
    assert {protocol.method_of(o) for o in stress if o["model.norm"] == "b2t"} == {
        "b2t_rescaled_noclip"}
    assert {protocol.method_of(o) for o in clipped if o["model.norm"] == "b2t"} == {"b2t"}


def test_the_bracket_rates_are_half_decades_over_a_factor_of_100():
    rates = sorted(protocol.BRACKET_LRS)
    steps = [math.log10(b / a) for a, b in zip(rates, rates[1:], strict=False)]
    assert all(abs(s - 0.5) < 0.03 for s in steps) and len(rates) >= 5


def _archive(tmp_path, losses: list[tuple[dict, float | None]],
             collapsed: bool = False) -> str:
    """An archive holding, per (overrides, loss), a finished record of that planned run (its
    config's digest as the trainer writes it) with that held-out loss, ``collapsed`` or not
    and L_freq 6 (None: a run stopped by a non-finite step); the config, which the plan does
    not read, is left empty."""
    for overrides, loss in losses:
        run_id = protocol.run_name(overrides)
        result = ({"status": "nonfinite", "final_eval_loss": None} if loss is None
                  else {"status": "done", "final_eval_loss": loss, "lfreq": 6.0,
                        "collapse": {"collapsed": collapsed}})
        digest = config_digest(config_data(_config(overrides)))
        entry = {"run_id": run_id, "config": {}, "result": result | {"config_digest": digest}}
        (tmp_path / f"{run_id}.json").write_text(json.dumps(entry))
    return str(tmp_path)


def _config(overrides: dict):
    """The run's config, built as the sweep builds it (``plan.build_config``)."""
    return build_config(protocol.BASE_CONFIG, RunSpec("", tuple(overrides.items())))


def _bracket_id(method: str, lr: float) -> str:
    return protocol.run_name(protocol._bracket_run(method, lr))


def test_the_bracket_grows_past_an_edge_optimum_until_it_is_inside(tmp_path):
    """Losses falling with the rate put the optimum at the top edge: the next half-decade is
    planned, and once its loss is higher the best rate is the old edge, now interior."""
    rates = sorted(protocol.BRACKET_LRS)
    archive = _archive(tmp_path, [(protocol._bracket_run("pre", lr), 6.0 - i)
                                  for i, lr in enumerate(rates)])
    grown, best = protocol.bracket_rates("pre", archive)
    assert best is None and len(grown) == len(rates) + 1
    assert math.log10(grown[-1] / rates[-1]) == pytest.approx(0.5, abs=0.03)
    _archive(tmp_path, [(protocol._bracket_run("pre", grown[-1]), 9.0)])
    assert protocol.bracket_rates("pre", archive) == (grown, rates[-1])
    # a method missing a rate has no rate yet; one failing at every rate tries lower
    assert protocol.bracket_rates("mixln", archive)[1] is None
    _archive(tmp_path, [(protocol._bracket_run("sandwich", lr), None) for lr in rates])
    lower, best = protocol.bracket_rates("sandwich", archive)
    assert best is None and lower[1:] == rates
    assert math.log10(rates[0] / lower[0]) == pytest.approx(0.5, abs=0.03)
    # the bracket plans the grown rates for pre and sandwich; the stress test keeps the base
    plan = protocol.planned_runs("bracket", archive)
    assert len(plan) == len(protocol.BRACKET_METHODS) * len(rates) + 2
    assert {_bracket_id("pre", grown[-1]), _bracket_id("sandwich", lower[0])} <= {
        run.run_id for run in plan}
    stress = protocol.planned_runs("stress")
    assert len(stress) == len(protocol.BRACKET_METHODS) * len(rates)
    assert all(not run.clipped for run in stress) and all(run.clipped for run in plan)
    # B2T's unclipped runs keep the protocol's name for the method
    assert {run.method for run in stress} == set(protocol.BRACKET_METHODS)


def test_a_method_that_trains_at_no_rate_chooses_its_largest_stable_one(tmp_path):
    """Collapsed runs at the floor are never chosen, whatever their loss; a rate archived past
    the base grid (an earlier growth) stays in the grid and in the plan."""
    rates = sorted(protocol.BRACKET_LRS)
    losses = [(protocol._bracket_run("deepnorm", lr), 5.9 - i / 100)
              for i, lr in enumerate(rates)]
    beyond = protocol.half_decade(rates[-1], up=True)
    archive = _archive(tmp_path, [*losses, (protocol._bracket_run("deepnorm", beyond), 5.8)])
    for lr in rates[1:-1]:  # collapsed from the second rate to the top of the base grid
        path = tmp_path / f"{_bracket_id('deepnorm', lr)}.json"
        entry = json.loads(path.read_text())
        entry["result"]["collapse"]["collapsed"] = True
        path.write_text(json.dumps(entry))
    assert protocol.bracket_rates("deepnorm", archive) == ([*rates, beyond], rates[0])
    # the screen cannot rank its rates: the survival runs wait for the long bracket
    assert protocol.needs_long_bracket("deepnorm", archive)
    assert not [r for r in protocol.planned_runs("survival", archive) if r.method == "deepnorm"]
    assert _bracket_id("deepnorm", beyond) in {
        r.run_id for r in protocol.planned_runs("bracket", archive)}


def test_survival_and_width_are_planned_from_the_archived_best_rates(tmp_path):
    rates = sorted(protocol.BRACKET_LRS)
    losses = []
    for k, method in enumerate(protocol.SURVIVAL_METHODS):
        best = rates[1 + k % 3]  # interior, varying by method
        losses += [(protocol._bracket_run(method, lr), 5.0 + abs(math.log10(lr / best)))
                   for lr in rates]
    archive = _archive(tmp_path, losses)
    survival = [run.overrides for run in protocol.planned_runs("survival", archive)]
    assert len(survival) == len(protocol.SURVIVAL_METHODS) * len(protocol.SEEDS)
    for overrides in survival:
        k = protocol.SURVIVAL_METHODS.index(protocol.method_of(overrides))
        assert overrides["opt.lr"] == rates[1 + k % 3]
        assert overrides["train.steps"] == protocol.LONG_STEPS
        assert overrides["model.n_layers"] == 48
    assert protocol.planned_runs("width", archive) == []  # no survival run archived yet
    # every survival run archived: the two non-reference methods of lowest mean loss get width
    order = [m for m in protocol.SURVIVAL_METHODS if m not in ("post", "pre")]
    mean = {m: 4.0 + order.index(m) / 10 for m in order} | {"post": 3.0, "pre": 3.5}
    _archive(tmp_path, [(o, mean[protocol.method_of(o)]) for o in survival])
    width = [run.overrides for run in protocol.planned_runs("width", archive)]
    assert {protocol.method_of(o) for o in width} == {"post", "pre", *order[:2]}
    assert len(width) == 4 * len(protocol.WIDTH_SEEDS)
    assert all(o["model.d_model"] == 128 and o["train.steps"] == protocol.WIDTH_STEPS
               for o in width)
    for overrides in (survival[0], width[0]):
        spec = ",".join(f"{k}={v}" for k, v in overrides.items())
        config = build_config(f"{protocol.BASE_CONFIG}:{spec}", RunSpec("", ()))
        check_all_but_data(config, device_count=1)
    assert config.model.d_model // config.model.n_heads == 32


def test_a_record_of_another_config_under_a_planned_id_is_refused(tmp_path):
    """Run ids name only what the plan varies: a record under a bracket run's id whose config
    differs (here its seed) is not read as that run's, and the plan names the file."""
    rates = sorted(protocol.BRACKET_LRS)
    archive = _archive(tmp_path, [(protocol._bracket_run("pre", lr),
                                   5.0 + abs(math.log10(lr / rates[2]))) for lr in rates])
    assert protocol.bracket_rates("pre", archive) == (rates, rates[2])
    other = {**protocol._bracket_run("pre", rates[2]), "seed": 7}
    path = tmp_path / f"{_bracket_id('pre', rates[2])}.json"
    entry = json.loads(path.read_text())
    entry["result"]["config_digest"] = config_digest(config_data(_config(other)))
    path.write_text(json.dumps(entry))
    with pytest.raises(ArchiveError, match=path.name):
        protocol.bracket_rates("pre", archive)


@pytest.mark.parametrize(("method", "warmup"), [("deepnorm", protocol.WARMUP_FRACTION),
                                               ("post", protocol.LONG_WARMUP_FRACTION)])
def test_a_method_that_trains_at_no_rate_in_300_steps_is_bracketed_again_over_more(
        tmp_path, method, warmup):
    """A method at the floor at its one stable rate and collapsed above it in 300 steps gets
    a bracket at the survival horizon (Post-Norm keeps its long warmup), and its survival runs
    take that bracket's rate once it is settled, the bracket's run at that rate being the
    seed-0 one; Pre-Norm, which trains in 300 steps, gets none."""
    rates = sorted(protocol.BRACKET_LRS)
    archive = _archive(tmp_path, [(protocol._bracket_run("pre", lr),
                                   5.0 + abs(math.log10(lr / rates[2]))) for lr in rates])
    _archive(tmp_path, [(protocol._bracket_run(method, rates[0]), 5.9)])
    _archive(tmp_path, [(protocol._bracket_run(method, lr), 5.8) for lr in rates[1:]],
             collapsed=True)
    assert protocol.bracket_rates(method, archive) == (rates, rates[0])
    long_bracket = protocol.planned_runs("long_bracket", archive)
    assert {run.method for run in long_bracket} == {method}
    assert sorted(run.lr for run in long_bracket) == sorted(protocol.LONG_BRACKET_LRS)
    assert all(run.config.train.steps == protocol.LONG_STEPS and run.clipped
               and run.config.opt.warmup_steps == round(warmup * protocol.LONG_STEPS)
               for run in long_bracket)
    survival = protocol.planned_runs("survival", archive)
    assert {run.method for run in survival} == {"pre"}  # the method waits for its long bracket
    long_rates = sorted(protocol.LONG_BRACKET_LRS)
    _archive(tmp_path, [(run.overrides, 4.0 + abs(math.log10(run.lr / long_rates[1])))
                        for run in long_bracket])
    assert protocol.long_run_rate(method, archive) == long_rates[1]
    runs = [run for run in protocol.planned_runs("survival", archive) if run.method == method]
    assert {run.lr for run in runs} == {long_rates[1]} and len(runs) == len(protocol.SEEDS)
    seed0 = next(run for run in runs if run.seed == 0)
    chosen = next(run for run in long_bracket if run.lr == long_rates[1])
    assert (seed0.run_id, seed0.config) == (chosen.run_id, chosen.config)
    assert protocol.archived_losses(archive, [seed0.overrides]) == {seed0.run_id: 4.0}
    assert protocol.long_run_rate("pre", archive) == rates[2]
