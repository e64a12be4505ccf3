"""Adaptive norm placement: the mixed forward against numpy at any lambda, both controller
signals against their rules, the two-way signal clearing at lambda = 0 where the one-way one
cannot, a training run whose logged lambda replays the rule over its logged statistics, its
recorded final profile and figure, and the fixed-profile control."""

import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.default import get_config
from postnorm.analysis import figures
from postnorm.config.schema import ConfigError
from postnorm.model import PLACEMENTS, Decoder, ModelSpec
from postnorm.model.placements import profile_text, profile_values
from postnorm.sweep.record import planned_digests, run_once
from postnorm.theory import POST_GRAM, PRE_GRAM
from postnorm.train.losses import Loss
from postnorm.train.placement_control import PlacementControl, final_profile
from postnorm.train.state import GuardedState
from postnorm.train.steps import diag_step, with_update_norms
from postnorm.train.validate import check_model, check_train
from postnorm.workdir.metrics import layer_series, read_metrics
from tests import jax_reference as jax_ref
from tests import numpy_reference as ref
from tests.diagnostics.test_taps import reference_cotangents
from tests.model.test_placements import init_params, random_gains
from tests.reliability_helpers import REPO, tiny_config, write_corpus

TINY = dict(vocab_size=50, max_len=12, n_layers=3, d_model=16, n_heads=4, d_ff=24)
STATS = ("c_mean_attn", "c_mean_ffn", "tsim_attn", "tsim_ffn", "dldx_norm_attn", "dldx_norm_ffn")


def test_the_mixed_forward_matches_numpy_at_any_lambda():
    spec = ModelSpec(**TINY, norm="adaptive")
    params = random_gains(init_params(spec, 3), 4)
    mix_Lx2 = np.random.default_rng(5).uniform(0, 1, size=(3, 2)).astype(np.float32)
    tokens = np.random.default_rng(0).integers(0, 50, size=(2, 12))
    logits = np.asarray(Decoder(spec).apply({"params": params}, jnp.asarray(tokens),
                                            post_mix_Lx2=jnp.asarray(mix_Lx2)))
    for b in range(2):
        want = ref.forward(jax.tree.map(np.asarray, params), tokens[b], n_layers=3, n_heads=4,
                           norm="adaptive", positions="rope", eps=spec.norm_eps,
                           rope_base=spec.rope_base, tie=False, post_mix=mix_Lx2)
        np.testing.assert_allclose(logits[b], want, rtol=1e-4, atol=1e-4)


def numpy_gain(dldx_attn, dldx_ffn, dldx_final):
    """||dL/dX|| at each sublayer's input over that at the next input (the stack's output after
    the last), [L, 2] in float64; 0 where the next is 0."""
    g_K = np.concatenate([np.ravel(np.stack([dldx_attn, dldx_ffn], axis=1)), [dldx_final]])
    g_K = g_K.astype(np.float64)
    gain = np.zeros(len(g_K) - 1)
    for k in range(len(gain)):
        gain[k] = g_K[k] / g_K[k + 1] if g_K[k + 1] > 0 else 0.0
    return gain.reshape(-1, 2)


def numpy_rule(mix, stats, final, signal, c_min, tsim_max, gain_min, down, up):
    """The controller's rule, sublayer by sublayer; ``stats`` [L, S] per name of ``STATS``."""
    out = np.array(mix, np.float64)
    gain = numpy_gain(stats["dldx_norm_attn"], stats["dldx_norm_ffn"], final)
    for layer in range(out.shape[0]):
        for sub, kind in enumerate(("attn", "ffn")):
            if signal == "two_way":
                alarm = gain[layer, sub] < gain_min
            else:
                alarm = (stats[f"c_mean_{kind}"][layer] < c_min
                         or stats[f"tsim_{kind}"][layer] > tsim_max)
            out[layer, sub] = min(1.0, max(0.0, out[layer, sub] + (-down if alarm else up)))
    return out


