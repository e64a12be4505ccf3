"""Adaptive norm placement: the mixed forward against numpy at any lambda, the controller against
its rule, and a training run whose logged lambda replays the rule over its logged statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from postnorm.model import Decoder, ModelSpec
from postnorm.train.loop import train_and_evaluate
from postnorm.train.placement_control import PlacementControl
from postnorm.workdir.metrics import layer_series, read_metrics
from tests import numpy_reference as ref
from tests.reliability_helpers import tiny_config, write_corpus
from tests.test_arrangements import init_params, random_gains

TINY = dict(vocab_size=50, max_len=12, n_layers=3, d_model=16, n_heads=4, d_ff=24)


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


def numpy_rule(mix, c_attn, c_ffn, t_attn, t_ffn, c_min, tsim_max, down, up):
    out = np.array(mix, np.float64)
    for layer in range(out.shape[0]):
        for sub, (c, t) in enumerate(((c_attn, t_attn), (c_ffn, t_ffn))):
            alarm = c[layer] < c_min or t[layer] > tsim_max
            out[layer, sub] = min(1.0, max(0.0, out[layer, sub] + (-down if alarm else up)))
    return out


def test_the_controller_applies_its_rule():
    rng = np.random.default_rng(0)
    mix = rng.uniform(0, 1, size=(6, 2)).astype(np.float32)
    forward = {k: jnp.asarray(rng.uniform(0.7, 1.0, size=6), jnp.float32)
               for k in ("c_mean_attn", "c_mean_ffn", "tsim_attn", "tsim_ffn")}
    control = PlacementControl(c_min=0.85, tsim_max=0.9, rate_down=0.3, rate_up=0.05)
    got = np.asarray(control(jnp.asarray(mix), forward))
    want = numpy_rule(mix, *(np.asarray(forward[k]) for k in
                             ("c_mean_attn", "c_mean_ffn", "tsim_attn", "tsim_ffn")),
                      0.85, 0.9, 0.3, 0.05)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (want == 0).any() or (want < mix).any()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("controller", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_run_logs_lambda_and_it_follows_the_rule(corpus, tmp_path, controller):
    """Each diagnostic step logs the lambda it ran with; the next one's equals the rule applied
    to the first's logged lambda, c and tsim (the controller off: lambda never moves)."""
    config = tiny_config(corpus, tmp_path / "tfds", model__norm="adaptive",
                         model__adaptive_initial_mix=0.8, train__steps=12, diag__every=3,
                         train__placement_controller=controller, train__placement_c_min=0.97,
                         train__placement_rate_down=0.3, train__placement_rate_up=0.1)
    train_and_evaluate(config, str(tmp_path / "run"))
    series = layer_series(read_metrics(str(tmp_path / "run")))
    steps, lam_attn = series["post_mix_attn"]
    _, lam_ffn = series["post_mix_ffn"]
    assert list(steps) == [1, 3, 6, 9, 12]
    mix_LxSx2 = np.stack([lam_attn, lam_ffn], axis=-1)
    np.testing.assert_allclose(mix_LxSx2[:, 0], 0.8, rtol=1e-6)
    stats = {k: series[k][1] for k in ("c_mean_attn", "c_mean_ffn", "tsim_attn", "tsim_ffn")}
    for s in range(len(steps) - 1):
        if controller:
            want = numpy_rule(mix_LxSx2[:, s], *(stats[k][:, s] for k in
                                                  ("c_mean_attn", "c_mean_ffn", "tsim_attn",
                                                   "tsim_ffn")), 0.97, 0.9, 0.3, 0.1)
        else:
            want = mix_LxSx2[:, s]
        np.testing.assert_allclose(mix_LxSx2[:, s + 1], want, rtol=1e-6, atol=1e-7)
    assert controller == (not np.allclose(mix_LxSx2, 0.8))
