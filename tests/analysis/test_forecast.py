"""The collapse forecast: its theory inputs against a Monte Carlo forward pass, its schedule
input against the schedule's formula, its fit (the logistic optimum, Platt's map against scipy,
the nested cross-validation against a plain re-implementation, no peeking at held-out labels),
determinism and CLI, and the committed validation's scores recomputed independently."""

import dataclasses
import json
import math
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.stats import rankdata

from postnorm.analysis import forecast as fc
from postnorm.analysis.collapse import half_alike_step
from postnorm.config.schema import base_config
from postnorm.diagnostics.schedule import diagnostic_steps
from postnorm.model.placements import PLACEMENTS, profile_text
from postnorm.sweep.archive import read_archive
from postnorm.train.placement_control import placement_control
from tests.committed import assert_json_matches
from tests.reliability_helpers import REPO, subprocess_env

FORECAST_DIR = REPO / "results" / "figures" / "forecast"
ARCHIVE = REPO / "results" / "leaderboard" / "runs"


def small_config(**model):
    config = base_config()
    config.model.update({"n_layers": 3, "d_model": 128, "n_heads": 4, "d_ff": 384, **model})
    config.data.seq_len = 32  # n t > 1: a positive EC correlation
    return config


def _rms_normalise(y_NxD):
    return y_NxD / np.sqrt(np.mean(y_NxD**2, axis=-1, keepdims=True))


def monte_carlo(config, draws: int, seed: int = 0):
    """tsim after each sublayer, each layer's skip-path gain and each sublayer's contraction c
    of its sum y averaged over the rows (of each row's mean square over the draws: the d ->
    infinity c, without finite d's Jensen gap), from random draws of a numpy stack of mixed
    sublayers (lambda 1: Post-Norm) with uniform causal attention, SwiGLU and Gaussian weights
    of the init's variances."""
    m = config.model
    lam = 1.0 if m.norm == "post" else m.adaptive_initial_mix
    n, d, f = config.data.seq_len, m.d_model, m.d_ff
    rng = np.random.default_rng(seed)
    p_NxN = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    rho = (n * m.init_tsim_input - 1) / (n - 1)
    sd_dd, sd_df, sd_fd = np.sqrt(1 / (3 * d)), np.sqrt(1 / (3 * d)), np.sqrt(1 / (3 * f))
    tsim_Dx2L = np.zeros((draws, 2 * m.n_layers))
    y_sq_Dx2L = np.zeros((draws, 2 * m.n_layers))
    y_sq_Dx2LxN = np.zeros((draws, 2 * m.n_layers, n))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    for k in range(draws):
        x = np.sqrt(rho) * rng.normal(size=(1, d)) + np.sqrt(1 - rho) * rng.normal(size=(n, d))
        for i in range(2 * m.n_layers):
            read = lam * x + (1 - lam) * _rms_normalise(x)
            if i % 2 == 0:
                branch = p_NxN @ read @ rng.normal(0, sd_dd, (d, d)) @ rng.normal(0, sd_dd, (d, d))
            else:
                gate, up = rng.normal(0, sd_df, (d, f)), rng.normal(0, sd_df, (d, f))
                branch = (silu(read @ gate) * (read @ up)) @ rng.normal(0, sd_fd, (f, d))
            y = x + branch
            y_sq_Dx2L[k, i] = np.mean(y**2)
            y_sq_Dx2LxN[k, i] = np.mean(y**2, axis=-1)
            x = lam * _rms_normalise(y) + (1 - lam) * y
            tsim_Dx2L[k, i] = np.sum(x.sum(0) ** 2) / (n * np.sum(x**2))
    c_2L = 1 / np.sqrt(y_sq_Dx2L.mean(0))
    skip_L = np.prod((lam * c_2L + 1 - lam).reshape(-1, 2), axis=1)
    return tsim_Dx2L.mean(0), skip_L, c_2L, np.mean(1 / np.sqrt(y_sq_Dx2LxN.mean(0)), axis=1)


@pytest.mark.parametrize("model", [{"norm": "post"},
                                   {"norm": "adaptive", "adaptive_initial_mix": 0.5}])
