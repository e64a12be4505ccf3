"""The C++ CPU attention kernel (``model.attention='cpu'``): against a float64 numpy forward and
``jax.vjp`` of a plain jnp attention, on a mesh, under remat, and its build and config errors."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs.default import get_config
from postnorm.config.schema import ConfigError
from postnorm.kernels import build
from postnorm.kernels.causal_attention import (
    HEAD_DIMS,
    _forward,
    cpu_causal_attention,
    cpu_causal_attention_with_stats,
)
from postnorm.model import REMAT_POLICIES
from postnorm.train.validate import check_backend, check_model
from tests.reliability_helpers import REPO

SHAPES = [(2, 37, 3, 4), (1, 64, 2, 16), (3, 50, 2, 32), (1, 19, 1, 128), (16, 128, 4, 16),
          (1, 1, 1, 8), (2, 24, 2, 64), (1, 17, 1, 256)]
PADDED_SHAPES = [(2, 21, 2, 6), (1, 33, 3, 18)]  # head dims the kernel pads to the next one


def numpy_attention(q, k, v):
    """float64 causal softmax attention of [B, L, H, K] arrays, and each row's log-sum-exp."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("blhk,bmhk->bhlm", q, k) / np.sqrt(q.shape[-1])
    length = q.shape[1]
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    peak = scores.max(-1, keepdims=True)
    lse = peak[..., 0] + np.log(np.exp(scores - peak).sum(-1))
    probs = np.exp(scores - lse[..., None])
    return np.einsum("bhlm,bmhk->blhk", probs, v), lse


def jnp_attention(q, k, v):
    """The same in float32 jnp, differentiated by JAX."""
    scores = jnp.einsum("blhk,bmhk->bhlm", q, k) / jnp.sqrt(q.shape[-1])
    length = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores, -jnp.inf)
    return jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(scores, axis=-1), v)


def random_inputs(shape, seed=0, n=4):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(np.float32) * 2 for _ in range(n)]


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_log_sum_exp_match_numpy(shape):
    """Lengths that are and are not multiples of the kernel's 16-query blocks, one head to 64."""
    q, k, v = random_inputs(shape, n=3)
    out, lse = jax.jit(_forward)(q, k, v)
    want_out, want_lse = numpy_attention(q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse.astype(np.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES + PADDED_SHAPES)
def test_gradients_match_jax_vjp_of_plain_attention(shape):
    q, k, v, g = random_inputs(shape, seed=1)
    _, vjp = jax.vjp(jnp_attention, q, k, v)
    _, kernel_vjp = jax.vjp(cpu_causal_attention, q, k, v)
    for got, want in zip(jax.jit(kernel_vjp)(g), vjp(g), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("shape", PADDED_SHAPES)
def test_padded_head_dims_match_numpy(shape):
    q, k, v = random_inputs(shape, seed=4, n=3)
    np.testing.assert_allclose(jax.jit(cpu_causal_attention)(q, k, v), numpy_attention(q, k, v)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 37, 3, 4), (1, 64, 2, 16), (1, 33, 3, 18)])