@pytest.mark.parametrize("signal", ["post_input_c", "two_way"])
def test_the_controller_applies_its_rule(signal):
    """Random statistics (a vanished gradient above one sublayer included) against numpy."""
    rng = np.random.default_rng(0)
    mix = rng.uniform(0, 1, size=(6, 2)).astype(np.float32)
    stats = {k: rng.uniform(0.7, 1.0, size=6).astype(np.float32) for k in STATS}
    stats["dldx_norm_attn"][2] = 0.0  # the FFN of layer 1 has no gradient above it
    final = np.float32(0.8)
    control = PlacementControl(signal=signal, c_min=0.85, tsim_max=0.9, gain_min=0.95,
                               rate_down=0.3, rate_up=0.05)
    diagnostics = {k: jnp.asarray(v) for k, v in stats.items()}
    got = np.asarray(control(jnp.asarray(mix), {**diagnostics, "dldx_norm_final": final}))
    want = numpy_rule(mix, stats, final, signal, 0.85, 0.9, 0.95, 0.3, 0.05)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (want < mix).any() and (want > mix).any()
    if signal == "two_way":
        assert want[1, 1] == max(0.0, mix[1, 1] - 0.3)


@functools.cache
def grown_pre_stream():
    """A tiny adaptive model at lambda = 0 everywhere (Pre-Norm) whose stream has grown: the
    embedding x 10, so every Post norm's input y = X + F is long and its c small."""
    spec = ModelSpec(**{**TINY, "max_len": 16}, positions="none", norm="adaptive",
                     adaptive_initial_mix=0.0)
    tokens = jax.random.randint(jax.random.key(1), (3, 17), 0, spec.vocab_size)
    model = Decoder(spec)
    params = nn.unbox(model.init(jax.random.key(0), tokens[:, :-1])["params"])
    params = {**params, "embedding": 10.0 * params["embedding"]}
    return spec, model, params, tokens[:, :-1], tokens[:, 1:]


def test_at_lambda_0_the_two_way_signal_clears_and_lambda_rises():
    """On a grown Pre-Norm stream the backward gain ||dL/dX_k|| / ||dL/dX_k+1||, from the
    cotangents of the unscanned reference forward (jax.vjp) in float64, is about 1 >= gain_min
    at every sublayer, while c of the Post norm's input y = X_k+1 (numpy) is far under c_min:
    one diagnostic step raises every lambda by rate_up under the two-way signal, and the
    one-way signal holds every lambda at 0."""
    spec, model, params, inputs, targets = grown_pre_stream()
    _, cotangents = reference_cotangents(spec, params, inputs, targets)
    g_K = np.array([np.sqrt(np.sum(np.asarray(g, np.float64) ** 2)) for g in cotangents])
    gain_Lx2 = (g_K[:-1] / g_K[1:]).reshape(spec.n_layers, 2)
    inputs_k, last = jax_ref.stream(jax_ref.sublayers(params, spec),
                                    jax_ref.embed(params, inputs, spec))
    # at lambda = 0 a sublayer's output is y = X + F, its Post norm's input (unit gains at init)
    y_K = [np.asarray(x, np.float64) for x, _ in inputs_k[1:]] + [np.asarray(last, np.float64)]
    c_Lx2 = np.array([np.mean(1.0 / np.sqrt(np.mean(y * y, axis=-1) + spec.norm_eps))
                      for y in y_K]).reshape(spec.n_layers, 2)
    assert (gain_Lx2 > 0.9).all() and (c_Lx2 < 0.2).all()
    batch = {"inputs": inputs, "targets": targets}
    for signal, want in (("two_way", 0.02), ("post_input_c", 0.0)):
        control = PlacementControl(signal=signal, c_min=0.9, tsim_max=0.9, gain_min=0.9,
                                   rate_down=0.25, rate_up=0.02)
        state = GuardedState.create_guarded(apply_fn=model.apply, params=params,
                                            tx=optax.adamw(1e-3),
                                            post_mix=jnp.zeros((spec.n_layers, 2)))
        step = with_update_norms(functools.partial(
            diag_step, schedule=optax.constant_schedule(1e-3), loss=Loss(), placement=control))
        new_state, _, diagnostics = jax.jit(step)(state, batch)
        np.testing.assert_allclose(new_state.post_mix, want, err_msg=signal)
        np.testing.assert_allclose(diagnostics["post_mix_next_attn"], want)
        np.testing.assert_allclose(np.stack([diagnostics["c_mean_attn"],
                                             diagnostics["c_mean_ffn"]], 1), c_Lx2, rtol=1e-4)


