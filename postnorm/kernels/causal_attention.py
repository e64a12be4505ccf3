"""Causal softmax attention by the C++ CPU kernel (``causal_attention_cpu.cc``), with its own
backward.

The forward returns the output and each query row's log-sum-exp; the backward rebuilds the
probabilities from them, so no [L, L] array is kept between the two. Both are checkpoint-named
(``KERNEL_RESIDUALS``): a remat policy that saves them (every policy of
``postnorm.model.REMAT_POLICIES``; ``none`` keeps everything anyway) keeps the backward pass
from running the forward kernel a second time.

Heads are independent, so both calls are partitioned over the batch and head axes
(``custom_partitioning``): on a mesh, each device runs the kernel on its own batch rows and
heads, and the sequence and head-dimension axes are gathered whole.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from postnorm.kernels.build import register_attention_kernels

HEAD_DIMS = (4, 8, 16, 32, 64, 128, 256)  # the head dims the kernel is instantiated for
KERNEL_RESIDUALS = ("attention_kernel_out", "attention_kernel_lse")
HEADS_LAYOUT = "b l h k"  # q, k, v, out and their gradients: [B, L, H, K]
LSE_LAYOUT = "b h l"  # the log-sum-exp: [B, H, L]


def _ffi_forward(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK):
    register_attention_kernels()
    batch, length, heads, _ = q_BxLxHxK.shape
    out_types = (jax.ShapeDtypeStruct(q_BxLxHxK.shape, jnp.float32),
                 jax.ShapeDtypeStruct((batch, heads, length), jnp.float32))
    return jax.ffi.ffi_call("postnorm_causal_attention_fwd", out_types)(q_BxLxHxK, k_BxLxHxK,
                                                                        v_BxLxHxK)


def _ffi_forward_stats(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK):
    register_attention_kernels()
    batch, length, heads, _ = q_BxLxHxK.shape
    row_type = jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)
    out_types = (jax.ShapeDtypeStruct(q_BxLxHxK.shape, jnp.float32),) + (row_type,) * 3
    return jax.ffi.ffi_call("postnorm_causal_attention_fwd_stats", out_types)(
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)


def _ffi_backward(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, out_BxLxHxK, lse_BxHxL, d_out_BxLxHxK):
    register_attention_kernels()
    grad_type = jax.ShapeDtypeStruct(q_BxLxHxK.shape, jnp.float32)
    return jax.ffi.ffi_call("postnorm_causal_attention_bwd", (grad_type,) * 3)(
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, out_BxLxHxK, lse_BxHxL, d_out_BxLxHxK)


def _spec(layout: str, batch_axes, head_axes) -> PartitionSpec:
    """A layout's PartitionSpec with only its batch and head axes split."""
    axes = {"b": batch_axes, "h": head_axes}
    return PartitionSpec(*(axes.get(name) for name in layout.split()))


def _batch_and_head_partitioned(fn: Callable, in_layouts: tuple[str, ...],
                                out_layouts: tuple[str, ...]) -> Callable:
    """``fn`` partitioned over the ``b`` and ``h`` axes of its arrays, as the first
    argument (a ``HEADS_LAYOUT`` array) is split; ``l`` and ``k`` stay whole."""
    wrapped = custom_partitioning(fn)

    def shardings(mesh, arg_shapes, layouts):
        spec = tuple(arg_shapes[0].sharding.spec) + (None,) * 4
        batch_axes, head_axes = spec[0], spec[2]
        return tuple(NamedSharding(mesh, _spec(layout, batch_axes, head_axes))
                     for layout in layouts)

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes, out_layouts)

    def partition(mesh, arg_shapes, result_shape):
        return (mesh, fn, shardings(mesh, arg_shapes, out_layouts),
                shardings(mesh, arg_shapes, in_layouts))

    rule = f"{', '.join(in_layouts)} -> {', '.join(out_layouts)}"
    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer,
                          sharding_rule=rule, need_replication_factors=("l", "k"))
    return wrapped


_forward = _batch_and_head_partitioned(_ffi_forward, (HEADS_LAYOUT,) * 3,
                                       (HEADS_LAYOUT, LSE_LAYOUT))
_forward_stats = _batch_and_head_partitioned(_ffi_forward_stats, (HEADS_LAYOUT,) * 3,
                                             (HEADS_LAYOUT,) + (LSE_LAYOUT,) * 3)
