"""The similarity-aware init: the solved W_O gain against the recursion it solves, against a
simulated stack, and at init; the configs it refuses."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.default import get_config
from postnorm import theory
from postnorm.analysis import monte_carlo
from postnorm.config.schema import ConfigError
from postnorm.model import PLACEMENTS, Decoder, ModelSpec
from postnorm.model.placements import init_gains
from postnorm.model.similarity_init import solve_attention_gain, with_similarity_init
from postnorm.train.validate import check_config

SMALL = dict(vocab_size=2, max_len=64, n_layers=24, d_model=128, n_heads=4, d_ff=384,
             positions="none")


def predicted_max_tsim(spec: ModelSpec, gain: float, t_input: float) -> float:
    """The recursion's largest tsim after any sublayer, written out from ``theory``: the W_O gain
    scales the attention amount s by gain^2."""
    base = theory.amounts(spec.d_model, spec.d_ff, spec.init).with_gains(
        PLACEMENTS[spec.norm].init_gains(spec))
    amt = dataclasses.replace(base, s=base.s * gain**2)
    n = spec.max_len
    rho = (n * t_input - 1) / (n - 1)
    trace = theory.mean_field_recursion((1 - rho) * np.eye(n) + rho, spec.n_layers, amt,
                                        PLACEMENTS[spec.norm].gram_maps(spec))
    return float(trace.tsim_after.max())


@pytest.mark.parametrize("norm,target,t_input", [("post", 0.3, 1 / 64), ("post", 0.2, 0.05),
                                                 ("pre", 0.12, 0.05), ("mixln", 0.2, 0.05)])
def test_the_solved_gain_is_the_largest_that_meets_the_target(norm, target, t_input):
    spec = ModelSpec(**SMALL, norm=norm)
    gain = solve_attention_gain(spec, target, t_input)
    assert 0 < gain < 1
    assert predicted_max_tsim(spec, gain, t_input) <= target
    assert predicted_max_tsim(spec, gain * 1.02, t_input) > target


def test_a_plain_init_under_the_target_keeps_gain_one():
    spec = ModelSpec(**SMALL, norm="deepnorm")
    assert predicted_max_tsim(spec, 1.0, 0.05) < 0.3
    assert solve_attention_gain(spec, 0.3, 0.05) == 1.0
    assert with_similarity_init(spec, 0.0, 0.05) is spec


def last_layer_tsim(spec: ModelSpec, seeds: int) -> float:
    """tsim leaving the last layer of the decoder's own stack (softmax attention, W_O drawn with
    the spec's gain), on iid N(0, 1) inputs, mean over ``seeds`` weight and input draws."""
    run = monte_carlo.stack_statistics(spec, "softmax")
    values = []
    for seed in range(seeds):
        key_params, key_x = jax.random.split(jax.random.key(seed))
        stats = run(monte_carlo.init_stack_params(spec, key_params),
                    jax.random.normal(key_x, (1, spec.max_len, spec.d_model)))
        values.append(float(stats["tsim_final"]))
    return float(np.mean(values))


def test_the_solved_gain_holds_a_simulated_stack_at_the_target():
    """The plain Post-Norm stack ends above the target; with the solved gain it ends within 10%
    of it (the recursion assumes uniform attention; softmax at init is close to it)."""
    spec = ModelSpec(**SMALL, norm="post")
    target = 0.3
    solved = with_similarity_init(spec, target, 1 / spec.max_len)
    assert solved.attn_out_gain < 1
    assert last_layer_tsim(spec, 16) > 1.1 * target
    assert last_layer_tsim(solved, 16) <= 1.1 * target


def test_the_gain_multiplies_w_o_at_init_and_nothing_else():
    spec = ModelSpec(vocab_size=50, max_len=12, n_layers=3, d_model=16, n_heads=4, d_ff=24,
                     norm="deepnorm")
    scaled = dataclasses.replace(spec, attn_out_gain=0.5)
    assert init_gains(scaled)["w_o"] == pytest.approx(0.5 * (8 * 3) ** -0.25)

    def params(s: ModelSpec) -> dict:
        return nn.unbox(Decoder(s).init(jax.random.key(0), jnp.zeros((1, 12), jnp.int32))["params"])

    plain, halved = params(spec), params(scaled)
    for path, leaf in jax.tree_util.tree_leaves_with_path(halved):
        reference = plain
        for entry in path:
            reference = reference[entry.key]
        factor = 0.5 if path[-1].key == "w_o" else 1.0
        np.testing.assert_allclose(np.asarray(leaf), factor * np.asarray(reference), rtol=1e-6)


@pytest.mark.parametrize("fields,message", [
    ("model.norm=sandwich,model.init_tsim_target=0.5", "undoes with the norm on each branch"),
    ("model.init_tsim_target=0.04,model.init_tsim_input=0.05", "is not above the input"),
    ("model.init_tsim_target=1.5", r"model.init_tsim_target=1.5 .*in \[0, 1\)"),
    ("model.norm=pre,model.b2t_rescaled_init=True", "an option of model.norm='b2t'"),
    ("model.mixln_post_fraction=1.5", r"model.mixln_post_fraction=1.5 .*in \[0, 1\]"),
])
def test_bad_init_fields_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        check_config(get_config(fields), device_count=1)