def test_theory_inputs_match_a_monte_carlo_forward_pass(model):
    config = small_config(**model)
    config.train.placement_controller = False  # lambda stays at init
    inputs = fc.step0_inputs(config)
    tsim_2L, skip_L, c_2L, c_row_2L = monte_carlo(config, draws=200)
    assert inputs["tsim_max"] == pytest.approx(tsim_2L.max(), rel=0.05)
    assert inputs["log_skip_gain"] == pytest.approx(np.sum(np.log(skip_L)), rel=0.05)
    assert inputs["log_skip_gain"] < -0.02  # the contraction is there to be measured
    # the controller's per-sublayer statistics, its backward gain and its c (summed over the
    # layers per sublayer kind: one sublayer's deficit, ~0.5%, is near the draws' noise)
    lam = 1.0 if model["norm"] == "post" else model["adaptive_initial_mix"]
    trace = fc._init_trace(fc.model_spec(config), float(config.model.init_tsim_input))
    np.testing.assert_allclose(np.log(trace.sublayer_skip_gain).sum(0),
                               np.log(lam * c_2L + 1 - lam).reshape(-1, 2).sum(0), rtol=0.1)
    np.testing.assert_allclose(np.prod(trace.sublayer_skip_gain, axis=1), trace.skip_gain,
                               rtol=1e-12)
    np.testing.assert_allclose(np.log(trace.c_mean).sum(0),
                               np.log(c_row_2L).reshape(-1, 2).sum(0), rtol=0.05)


def _mean_field_diagnostics(trace):
    """The diagnostic step's statistics the controller reads, from a mean-field trace: c and
    the input tsim per sublayer, and ||dL/dX|| at each sublayer's input as the product of the
    skip-path gains above it (||dL/dX|| at the stack's output 1)."""
    gain_2L = trace.sublayer_skip_gain.ravel()
    dldx_2L = np.cumprod(gain_2L[::-1])[::-1]
    return {"c_mean_attn": trace.c_mean[:, 0], "c_mean_ffn": trace.c_mean[:, 1],
            "tsim_attn": trace.tsim_in, "tsim_ffn": trace.tsim_after[:, 0],
            "dldx_norm_attn": dldx_2L[0::2], "dldx_norm_ffn": dldx_2L[1::2],
            "dldx_norm_final": np.float64(1.0)}


def _profile(spec):
    return PLACEMENTS[spec.norm].post_mix(spec)


def _adaptive(n_layers, seq_len, **train):
    config = small_config(norm="adaptive", n_layers=n_layers)
    config.data.seq_len = seq_len
    config.train.update(train)
    return config


@pytest.mark.parametrize("signal", ["post_input_c", "two_way"])
def test_the_simulated_controller_is_the_training_controllers_rule(signal):
    """The forecast's settled profile against the training's own PlacementControl (its
    backward_gain from tap norms, its update) stepped on the mean-field statistics of each
    current profile, every act, no early stop. Thresholds at the init's median statistic, so
    that some sublayers alarm and some do not."""
    config = _adaptive(4, 16, placement_signal=signal)
    spec, t_input = fc.model_spec(config), float(config.model.init_tsim_input)
    init = fc._init_trace(spec, t_input)
    control = dataclasses.replace(placement_control(config),
                                  c_min=float(np.median(init.c_mean)),
                                  gain_min=float(np.median(init.sublayer_skip_gain)),
                                  rate_down=0.25, rate_up=0.05)
    mix_Lx2 = jnp.asarray(_profile(spec))
    for _ in range(30):
        profiled = dataclasses.replace(spec, adaptive_profile=profile_text(np.asarray(mix_Lx2)))
        trace = fc._init_trace(profiled, t_input)
        mix_Lx2 = control(mix_Lx2, {k: jnp.asarray(v, jnp.float32)
                                    for k, v in _mean_field_diagnostics(trace).items()})
    settled = fc.settled_spec(spec, t_input, control, 30)
    np.testing.assert_array_equal(_profile(settled), np.asarray(mix_Lx2))
    first_alarm = control.alarm({k: jnp.asarray(v, jnp.float32)
                                 for k, v in _mean_field_diagnostics(init).items()})
    assert 0 < int(first_alarm.sum()) < 8  # the thresholds split the sublayers