@pytest.mark.parametrize("sharpness", [1.0, 30.0])
def test_row_statistics_match_numpy(shape, sharpness):
    """Entropy, KL and TV from uniform of every row, from diffuse to nearly one-hot rows."""
    q, k, v = random_inputs(shape, seed=5, n=3)
    q = q * sharpness
    out, stats = jax.jit(cpu_causal_attention_with_stats)(q, k, v)
    want_out, lse = numpy_attention(q, k, v)
    scores = np.einsum("blhk,bmhk->bhlm", q.astype(np.float64), k) / np.sqrt(shape[-1])
    length = shape[1]
    visible = np.tril(np.ones((length, length), bool))
    probs = np.where(visible, np.exp(np.where(visible, scores, 0) - lse[..., None]), 0.0)
    entropy = -np.sum(np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1)), 0), -1)
    row_len = np.arange(1, length + 1)
    tv = 0.5 * np.sum(np.abs(probs - np.where(visible, 1 / row_len[:, None], 0)), -1)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)  # float32 scores up to 1e3
    np.testing.assert_allclose(stats["attn_entropy"], entropy, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(stats["attn_kl_uniform"], np.log(row_len) - entropy, atol=3e-5)
    np.testing.assert_allclose(stats["attn_tv_uniform"], tv, rtol=1e-4, atol=2e-5)


def test_the_statistics_variant_has_the_same_gradients():
    q, k, v, g = random_inputs((2, 40, 2, 16), seed=6)

    def loss(attention):
        return lambda q, k, v: jnp.vdot(attention(q, k, v), g)

    plain = jax.grad(loss(cpu_causal_attention), argnums=(0, 1, 2))(q, k, v)
    with_stats = jax.grad(loss(lambda *qkv: cpu_causal_attention_with_stats(*qkv)[0]),
                          argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(with_stats, plain, strict=True):
        np.testing.assert_array_equal(a, b)


def test_large_scores_neither_overflow_nor_lose_the_peak():
    """Scores of +-400: the softmax is one-hot and exp must not overflow or flush to NaN."""
    q, k, v = random_inputs((1, 40, 2, 16), seed=2, n=3)
    q = q * 50
    out, lse = jax.jit(_forward)(q, k, v)
    want_out, want_lse = numpy_attention(q, k, v)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)


def test_a_nan_reaches_the_rows_that_see_it():
    """A NaN in one key makes every query row that attends to it NaN, and no other row."""
    q, k, v = random_inputs((1, 40, 2, 16), seed=7, n=3)
    k[0, 20, 1, 3] = np.nan
    out, lse = jax.jit(_forward)(q, k, v)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[0, 20:, 1]).all() and np.isnan(lse[0, 1, 20:]).all()
    assert np.isfinite(out[0, :20, 1]).all() and np.isfinite(out[0, :, 0]).all()


def test_partitioned_over_batch_and_heads_on_a_mesh():
    """Sharded over data x tensor, each device runs its own rows and heads; same numbers."""
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    sharding = NamedSharding(mesh, PartitionSpec("data", None, "tensor", None))
    q, k, v, g = random_inputs((4, 40, 4, 16), seed=3)
    args = [jax.device_put(a, sharding) for a in (q, k, v)]

    def loss(q, k, v):
        return jnp.vdot(cpu_causal_attention(q, k, v), g)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    hlo = step.lower(*args).compile().as_text()
    kernel_calls = [line for line in hlo.splitlines() if "postnorm_causal_attention" in line]
    assert len(kernel_calls) == 2 and all("f32[2,40,2,16]" in c for c in kernel_calls)
    value, grads = step(*args)
    want_value, want_grads = jax.value_and_grad(
        lambda q, k, v: jnp.vdot(jnp_attention(q, k, v), g), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def _forward_kernel_calls(policy) -> int:
    """Forward-kernel calls in the compiled gradient of a scanned, checkpointed 2-layer stack."""
    def layer(x_BxLxD, w_3xDxD):
        q, k, v = ((x_BxLxD @ w).reshape(2, 32, 2, 8) for w in w_3xDxD)
        return jnp.tanh(cpu_causal_attention(q, k, v).reshape(2, 32, 16)) + x_BxLxD

    def loss(x_BxLxD, w_Nx3xDxD):
        body = jax.checkpoint(layer, policy=policy)
        return jnp.sum(jax.lax.scan(lambda x, w: (body(x, w), None), x_BxLxD, w_Nx3xDxD)[0] ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=1)).lower(
        jnp.ones((2, 32, 16)), jnp.ones((2, 3, 16, 16)) * 0.1).compile().as_text()
    return hlo.count('custom_call_target="postnorm_causal_attention_fwd"')


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_policies_keep_the_kernel_residuals(remat):
    """Saving nothing reruns the forward kernel in the backward loop; the model's policies
    keep its output and log-sum-exp instead, so it runs once."""
    assert _forward_kernel_calls(jax.checkpoint_policies.nothing_saveable) == 2
    assert _forward_kernel_calls(REMAT_POLICIES[remat]) == 1


# The CPU targets the kernel's vector width and tiles follow (W floats a vector, the register
# file): x86-64 (SSE, W = 4), haswell (AVX2, W = 8), skylake-avx512 (AVX-512, W = 16), each run
# where this CPU has its instructions.
TARGETS = {"x86-64": (), "haswell": ("avx2", "fma"), "skylake-avx512": ("avx512f", "avx512bw")}
KERNEL_TESTS = ("forward_and_log_sum_exp or gradients_match or padded_head_dims or "
                "row_statistics or statistics_variant or large_scores or a_nan_reaches or "
                "session_target")