_backward = _batch_and_head_partitioned(
    _ffi_backward, (HEADS_LAYOUT,) * 4 + (LSE_LAYOUT, HEADS_LAYOUT), (HEADS_LAYOUT,) * 3)


def _padded_to_a_built_head_dim(attention: Callable, q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array,
                                v_BxLxHxK: jax.Array):
    """``attention(q, k, v)`` (output first), with a head dimension the kernel is not built
    for (``HEAD_DIMS``; at most the largest) zero-padded to the next one and q rescaled so
    the scores keep their 1/sqrt(K); padding changes no score, so nothing else changes."""
    head_dim = q_BxLxHxK.shape[-1]
    if head_dim > HEAD_DIMS[-1]:
        raise ValueError(f"the CPU attention kernel takes head dims up to {HEAD_DIMS[-1]}, "
                         f"not {head_dim}")
    padded = next(d for d in HEAD_DIMS if d >= head_dim)
    if padded == head_dim:
        return attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)
    widths = ((0, 0),) * 3 + ((0, padded - head_dim),)
    q_BxLxHxP = jnp.pad(q_BxLxHxK * jnp.sqrt(padded / head_dim), widths)
    out_BxLxHxP, *rest = attention(q_BxLxHxP, jnp.pad(k_BxLxHxK, widths),
                                   jnp.pad(v_BxLxHxK, widths))
    return out_BxLxHxP[..., :head_dim], *rest


def cpu_causal_attention(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array
                         ) -> jax.Array:
    """softmax(q k^T / sqrt(K), causal) v per head, float32 [B, L, H, K] in and out."""
    return _padded_to_a_built_head_dim(lambda *qkv: (_attention(*qkv),), q_BxLxHxK, k_BxLxHxK,
                                       v_BxLxHxK)[0]


def cpu_causal_attention_with_stats(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array,
                                    v_BxLxHxK: jax.Array
                                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The output, and the per-row statistics of ``postnorm.diagnostics.stats.attention_row_stats``
    ([B, H, L] each), computed by the kernel from its probabilities. The statistics carry no
    gradient."""
    out_BxLxHxK, entropy_BxHxL, tv_BxHxL = _padded_to_a_built_head_dim(
        _attention_with_stats, q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)
    entropy_BxHxL, tv_BxHxL = jax.lax.stop_gradient((entropy_BxHxL, tv_BxHxL))
    row_len_L = jnp.arange(1, q_BxLxHxK.shape[1] + 1, dtype=jnp.float32)
    return out_BxLxHxK, {"attn_entropy": entropy_BxHxL,
                         "attn_kl_uniform": jnp.log(row_len_L) - entropy_BxHxL,
                         "attn_tv_uniform": tv_BxHxL}


def _named_residuals(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, out_BxLxHxK, lse_BxHxL):
    out_BxLxHxK = checkpoint_name(out_BxLxHxK, KERNEL_RESIDUALS[0])
    lse_BxHxL = checkpoint_name(lse_BxHxL, KERNEL_RESIDUALS[1])
    return out_BxLxHxK, (q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, out_BxLxHxK, lse_BxHxL)


@jax.custom_vjp
def _attention(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array) -> jax.Array:
    return _forward(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)[0]


def _attention_vjp_forward(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK):
    return _named_residuals(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK,
                            *_forward(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK))


def _attention_vjp_backward(residuals, d_out_BxLxHxK):
    return tuple(_backward(*residuals, d_out_BxLxHxK))


_attention.defvjp(_attention_vjp_forward, _attention_vjp_backward)


@jax.custom_vjp
def _attention_with_stats(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    out_BxLxHxK, _, entropy_BxHxL, tv_BxHxL = _forward_stats(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)
    return out_BxLxHxK, entropy_BxHxL, tv_BxHxL


def _attention_with_stats_vjp_forward(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK):
    out_BxLxHxK, lse_BxHxL, entropy_BxHxL, tv_BxHxL = _forward_stats(q_BxLxHxK, k_BxLxHxK,
                                                                     v_BxLxHxK)
    out_BxLxHxK, residuals = _named_residuals(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, out_BxLxHxK,
                                              lse_BxHxL)
    return (out_BxLxHxK, entropy_BxHxL, tv_BxHxL), residuals


def _attention_with_stats_vjp_backward(residuals, cotangents):
    # the statistics leave through stop_gradient, so their cotangents are zero
    return tuple(_backward(*residuals, cotangents[0]))


_attention_with_stats.defvjp(_attention_with_stats_vjp_forward,
                             _attention_with_stats_vjp_backward)