def test_at_48_layers_the_controllers_move_lambda_only_where_the_init_alarms():
    """At the archive's thresholds no sublayer alarms at init (c and the backward gain over
    their minima, tsim under its maximum), so both controllers leave the Post-Norm profile;
    with c_min = gain_min raised to the init's median, the one-way controller takes every
    alarming sublayer to Pre-Norm (lambda 0: its y, the Pre stream, only grows) and the
    two-way one leaves sublayers in between (at lambda 0 the gain is 1: lambda climbs back)."""
    config = _adaptive(48, 32)
    spec, t_input = fc.model_spec(config), float(config.model.init_tsim_input)
    init = fc._init_trace(spec, t_input)
    acts = len(diagnostic_steps(int(config.train.steps), config.diag))
    for signal in ("post_input_c", "two_way"):
        control = dataclasses.replace(placement_control(config), signal=signal)
        assert min(init.c_mean.min(), init.sublayer_skip_gain.min()) > control.c_min
        assert max(init.tsim_in.max(), init.tsim_after[:, 0].max()) < control.tsim_max
        assert np.all(_profile(fc.settled_spec(spec, t_input, control, acts)) == 1)
    raised = float(np.median(init.c_mean))
    one_way, two_way = (
        _profile(fc.settled_spec(spec, t_input, dataclasses.replace(
            placement_control(config), signal=signal, c_min=raised, gain_min=raised), acts))
        for signal in ("post_input_c", "two_way"))
    alarmed_Lx2 = init.c_mean < raised
    assert np.all(one_way[alarmed_Lx2] == 0)
    between = (two_way > 0.05) & (two_way < 0.95)
    assert between.sum() >= 4
    assert np.all(one_way[between] == 0)
    assert two_way.sum() > one_way.sum()


@pytest.mark.parametrize("model,train", [
    ({"norm": "post"}, {}), ({"norm": "pre"}, {}), ({"norm": "deepnorm"}, {}),
    ({"norm": "adaptive", "adaptive_initial_mix": 0.5}, {"placement_controller": False})])
def test_without_a_controller_the_theory_inputs_are_the_init_traces(model, train):
    config = small_config(**model)
    config.train.update(train)
    spec, t_input = fc.model_spec(config), float(config.model.init_tsim_input)
    assert placement_control(config) is None
    assert fc.settled_spec(spec, t_input, None, 30) is spec
    trace = fc._init_trace(spec, t_input)
    inputs = fc.step0_inputs(config)
    assert (inputs["tsim_max"], inputs["tsim_mean"], inputs["log_skip_gain"]) == (
        float(trace.tsim_after.max()), float(trace.tsim_in.mean()),
        float(np.sum(np.log(trace.skip_gain))))


@pytest.mark.parametrize("model, share", [
    ({"norm": "pre"}, 0.0), ({"norm": "sandwich"}, 0.0), ({"norm": "periln"}, 0.0),
    ({"norm": "post"}, 1.0), ({"norm": "deepnorm", "init": "xavier_normal"}, 1.0),
    ({"norm": "admin"}, 1.0),
    ({"norm": "mixln", "n_layers": 8, "mixln_post_fraction": 0.25}, 0.25),  # 2 Post layers of 8
    ({"norm": "adaptive", "adaptive_initial_mix": 0.5}, 1.0)])  # every sublayer half Post
def test_the_post_share_is_the_share_of_sublayers_with_a_norm_on_the_skip_path(model, share):
    config = small_config(**model)
    config.train.placement_controller = False
    config.opt.lr = 3e-3
    inputs = fc.step0_inputs(config)
    assert inputs["post_share"] == share
    assert inputs["log_lr_on_post"] == pytest.approx(share * np.log(3e-3), abs=1e-12)


