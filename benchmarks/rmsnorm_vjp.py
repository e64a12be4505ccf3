"""The model's RMSNorm differentiated by autodiff against a hand-written (fused) backward.

    taskset -c 0 python -m benchmarks.rmsnorm_vjp

For each shape [B, L, D] (default: the default config's sublayer outputs, [16, 128, 64], and
paper width, [8, 512, 512]) it times the jitted forward and backward (dL/dy, dL/dscale) of
L = <RMSNorm(y), g> two ways:

* ``autodiff``: ``postnorm.model.layers.RMSNorm``, the model's module, differentiated by JAX;
* ``fused``: the same forward with a ``jax.custom_vjp`` backward written as one expression,
  dy = r (g s - x (g s . x) / D) with r = 1/rms(y), x = y r, keeping y, r and the gain s.

It checks that both give the same gradients before timing. Repeats are interleaved; prints
JSON with the median milliseconds per call and the ratio autodiff / fused.
"""

import functools
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.timing import interleaved_median_ms
from postnorm.model.layers import RMSNorm

flags.DEFINE_list("shapes", ["16x128x64", "8x512x512"], "Shapes BxLxD to time.")
flags.DEFINE_float("eps", 1e-6, "RMSNorm epsilon.")
flags.DEFINE_integer("repeats", 9, "Interleaved repeats.", lower_bound=1)
flags.DEFINE_integer("calls", 20, "Calls per repeat (their mean is the repeat's time).",
                     lower_bound=1)
FLAGS = flags.FLAGS


def _normalize(y_BxLxD: jax.Array, scale_D: jax.Array,
               eps: float) -> tuple[jax.Array, jax.Array]:
    y32 = y_BxLxD.astype(jnp.float32)
    inv_rms_BxLx1 = jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + eps)
    return (y32 * inv_rms_BxLx1 * scale_D).astype(y_BxLxD.dtype), inv_rms_BxLx1


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fused_rms_norm(y_BxLxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with a hand-written backward; the forward of ``postnorm.model.layers.RMSNorm``."""
    return _normalize(y_BxLxD, scale_D, eps)[0]


Residuals = tuple[jax.Array, jax.Array, jax.Array]


def _fused_forward(y_BxLxD: jax.Array, scale_D: jax.Array,
                   eps: float) -> tuple[jax.Array, Residuals]:
    z_BxLxD, inv_rms_BxLx1 = _normalize(y_BxLxD, scale_D, eps)
    return z_BxLxD, (y_BxLxD, inv_rms_BxLx1, scale_D)


def _fused_backward(eps: float, residuals: Residuals,
                    g_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    del eps
    y_BxLxD, inv_rms_BxLx1, scale_D = residuals
    x_BxLxD = y_BxLxD.astype(jnp.float32) * inv_rms_BxLx1
    g32 = g_BxLxD.astype(jnp.float32)
    d_scale_D = jnp.sum(g32 * x_BxLxD, axis=tuple(range(g32.ndim - 1)))
    gs_BxLxD = g32 * scale_D
    dy_BxLxD = inv_rms_BxLx1 * (
        gs_BxLxD - x_BxLxD * jnp.mean(gs_BxLxD * x_BxLxD, axis=-1, keepdims=True))
    return dy_BxLxD.astype(y_BxLxD.dtype), d_scale_D


fused_rms_norm.defvjp(_fused_forward, _fused_backward)


def gradient_fns(eps: float) -> dict[str, Callable]:
    """Each formulation's jitted (dL/dy, dL/dscale) of L = <RMSNorm(y), g>."""
    module = RMSNorm(eps=eps)

    def autodiff(y, scale, g):
        return jnp.vdot(module.apply({"params": {"scale": scale}}, y), g)

    def fused(y, scale, g):
        return jnp.vdot(fused_rms_norm(y, scale, eps), g)

    return {name: jax.jit(jax.grad(fn, argnums=(0, 1)))
            for name, fn in (("autodiff", autodiff), ("fused", fused))}


def parse_shape(text: str) -> tuple[int, int, int]:
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise app.UsageError(f"--shapes: {text!r} is not BxLxD with positive integers")
    return tuple(map(int, parts))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    shapes = [parse_shape(s) for s in FLAGS.shapes]
    rng = np.random.default_rng(0)
    fns = gradient_fns(FLAGS.eps)
    results = {}
    for b, n, d in shapes:
        y = jnp.asarray(rng.normal(size=(b, n, d)) * 3.0, jnp.float32)
        g = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
        scale = jnp.asarray(1.0 + 0.1 * rng.normal(size=(d,)), jnp.float32)
        outs = {name: jax.block_until_ready(fn(y, scale, g)) for name, fn in fns.items()}
        for auto, fused in zip(outs["autodiff"], outs["fused"], strict=True):
            np.testing.assert_allclose(auto, fused, rtol=1e-4, atol=1e-5)
        median_ms = interleaved_median_ms(fns, (y, scale, g), FLAGS.repeats, FLAGS.calls)
        ratio = median_ms["autodiff"] / median_ms["fused"]
        results[f"{b}x{n}x{d}"] = {"median_ms": median_ms, "autodiff_over_fused": ratio}
    print(json.dumps({"backend": jax.default_backend(), "repeats": FLAGS.repeats,
                      "calls": FLAGS.calls, "results": results}, indent=2))


if __name__ == "__main__":
    app.run(main)
