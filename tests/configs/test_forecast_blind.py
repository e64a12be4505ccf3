"""The forecast's blind sweep (configs/sweeps/forecast_blind.py): every drawn run builds, names
its method as the forecast reads it, and the draw follows the distribution the file states."""

import math
import random

import numpy as np
import pytest
from scipy import stats

from configs.sweeps import forecast_blind as blind
from configs.sweeps import leaderboard, protocol
from postnorm.config import config_data
from postnorm.sweep.plan import RunSpec, build_config, plan_file
from postnorm.train.validate import check_all_but_data


def test_every_drawn_run_builds_and_is_read_back_as_its_method():
    base, specs = plan_file("configs/sweeps/forecast_blind.py")
    drawn = blind.planned_runs()
    assert len(specs) == len({s.run_id for s in specs}) == blind.RUNS
    assert [s.run_id for s in specs] == [blind.run_name(o) for _, o in drawn]
    for spec, (method, _) in zip(specs, drawn, strict=True):
        config = build_config(base, spec)
        check_all_but_data(config, device_count=1)
        assert protocol.method_label(config_data(config)) == method
        assert config.train.steps == blind.STEPS and config.model.d_model == 64
        assert config.train.eval_batches == protocol.EVAL_BATCHES
        assert 0 < config.opt.warmup_steps < config.train.steps


def test_the_plan_is_the_registered_draw():
    """The draw was committed before any of its runs: a change to the sweep file, the methods'
    fields or the protocol's would change the runs after the registration."""
    assert [blind.run_name(o) for _, o in blind.planned_runs()] == blind.registered_ids()


@pytest.mark.parametrize("clip", [0.0, blind.CLIP])
@pytest.mark.parametrize("method", blind.DRAWN_METHODS)
def test_each_method_is_read_back_clipped_or_not(method, clip):
    overrides = {**protocol.protocol(blind.STEPS, 0.1, clip), **protocol.method_overrides(method),
                 "model.n_layers": 24, "opt.lr": 1e-3, "seed": 7}
    config = build_config(blind.BASE_CONFIG, RunSpec(blind.run_name(overrides),
                                                     tuple(overrides.items())))
    assert protocol.method_label(config_data(config)) == method


def test_the_sweep_takes_no_variant():
    with pytest.raises(ValueError, match="takes no variant"):
        blind.get_sweep("survival")


def test_the_draw_follows_the_stated_distribution():
    rng = random.Random(0)
    draws = [blind.drawn_run(rng) for _ in range(6000)]
    methods = [m for m, _ in draws]
    counts = [methods.count(m) for m in blind.DRAWN_METHODS]
    assert stats.chisquare(counts).pvalue > 1e-3
    assert set(blind.DRAWN_METHODS) == set(leaderboard.METHODS)  # all but the profiled control
    layers = [o["model.n_layers"] for _, o in draws]
    assert stats.chisquare([layers.count(n) for n in blind.LAYERS]).pvalue > 1e-3
    log_lr = np.log([o["opt.lr"] for _, o in draws])
    low, high = np.log(blind.LR_RANGE)
    assert stats.kstest((log_lr - low) / (high - low), "uniform").pvalue > 1e-3
    fraction = np.array([o["opt.warmup_steps"] for _, o in draws]) / blind.STEPS
    low, high = blind.WARMUP_RANGE
    assert fraction.min() >= low - 0.5 / blind.STEPS and fraction.max() <= high + 0.5 / blind.STEPS
    assert np.median(fraction) == pytest.approx(math.sqrt(low * high), rel=0.05)
    own = {m for m, f in leaderboard.METHODS.items() if "opt.clip_norm" in f}
    never = {m for m in blind.DRAWN_METHODS if m.endswith("_noclip")}
    clips = [o["opt.clip_norm"] for m, o in draws if m not in own | never]
    assert set(clips) == {0.0, blind.CLIP}
    assert stats.binomtest(clips.count(0.0), len(clips)).pvalue > 1e-3
    assert all(o["opt.clip_norm"] == leaderboard.METHODS[m]["opt.clip_norm"]
               for m, o in draws if m in own)
    assert all(o["opt.clip_norm"] == 0.0 for m, o in draws if m in never)
    seeds = [o["seed"] for _, o in draws]
    assert min(seeds) >= blind.SEED_RANGE[0] and max(seeds) < blind.SEED_RANGE[1]