@pytest.mark.parametrize("warmup,schedule", [(20, "cosine"), (100, "cosine"), (5, "constant")])
def test_erase_step_sums_the_schedules_formula(warmup, schedule):
    config = base_config()
    config.opt.update({"warmup_steps": warmup, "schedule": schedule, "lr": 3e-3})
    steps, lr, low = 300, 3e-3, config.opt.min_lr_ratio
    moved, reached = 0.0, None
    for t in range(steps):  # optax's linear warmup, then cosine to lr * min_lr_ratio
        if t < warmup:
            rate = lr * t / warmup
        elif schedule == "constant":
            rate = lr
        else:
            rate = lr * (low + (1 - low) * 0.5 * (1 + math.cos(math.pi * (t - warmup)
                                                                 / (steps - warmup))))
        moved += rate
        if reached is None and moved >= 0.072:
            reached = t + 1
    assert fc.erase_step(config.opt, steps, 0.072) == reached
    assert fc.erase_step(config.opt, steps, 2 * moved) == pytest.approx(2 * steps, rel=1e-5)


def test_the_logistic_fit_meets_its_optimality_condition():
    rng = np.random.default_rng(1)
    x_NxF = rng.normal(size=(80, 3)) * [1.0, 5.0, 0.1]
    y_N = (x_NxF @ [1.0, -0.2, 4.0] + rng.normal(size=80)) > 0
    model = fc.fit_logistic(x_NxF, y_N, ("a", "b", "c"), l2=2.0)
    z_NxF = (x_NxF - x_NxF.mean(0)) / x_NxF.std(0)
    p_N = 1 / (1 + np.exp(-(z_NxF @ np.array(model.weights) + model.bias)))
    np.testing.assert_allclose(z_NxF.T @ (p_N - y_N) + 2.0 * np.array(model.weights), 0,
                               atol=1e-8)
    assert abs(np.sum(p_N - y_N)) < 1e-8  # the unpenalised bias


def test_the_onset_is_the_rules_similar_layers_step_on_every_archived_run():
    for entry in read_archive(str(ARCHIVE)):
        collapse = entry["result"]["collapse"]
        assert half_alike_step(collapse["diag_steps"], collapse["fraction_collapsed"]) == \
            collapse["similar_layers_step"]


LEADERBOARD_RECORD = ARCHIVE / "post_layers48_lr0.001_warmup20_seed0.json"


@pytest.mark.parametrize("eval_over_floor", [0.94, 0.96])
def test_a_record_without_measures_is_labelled_by_its_held_out_loss(eval_over_floor):
    entry = json.loads(LEADERBOARD_RECORD.read_text())
    measured = fc.archive_row(entry)
    assert (measured["floor_loss"], measured["monitored"]) == ("fresh", True)
    assert measured["floor"] == (entry["measures"]["fresh_loss"] / entry["measures"]["lfreq"]
                                 >= 0.95)
    result = entry["result"]
    entry = entry | {"measures": None, "result": result | {
        "final_eval_loss": eval_over_floor * result["eval_floor"]}}
    row = fc.archive_row(entry)
    assert (row["floor_loss"], row["monitored"], row["first_warn"]) == ("eval", False, None)
    assert row["floor"] == (eval_over_floor >= 0.95)
    assert row["loss_over_floor"] == pytest.approx(eval_over_floor, rel=1e-12)
    assert {k: row[k] for k in ("collapsed", "onset_step", "inputs", "early")} == \
        {k: measured[k] for k in ("collapsed", "onset_step", "inputs", "early")}
    without_eval = entry | {"result": entry["result"] | {"final_eval_loss": None}}
    assert fc.archive_row(without_eval) is None


def test_the_held_out_loss_over_its_batches_floor_labels_the_floor_as_fresh_batches_do():
    """On the leaderboard runs, which have both losses, the held-out label agrees with the
    fresh-batch one on nearly every run; over L_freq instead it would not."""
    both = [(e["measures"]["fresh_loss_over_lfreq"] >= 0.95,
             e["result"]["final_eval_loss"] / e["result"]["eval_floor"] >= 0.95,
             e["result"]["final_eval_loss"] / e["result"]["lfreq"] >= 0.95)
            for e in read_archive(str(ARCHIVE)) if e["result"]["status"] == "done"]
    agree_floor = np.mean([fresh == held for fresh, held, _ in both])
    agree_lfreq = np.mean([fresh == over for fresh, _, over in both])
    assert agree_floor >= 0.97 and agree_lfreq < agree_floor - 0.05, (agree_floor, agree_lfreq)


