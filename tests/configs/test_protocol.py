"""The long-horizon protocol's plan (configs/sweeps/protocol.py): every run builds, is named
once, and clips, warms up and evaluates as the protocol states."""

import math

import pytest

from configs.sweeps import leaderboard, protocol
from postnorm.sweep.plan import RunSpec, build_config
from postnorm.train.validate import check_all_but_data


@pytest.mark.parametrize("variant", ["calibration", "bracket"])
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


def test_the_bracket_clips_by_the_protocol_unless_the_method_clips_itself():
    plan = protocol.get_sweep("bracket")
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