def test_the_profile_field_reads_back_a_float32_profile_exactly():
    profile_Lx2 = np.random.default_rng(0).uniform(0, 1, size=(5, 2)).astype(np.float32)
    profile_Lx2[0] = (0.0, 1.0)
    text = profile_text(profile_Lx2)
    np.testing.assert_array_equal(profile_values(text, 5), profile_Lx2)
    assert text.split()[:2] == ["0", "1"]
    spec = ModelSpec(**TINY, norm="adaptive", adaptive_profile=profile_text(profile_Lx2[:3]))
    np.testing.assert_array_equal(PLACEMENTS["adaptive"].post_mix(spec), profile_Lx2[:3])
    maps = PLACEMENTS["adaptive"].gram_maps(spec)
    assert maps[0] == (PRE_GRAM, POST_GRAM)
    assert [m.post_mix for pair in maps[1:] for m in pair] == profile_Lx2[1:3].ravel().tolist()


def test_a_0_1_profile_has_the_gram_maps_of_the_same_mixln_stack():
    mixln = ModelSpec(**{**TINY, "n_layers": 4}, norm="mixln", mixln_post_fraction=0.5)
    profile = profile_text(PLACEMENTS["mixln"].post_mix(mixln))
    assert profile == "1 1 1 1 0 0 0 0"
    spec = ModelSpec(**{**TINY, "n_layers": 4}, norm="adaptive", adaptive_profile=profile)
    assert PLACEMENTS["adaptive"].gram_maps(spec) == PLACEMENTS["mixln"].gram_maps(mixln)


@pytest.mark.parametrize(("fields", "message"), [
    ({"model.adaptive_profile": "1 1 0.5"}, "holds 3 values, not 2 x model.n_layers = 4"),
    ({"model.adaptive_profile": "1 1 0.5 x"}, "model.adaptive_profile='1 1 0.5 x' is not a"),
    ({"model.adaptive_profile": "1 1 0.5 1.5"}, "model.adaptive_profile holds values outside"),
    ({"model.adaptive_profile": "1 1 0.5 1", "model.norm": "post"},
     "model.adaptive_profile is an option of model.norm='adaptive'"),
    ({"model.adaptive_profile": "1 1 0.5 1", "model.adaptive_initial_mix": 0.5},
     "in place of model.adaptive_initial_mix=0.5"),
    ({"model.adaptive_profile": "1 0 0.5 1", "model.init_tsim_target": 0.5},
     "give model.adaptive_profile 0s and 1s alone"),
    ({"train.placement_signal": "both"}, "train.placement_signal='both' is invalid"),
    ({"train.placement_gain_min": 1.5}, "train.placement_gain_min=1.5 is invalid"),
])
def test_invalid_placement_fields_are_refused_by_name(fields, message):
    config = get_config("layers=2")
    config.model.norm = "adaptive"
    for path, value in fields.items():
        section, name = path.split(".")
        config[section][name] = value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_model(config)
        check_train(config)


def test_recorded_adaptive_runs_keep_the_one_way_signal():
    """An archived adaptive run (recorded before the new fields) is the schema's default config
    (its digest is among those a config of its fields may carry), not the two-way one."""
    path = REPO / "results/leaderboard/runs/adaptive_layers24_lr0.003_warmup20_seed0.json"
    entry = json.loads(path.read_text())
    assert "placement_signal" not in entry["config"]["train"]
    config = get_config()
    for section, fields in entry["config"].items():
        if isinstance(fields, dict):
            for name, value in fields.items():
                config[section][name] = value
        else:
            config[section] = fields
    config.model.attention = "auto"  # as the plan asked; config.json names the kernel it chose
    assert entry["result"]["config_digest"] in planned_digests(config)
    config.train.placement_signal = "two_way"
    assert entry["result"]["config_digest"] not in planned_digests(config)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


RUN_FIELDS = dict(model__norm="adaptive", train__steps=12, diag__every=3,
                  train__placement_c_min=0.97, train__placement_gain_min=0.99,
                  train__placement_rate_down=0.3, train__placement_rate_up=0.1)


@pytest.fixture(scope="module")
def run_of(corpus, tmp_path_factory):
    """signal -> (workdir, result) of a 12-step run recorded by ``run_once`` from lambda 0.8,
    its controller reading ``signal`` (each trained once per module)."""

    @functools.cache
    def run(signal: str) -> tuple[str, dict]:
        root = tmp_path_factory.mktemp(signal)
        config = tiny_config(corpus, root / "tfds", model__adaptive_initial_mix=0.8,
                             train__placement_signal=signal, **RUN_FIELDS)
        return str(root / "run"), run_once(config, str(root / "run"))

    return run