@pytest.mark.parametrize("clip_norm,clipped", [(0.0, 0.0), (0.1, 1.0), (1.0, 1.0)])
def test_the_clipping_input_is_whether_the_optimizer_clips(clip_norm, clipped):
    config = small_config()
    unclipped = fc.step0_inputs(config)
    config.opt.clip_norm = clip_norm
    inputs = fc.step0_inputs(config)
    assert inputs["clipped"] == clipped
    assert {k: v for k, v in inputs.items() if k != "clipped"} == \
        {k: v for k, v in unclipped.items() if k != "clipped"}  # a config flag, no theory


def test_the_onset_snaps_to_the_runs_own_diagnostic_steps():
    config = base_config()
    config.train.steps = 3000
    config.diag.update({"every": 50, "dense_every": 10, "dense_until": 300})
    assert [fc.snap_to_diagnostic_step(s, config) for s in (0.2, 3.0, 123.0, 304.0, 326.0,
                                                            9999.0)] == [1, 1, 120, 300, 350,
                                                                         3000]


def _synthetic(groups: int = 5, per_group: int = 10, seed: int = 3):
    """Rows in groups whose outcomes depend on the inputs and on a per-group shift."""
    rng = np.random.default_rng(seed)
    x_NxF = rng.normal(size=(groups * per_group, 3))
    shift_N = np.repeat(rng.normal(0, 1.5, groups), per_group)
    y_N = (x_NxF @ [1.5, -1.0, 0.0] + shift_N + rng.logistic(size=len(x_NxF))) > 0
    names = [f"g{i}" for i in range(groups)]
    return x_NxF, y_N.astype(float), list(np.repeat(names, per_group)), ("a", "b", "c")


def _nll(params, s_N, y_N):
    z_N = params[0] * s_N + params[1]
    return np.sum(np.logaddexp(0, z_N) - y_N * z_N)


def test_platts_map_is_the_likelihood_optimum_and_folds_into_the_weights():
    rng = np.random.default_rng(4)
    s_N = rng.normal(0, 3, 200)
    y_N = (rng.random(200) < 1 / (1 + np.exp(-(0.4 * s_N - 0.5)))).astype(float)
    a, b = fc.fit_platt(s_N, y_N)
    reference = minimize(_nll, [1.0, 0.0], args=(s_N, y_N), method="Nelder-Mead",
                         options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 10000})
    np.testing.assert_allclose([a, b], reference.x, atol=1e-5)
    model = fc.fit_logistic(rng.normal(size=(200, 2)), y_N, ("u", "v"))
    x_NxF = rng.normal(size=(7, 2))
    np.testing.assert_allclose(fc.probability(model.recalibrated(a, b), x_NxF),
                               1 / (1 + np.exp(-(a * model.score(x_NxF) + b))), rtol=1e-12)


def _plain_variant(x_NxF, y_N, groups_N, train_N, variant):
    """fit_variant without memoisation or shared code: loops over the inner groups, scipy's
    Platt map; returns the fitted (Linear, a, b)."""
    inner_l2, platt = fc.VARIANTS[variant]
    inner = sorted(set(groups_N[train_N]))
    y_M = y_N[train_N]

    def inner_scores(l2):
        s_N = np.zeros(len(y_N))
        for g in inner:
            fit_N, held_N = train_N & (groups_N != g), train_N & (groups_N == g)
            s_N[held_N] = fc.fit_logistic(x_NxF[fit_N], y_N[fit_N], "abc", l2).score(
                x_NxF[held_N])
        return s_N[train_N]

    usable = len(inner) >= 2 and 0 < y_M.sum() < len(y_M)
    l2 = fc.L2
    if inner_l2 and usable:
        l2 = min(fc.L2_GRID, key=lambda v: np.mean((1 / (1 + np.exp(-inner_scores(v))) - y_M)
                                                   ** 2))
    a, b = 1.0, 0.0
    if platt and usable:
        a, b = minimize(_nll, [1.0, 0.0], args=(inner_scores(l2), y_M), method="Nelder-Mead",
                        options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 10000}).x
    return fc.fit_logistic(x_NxF[train_N], y_N[train_N], "abc", l2), a, b


