"""The attention core alone (scores, causal softmax, P·V): forward, and forward with backward.

    taskset -c 0 python -m benchmarks.attention_core
    python -m benchmarks.attention_core --shape 8x512x4x128 --kernels blocked:128,einsum --notorch

For q, k, v [B, L, H, K] (default: the default config's, 16 x 128 x 4 x 16) it times, jitted,
the output and the gradient (dL/dq, dL/dk, dL/dv) of L = <attention(q, k, v), g> for each
kernel of ``postnorm.model.layers``: ``blocked:N`` is ``blocked_causal_attention`` with N-row query
blocks (the model's ``model.attention=blocked``, ``model.attention_block=N``), ``einsum`` one
block of all rows, ``xla`` ``jax.nn.dot_product_attention``, ``cpu`` the C++ kernel of
``postnorm.kernels.causal_attention`` (``model.attention=cpu``; it keeps its forward's output
and log-sum-exp for the backward, so under remat the step runs it once). With ``--torch``
(the default; ``--notorch`` where PyTorch is not installed) also PyTorch's
``scaled_dot_product_attention(is_causal=True)`` on the same numbers, forward under
``no_grad`` and forward with backward.

Every kernel's output and gradients are checked against the einsum kernel's first. The model's
train step runs this core once forward and, with ``model.remat=full``, once more in the backward
pass, so its cost there is about ``forward + forward_backward`` (``forward_backward`` alone for
``cpu``). Repeats are interleaved; prints
JSON with the median milliseconds per call of each.
"""

import json
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.programs import cpu_description, use_kernel_march
from benchmarks.timing import interleaved_median_ms
from postnorm.kernels.causal_attention import cpu_causal_attention
from postnorm.model.layers import blocked_causal_attention

flags.DEFINE_string("shape", "16x128x4x16", "B x L x H x K of q, k and v.")
flags.DEFINE_list("kernels", ["cpu", "blocked:32", "blocked:64", "einsum", "xla"],
                  "JAX kernels: cpu, blocked:N, einsum, xla.")
flags.DEFINE_bool("torch", True, "Also time PyTorch's scaled_dot_product_attention "
                  "(needs benchmarks/requirements-torch.txt).")
flags.DEFINE_integer("repeats", 7, "Interleaved repeats.", lower_bound=1)
flags.DEFINE_integer("calls", 20, "Calls per repeat (their mean is the repeat's time).",
                     lower_bound=1)
FLAGS = flags.FLAGS

Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def jax_kernel(name: str) -> Attention:
    """``attention(q, k, v)`` -> [B, L, H, K] of a ``--kernels`` entry."""
    if name == "einsum":
        return lambda q, k, v: blocked_causal_attention(q, k, v, q.shape[1])[0]
    if name == "cpu":
        return cpu_causal_attention
    if name == "xla":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation="xla")
    if match := re.fullmatch(r"blocked:([1-9]\d*)", name):
        block = int(match.group(1))
        return lambda q, k, v: blocked_causal_attention(q, k, v, block)[0]
    raise app.UsageError(f"--kernels: {name!r} is not cpu, blocked:N, einsum or xla")


def jax_programs(attention: Attention, g: jax.Array) -> dict[str, Callable]:
    """The jitted forward and forward-with-backward of one kernel."""
    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.vdot(attention(q, k, v), g)

    return {"forward": jax.jit(attention),
            "forward_backward": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}


def torch_programs(args: tuple[np.ndarray, ...], g: np.ndarray) -> tuple[dict, tuple]:
    """PyTorch's SDPA on the same numbers ([B, H, L, K] tensors), and its output and
    gradients in the JAX layout for the check."""
    import torch

    q, k, v = (torch.tensor(a).permute(0, 2, 1, 3).contiguous().requires_grad_(True)
               for a in args)
    g_t = torch.tensor(g).permute(0, 2, 1, 3).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward(*_) -> object:
        with torch.no_grad():
            return sdpa(q, k, v, is_causal=True)

    def forward_backward(*_) -> object:
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True).backward(g_t)
        return q.grad

    forward_backward()
    layout = (lambda t: t.detach().permute(0, 2, 1, 3).numpy())
    results = (layout(forward()), tuple(layout(t.grad) for t in (q, k, v)))
    return {"forward": forward, "forward_backward": forward_backward}, results


def check(name: str, out: object, grads: tuple, reference: tuple) -> None:
    """A kernel's output and gradients equal the einsum kernel's (float32 rounding)."""
    for got, want in zip((out, *grads), (reference[0], *reference[1]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5,
                                   err_msg=f"{name} differs from the einsum kernel")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){3}", FLAGS.shape):
        raise app.UsageError(f"--shape={FLAGS.shape!r}: expected BxLxHxK, e.g. 16x128x4x16")
    if not FLAGS.kernels or len(set(FLAGS.kernels)) < len(FLAGS.kernels):
        raise app.UsageError(f"--kernels: one or more, each once, not {FLAGS.kernels}")
    use_kernel_march()
    shape = tuple(int(s) for s in FLAGS.shape.split("x"))
    kernels = {name: jax_kernel(name) for name in FLAGS.kernels}
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.normal(size=shape).astype(np.float32) for _ in range(4))
    args = tuple(jnp.asarray(a) for a in (q, k, v))
    jitted = {name: jax_programs(attention, jnp.asarray(g)) for name, attention in kernels.items()}
    einsum = jitted.get("einsum") or jax_programs(jax_kernel("einsum"), jnp.asarray(g))
    reference = (einsum["forward"](*args), einsum["forward_backward"](*args))
    fns = {}
    for name, programs in jitted.items():
        check(name, programs["forward"](*args), programs["forward_backward"](*args), reference)
        fns.update({f"{name}/{part}": fn for part, fn in programs.items()})
    if FLAGS.torch:
        try:
            programs, (out, grads) = torch_programs((q, k, v), g)
        except ImportError as err:
            raise app.UsageError(f"--torch needs PyTorch ({err}): pip install -r "
                                 "benchmarks/requirements-torch.txt, or pass --notorch") from err
        check("torch", out, grads, reference)
        fns.update({f"torch_sdpa/{part}": fn for part, fn in programs.items()})
    median_ms = interleaved_median_ms(fns, args, FLAGS.repeats, FLAGS.calls)
    results = {}
    for label, ms in median_ms.items():
        name, part = label.rsplit("/", 1)
        results.setdefault(name, {})[part] = ms
    print(json.dumps({"shape_BxLxHxK": shape, "cpu": cpu_description(),
                      "repeats": FLAGS.repeats, "calls": FLAGS.calls,
                      "median_ms": results}, indent=2))


if __name__ == "__main__":
    app.run(main)