def logged_mix(series: dict, name: str = "post_mix") -> np.ndarray:
    """lambda [L, S, 2] as logged under ``<name>_attn`` and ``<name>_ffn``."""
    return np.stack([series[f"{name}_attn"][1], series[f"{name}_ffn"][1]], axis=-1)


@pytest.mark.parametrize("signal", ["post_input_c", "two_way"])
def test_a_run_logs_lambda_follows_the_rule_and_records_its_final_profile(run_of, signal):
    """Each diagnostic step logs the lambda it ran with and the one it leaves (the next one's),
    which is the rule applied to its logged lambda and statistics; the record's
    ``final_post_mix`` is the one the last diagnostic step left, and the run's plots hold the
    lambda heatmap."""
    workdir, result = run_of(signal)
    records = read_metrics(workdir)
    series = layer_series(records)
    steps = series["post_mix_attn"][0]
    assert list(steps) == [1, 3, 6, 9, 12]
    mix_LxSx2, next_LxSx2 = logged_mix(series), logged_mix(series, "post_mix_next")
    np.testing.assert_allclose(mix_LxSx2[:, 0], 0.8, rtol=1e-6)
    np.testing.assert_array_equal(next_LxSx2[:, :-1], mix_LxSx2[:, 1:])
    final_S = [r["diag/dldx_norm_final"] for r in records if "diag/dldx_norm_final" in r]
    for s in range(len(steps)):
        want = numpy_rule(mix_LxSx2[:, s], {k: series[k][1][:, s] for k in STATS}, final_S[s],
                          signal, 0.97, 0.9, 0.99, 0.3, 0.1)
        np.testing.assert_allclose(next_LxSx2[:, s], want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(mix_LxSx2, 0.8)
    assert result["status"] == "done"
    np.testing.assert_array_equal(result["final_post_mix"], next_LxSx2[:, -1])
    np.testing.assert_array_equal(final_profile(records), next_LxSx2[:, -1])
    with open(os.path.join(workdir, "plots", "heatmap_post_mix.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_lambda_heatmap_shows_every_sublayer_at_every_step(tmp_path, monkeypatch):
    """Row 2l is layer l's attention, row 2l + 1 its FFN, column j the j-th diagnostic step,
    on a colour scale fixed to [0, 1]."""
    kept = {}
    monkeypatch.setattr(figures, "save_figure", lambda fig, path, **_: kept.update(fig=fig))
    steps = np.array([1, 3, 6])
    attn_LxS, ffn_LxS = np.array([[1.0, 0.7, 0.4], [1.0, 0.9, 0.8]]), np.full((2, 3), 0.25)
    path = figures.plot_post_mix({"post_mix_attn": (steps, attn_LxS),
                                  "post_mix_ffn": (steps, ffn_LxS)}, str(tmp_path))
    assert path.endswith("heatmap_post_mix.png")
    mesh = kept["fig"].axes[0].collections[0]
    np.testing.assert_array_equal(np.asarray(mesh.get_array()).reshape(4, 3),
                                  [attn_LxS[0], ffn_LxS[0], attn_LxS[1], ffn_LxS[1]])
    assert mesh.get_clim() == (0.0, 1.0)
    assert figures.plot_post_mix({"tsim_attn": (steps, attn_LxS)}, str(tmp_path)) is None


def test_a_fixed_profile_run_keeps_a_runs_final_profile_from_step_0(run_of, corpus, tmp_path):
    """The control of the controller: the two-way run's recorded final profile, given as
    model.adaptive_profile with the controller off, is lambda at every step of a new run."""
    _, result = run_of("two_way")
    profile_Lx2 = np.asarray(result["final_post_mix"], np.float32)
    config = tiny_config(corpus, tmp_path / "tfds", train__placement_controller=False,
                         model__adaptive_profile=profile_text(profile_Lx2),
                         **{**RUN_FIELDS, "train__steps": 6})
    fixed = run_once(config, str(tmp_path / "run"))
    mix_LxSx2 = logged_mix(layer_series(read_metrics(str(tmp_path / "run"))))
    assert mix_LxSx2.shape[1] == 3  # steps 1, 3, 6
    np.testing.assert_array_equal(mix_LxSx2, np.repeat(profile_Lx2[:, None], 3, axis=1))
    np.testing.assert_array_equal(fixed["final_post_mix"], profile_Lx2)