def test_the_nested_selection_matches_a_plain_reimplementation():
    x_NxF, y_N, groups, names = _synthetic()
    groups_N = np.array(groups)
    folds = fc.Folds(x_NxF, y_N, [{("inner", g)} for g in groups], names)
    model, info = fc.fit_selected(folds)
    everything_N = np.ones(len(y_N), bool)
    for variant, reported in info["inner_brier"].items():
        p_N = np.zeros(len(y_N))
        for g in sorted(set(groups)):
            linear, a, b = _plain_variant(x_NxF, y_N, groups_N, groups_N != g, variant)
            held_N = groups_N == g
            p_N[held_N] = 1 / (1 + np.exp(-(a * linear.score(x_NxF[held_N]) + b)))
        assert reported == pytest.approx(np.mean((p_N - y_N) ** 2), abs=1e-7), variant
    linear, a, b = _plain_variant(x_NxF, y_N, groups_N, everything_N, info["variant"])
    assert info["variant"] == min(info["inner_brier"], key=info["inner_brier"].get)
    np.testing.assert_allclose(fc.probability(model, x_NxF),
                               1 / (1 + np.exp(-(a * linear.score(x_NxF) + b))), atol=1e-6)


@pytest.mark.parametrize("outer_is_inner", [True, False])
def test_a_held_out_probability_never_sees_its_own_label(outer_is_inner):
    x_NxF, y_N, groups, names = _synthetic(groups=6, per_group=8)
    outer = groups if outer_is_inner else [i % 3 for i in range(len(groups))]
    p_N, p_VxN, _ = fc.held_out(x_NxF, y_N, outer, groups, names)
    for run in (0, 13, 47):
        flipped_N = y_N.copy()
        flipped_N[run] = 1 - flipped_N[run]
        q_N, q_VxN, _ = fc.held_out(x_NxF, flipped_N, outer, groups, names)
        assert q_N[run] == p_N[run]
        assert all(q_VxN[v][run] == p_VxN[v][run] for v in fc.VARIANTS)
        others_N = np.array(outer) != outer[run]
        assert np.any(q_N[others_N] != p_N[others_N])  # the label is used where it may be


def test_the_fit_reads_methods_as_labels_only():
    x_NxF, y_N, groups, names = _synthetic()
    renamed = {g: f"zz_{i}" for i, g in enumerate(reversed(sorted(set(groups))))}
    fits = [fc.fit_selected(fc.Folds(x_NxF, y_N, [{("inner", m)} for m in labels], names))
            for labels in (groups, [renamed[g] for g in groups])]
    assert fits[0] == fits[1]