@pytest.mark.slow
@pytest.mark.skipif(not re.search(r"x86_64|amd64", os.uname().machine, re.I),
                    reason="the targets are x86-64 ones")
@pytest.mark.parametrize("march", sorted(TARGETS))
def test_every_vector_width_passes_the_kernel_tests(march):
    """The kernel tests above with the kernel built for ``march`` instead of this CPU."""
    flags = set(build.cpu_flags().split())
    if missing := [f for f in TARGETS[march] if f not in flags]:
        pytest.skip(f"this CPU lacks {missing} for -march={march}")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         f"--kernel-march={march}", __file__, "-k", KERNEL_TESTS],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed[1]) >= 30, result.stdout[-500:]  # every kernel test ran


def test_the_kernel_is_the_session_targets(pytestconfig):
    """Under ``--kernel-march`` (the test above), the kernel the other tests ran is that build."""
    march = pytestconfig.getoption("--kernel-march")
    if march is None:
        pytest.skip("a session with --kernel-march runs this")
    jax.jit(_forward)(*random_inputs((1, 8, 1, 4), n=3))
    assert build.registered_march() == march


@pytest.mark.slow
def test_build_is_reused_and_rebuilt_when_the_source_changes(tmp_path):
    source = tmp_path / "kernel.cc"
    source.write_text(build.ATTENTION_SOURCE.read_text())
    first = build.build(source, build_dir=tmp_path / "out")
    mtime = first.stat().st_mtime_ns
    assert build.build(source, build_dir=tmp_path / "out") == first
    assert first.stat().st_mtime_ns == mtime
    source.write_text(source.read_text() + "\n// changed\n")
    second = build.build(source, build_dir=tmp_path / "out")
    assert second != first and second.exists()
    assert not list((tmp_path / "out").glob("*.partial"))
    assert second.stat().st_mode & 0o777 == 0o755  # loadable by other users of the checkout


def test_a_missing_compiler_names_the_field_and_the_fix(tmp_path):
    with pytest.raises(build.KernelBuildError, match="model.attention=blocked"):
        build.build(compiler=str(tmp_path / "no-such-c++"), build_dir=tmp_path)


def test_a_failed_compile_reports_the_compiler_output_and_leaves_no_library(tmp_path):
    source = tmp_path / "broken.cc"
    source.write_text("int broken( {\n")
    with pytest.raises(build.KernelBuildError,
                       match=r"(?s)broken\.cc.*expected.*model\.attention=blocked"):
        build.build(source, build_dir=tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so*"))


def test_a_build_directory_that_cannot_be_made_is_named(tmp_path):
    """Its parent is a file, which no user (root included) can make a directory in."""
    (tmp_path / "file").write_text("")
    with pytest.raises(build.KernelBuildError, match=str(tmp_path / "file" / "out")):
        build.build(build_dir=tmp_path / "file" / "out")


@pytest.mark.parametrize("overrides,match", [
    (dict(dtype="bfloat16"), r"computes in float32, but model.dtype='bfloat16'; change that or "
                              "set model.attention=auto or blocked"),
    (dict(d_model=600, n_heads=2), r"head dims up to 256, but .* 600/2 = 300"),
])
def test_config_errors_name_the_fields(overrides, match):
    config = get_config()
    config.model.attention = "cpu"
    config.model.update(overrides)
    with pytest.raises(ConfigError, match=match):
        check_model(config)


def test_head_dims_of_the_config_check_are_those_the_kernel_is_built_for():
    source = build.ATTENTION_SOURCE.read_text()
    built = sorted(int(n) for n in re.findall(r"case (\d+): \{ constexpr", source))
    assert built == list(HEAD_DIMS)


def test_another_backend_is_refused():
    config = get_config()
    config.model.attention = "cpu"
    with pytest.raises(ConfigError, match="is a CPU kernel, but JAX runs on 'gpu'; set "
                                          "model.attention=auto or blocked"):
        check_backend(config, platform="gpu")
