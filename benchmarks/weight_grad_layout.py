"""The gradient of a matmul with [B, L, D] activations, token axes kept against flattened.

    taskset -c 0 python -m benchmarks.weight_grad_layout

For x [B, L, D] and each W [D, F], times the jitted gradient (dL/dx, dL/dW) of
L = sum(tanh(x W) * g) written two ways: ``x @ W`` (autodiff contracts the two token axes B and
L for dL/dW) and ``postnorm.model.layers.token_matmul`` (x flattened to [B*L, D] first). Both
give the same numbers (the script checks). Repeats are interleaved; prints JSON with the median
milliseconds per call and the ratio kept / flattened.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.timing import interleaved_median_ms
from postnorm.model.layers import token_matmul

flags.DEFINE_integer("batch", 16, "B.", lower_bound=1)
flags.DEFINE_integer("length", 128, "L.", lower_bound=1)
flags.DEFINE_integer("d_model", 64, "D.", lower_bound=1)
flags.DEFINE_list("widths", ["64", "192", "384", "8192"], "F of each W [D, F] to time.")
flags.DEFINE_integer("repeats", 9, "Interleaved repeats.", lower_bound=1)
flags.DEFINE_integer("calls", 5, "Calls per repeat (their mean is the repeat's time).",
                     lower_bound=1)
FLAGS = flags.FLAGS


def gradient_fns(g_BxLxF: jax.Array) -> dict:
    """The two formulations' jitted (dL/dx, dL/dW)."""

    def loss(matmul):
        return lambda x, w: jnp.vdot(jnp.tanh(matmul(x, w)), g_BxLxF)

    return {"token_axes_kept": jax.jit(jax.grad(loss(jnp.matmul), argnums=(0, 1))),
            "flattened": jax.jit(jax.grad(loss(token_matmul), argnums=(0, 1)))}


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not all(w.isdigit() and int(w) >= 1 for w in FLAGS.widths):
        raise app.UsageError(f"--widths={FLAGS.widths}: each must be an integer >= 1")
    rng = np.random.default_rng(0)
    b, n, d = FLAGS.batch, FLAGS.length, FLAGS.d_model
    x = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
    results = {}
    for width in map(int, FLAGS.widths):
        w = jnp.asarray(rng.normal(size=(d, width)) / np.sqrt(d), jnp.float32)
        fns = gradient_fns(jnp.asarray(rng.normal(size=(b, n, width)), jnp.float32))
        outs = {name: jax.block_until_ready(fn(x, w)) for name, fn in fns.items()}
        for kept, flat in zip(outs["token_axes_kept"], outs["flattened"], strict=True):
            np.testing.assert_allclose(kept, flat, rtol=1e-4, atol=1e-4)
        median_ms = interleaved_median_ms(fns, (x, w), FLAGS.repeats, FLAGS.calls)
        results[f"W_{d}x{width}"] = {
            "median_ms": median_ms,
            "kept_over_flattened": median_ms["token_axes_kept"] / median_ms["flattened"]}
    print(json.dumps({"x_shape": [b, n, d], "backend": jax.default_backend(),
                      "repeats": FLAGS.repeats, "results": results}, indent=2))


if __name__ == "__main__":
    app.run(main)