@pytest.mark.slow
def test_the_committed_model_and_validation_are_the_commands_output(tmp_path):
    """The command FORECAST.md gives rewrites model.json and validation.json as committed from
    the archive alone (run as a process: it defines its own flags). Slow: it refits every fold,
    a cost that grows with the archive."""
    result = subprocess.run([sys.executable, "-m", "experiments.forecast_validation",
                             f"--out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env=subprocess_env(None))
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("model.json", "validation.json"):
        assert_json_matches(json.loads((tmp_path / name).read_text()),
                            json.loads((FORECAST_DIR / name).read_text()))


def _independent_auc(y, p) -> float:
    ranks = rankdata(p)  # Mann-Whitney: average ranks for ties
    pos = np.asarray(y, bool)
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_the_committed_scores_recompute_from_the_committed_probabilities():
    report = json.loads((FORECAST_DIR / "validation.json").read_text())
    runs = report["per_run"]
    for scheme, result in report["schemes"].items():
        for name, scores in result["collapse"].items():
            if name.startswith("monitor"):
                continue
            p = [r["p_collapse"][scheme][name] for r in runs]
            y = [r["collapsed"] for r in runs]
            assert math.isclose(scores["auc"], _independent_auc(y, p), rel_tol=1e-9)
            brier = sum((pi - yi) ** 2 for pi, yi in zip(p, y, strict=True)) / len(p)
            assert math.isclose(scores["brier"], brier, rel_tol=1e-9)
        p = [r["p_floor"][scheme] for r in runs]
        assert math.isclose(result["floor"]["auc"],
                            _independent_auc([r["floor"] for r in runs], p), rel_tol=1e-9)


def test_the_forecast_is_deterministic_and_states_an_onset_only_for_a_collapse():
    models = json.loads((FORECAST_DIR / "model.json").read_text())
    first = fc.forecast_config(small_config(), models)
    assert fc.forecast_config(small_config(), models) == first
    pre = fc.forecast_config(small_config(norm="pre"), models)
    assert (pre["onset_step"] is None) == (pre["p_collapse"] < 0.5)


def run_forecast(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.forecast", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=subprocess_env(None))


def test_the_cli_writes_exactly_the_four_keys_and_the_same_forecast_twice(tmp_path):
    outputs = []
    for name in ("a.json", "b.json"):
        result = run_forecast("--config", "configs/default.py:layers=12", "--json",
                              str(tmp_path / name))
        assert result.returncode == 0, result.stderr[-2000:]
        outputs.append(json.loads((tmp_path / name).read_text()))
    assert outputs[0] == outputs[1]
    assert set(outputs[0]) == {"p_collapse", "p_floor", "onset_step", "inputs"}
    assert set(outputs[0]["inputs"]) == set(fc.STEP0)
    assert "p_collapse" in result.stdout


@pytest.mark.parametrize("args,flags", [
    ("model.norm=admin", {}),
    ("model.init=xavier_normal,model.norm=deepnorm", {}),
    ("model.norm=adaptive,train.placement_signal=two_way", {}),
    ("model.norm=adaptive,train.placement_controller=False,model.adaptive_profile="
     + " ".join(["1 0.5"] * 12), {})])
def test_the_cli_forecasts_the_new_arrangements(tmp_path, args, flags):
    result = run_forecast("--config", f"configs/default.py:layers=12,{args}", "--json",
                          str(tmp_path / "f.json"))
    assert result.returncode == 0, result.stderr[-2000:]
    inputs = json.loads((tmp_path / "f.json").read_text())["inputs"]
    assert all(math.isfinite(e["value"]) and math.isfinite(e["log_odds"])
               for e in inputs.values())
    assert {n: inputs[n]["value"] for n in flags} == flags


def test_the_cli_refuses_an_unknown_field_in_one_line(tmp_path):
    result = run_forecast("--config", "configs/default.py:model.bogus=1", "--json",
                          str(tmp_path / "f.json"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "postnorm: error: unknown config key 'model.bogus'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "f.json").exists()


def _doc_table(text: str, header: str) -> dict[str, list[str]]:
    """The markdown table under ``header`` (its first cells) as first cell -> the others."""
    lines = text.split(header, 1)[1].splitlines()[2:]
    block = lines[:next((i for i, line in enumerate(lines) if not line.startswith("|")),
                        len(lines))]
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in block}


def test_the_committed_validation_tables_are_its_json_and_the_docs_cite_them():
    """validation.md's score tables, per scheme, are validation.json's numbers (FORECAST.md
    cites the file and retypes none of them)."""
    report = json.loads((FORECAST_DIR / "validation.json").read_text())
    text = (FORECAST_DIR / "validation.md").read_text()
    sections = {"leave one method out": text.split("## Leave one method out", 1)[1]
                .split("## Leave one depth out", 1)[0],
                "leave one depth out": text.split("## Leave one depth out", 1)[1]}
    for scheme, section in sections.items():
        rows = _doc_table(section, "| forecast | AUC")
        collapse = report["schemes"][scheme]["collapse"]
        assert set(rows) == set(collapse)
        for name, cells in rows.items():
            assert cells[:2] == [f"{collapse[name]['auc']:.3f}",
                                 f"{collapse[name]['brier']:.3f}"], (scheme, name)
