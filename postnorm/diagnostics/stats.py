"""Forward statistics of the residual stream, computed inside the diagnostic step.

All statistics are reduced in float32 and detached from the gradient. Definitions
(docs/MATH.md §0, §4):

* tsim(X) = ||sum_i x_i||^2 / (n sum_i ||x_i||^2) per sequence, averaged over the batch.
* RMSNorm contraction c = alpha / r(y) with r(y) = sqrt(||y||^2/d + eps), per token, where y is
  the norm's input; ``alpha`` is either the RMS of the gain vector or max|gain| (the bound).
* Effective rank (Roy & Vetterli): exp(entropy of the normalised singular values).

Their ops, those of the backward taps (``postnorm.diagnostics.taps``) and the diagnostic step's
per-layer norms run under the name scope ``STATS_SCOPE``, so a profile (``benchmarks.profile_step
--program diag``) can tell them apart.
"""

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import jax
import jax.numpy as jnp

ERANK_SEQUENCES = 4  # sequences per batch whose effective rank is averaged
STATS_SCOPE = "diag_stats"
# The per-layer parameter groups whose norms the diagnostic step reports: {group: the prefix
# of its modules' names} (every norm of a layer: norm_attn, norm_ffn and an arrangement's others).
PARAM_GROUPS = {"attn": "attn", "ffn": "ffn", "norm": "norm_"}
P = ParamSpec("P")
R = TypeVar("R")


def in_stats_scope(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with its ops under the name scope ``STATS_SCOPE``."""

    @functools.wraps(fn)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
        with jax.named_scope(STATS_SCOPE):
            return fn(*args, **kwargs)

    return scoped


def _f32(x: jax.Array) -> jax.Array:
    return jax.lax.stop_gradient(x).astype(jnp.float32)


@in_stats_scope
def tsim(x_BxLxD: jax.Array) -> jax.Array:
    """Token similarity per sequence, averaged over the batch."""
    x = _f32(x_BxLxD)
    length = x.shape[1]
    mean_energy_B = jnp.sum(jnp.sum(x, axis=1) ** 2, axis=-1)
    total_energy_B = jnp.sum(x * x, axis=(1, 2))
    return jnp.mean(mean_energy_B / (length * total_energy_B))


def frobenius_sq(x_BxLxD: jax.Array) -> jax.Array:
    x = _f32(x_BxLxD)
    return jnp.sum(x * x)


def norm_input_stats(y_BxLxD: jax.Array, scale_D: jax.Array, eps: float) -> dict[str, jax.Array]:
    """RMS of the norm input y and the RMSNorm contraction factor c, per token."""
    y = _f32(y_BxLxD)
    d = y.shape[-1]
    rms_BxL = jnp.sqrt(jnp.sum(y * y, axis=-1) / d)
    r_BxL = jnp.sqrt(rms_BxL**2 + eps)
    scale = _f32(scale_D)
    c_rms_BxL = jnp.sqrt(jnp.mean(scale * scale)) / r_BxL
    c_max_BxL = jnp.max(jnp.abs(scale)) / r_BxL
    return {
        "y_rms_mean": jnp.mean(rms_BxL), "y_rms_max": jnp.max(rms_BxL),
        "c_mean": jnp.mean(c_rms_BxL), "c_min": jnp.min(c_rms_BxL),
        "c_bound_mean": jnp.mean(c_max_BxL), "c_bound_min": jnp.min(c_max_BxL),
    }


@in_stats_scope
def attention_row_stats(probs_BxHxLxM: jax.Array, query_offset: int = 0) -> dict[str, jax.Array]:
    """Per query row: entropy of causal attention and its distance from prefix averaging.

    Row l is query position i = query_offset + l + 1 (1-based), which attends to keys j <= i;
    the key axis may stop at any M >= query_offset + L (the blocked kernel's blocks do).
    KL(A_i || U_i) = log i - H(A_i); TV(A_i, U_i) = 1/2 sum_j |A_ij - 1/i|. Each is [B, H, L].
    """
    p = _f32(probs_BxHxLxM)
    rows, keys = p.shape[-2:]
    row_len_L = jnp.arange(query_offset + 1, query_offset + rows + 1, dtype=jnp.float32)
    entropy_BxHxL = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1)
    causal_LxM = jnp.arange(keys)[None, :] < row_len_L[:, None]
    uniform_LxM = jnp.where(causal_LxM, 1.0 / row_len_L[:, None], 0.0)
    return {
        "attn_entropy": entropy_BxHxL,
        "attn_kl_uniform": jnp.log(row_len_L) - entropy_BxHxL,
        "attn_tv_uniform": 0.5 * jnp.sum(jnp.abs(p - uniform_LxM), axis=-1),
    }


@in_stats_scope
def mean_attention_stats(row_stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The means over batch, heads and rows of ``attention_row_stats``."""
    return {key: jnp.mean(value) for key, value in row_stats.items()}


def effective_rank(x_LxD: jax.Array) -> jax.Array:
    """exp(H(sigma / sum sigma)) of one sequence's hidden states."""
    sigma = jnp.linalg.svd(_f32(x_LxD), compute_uv=False)
    p = sigma / jnp.sum(sigma)
    return jnp.exp(-jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)))


def mean_effective_rank(x_BxLxD: jax.Array) -> jax.Array:
    """Effective rank averaged over the first ``ERANK_SEQUENCES`` sequences of the batch.

    One SVD per sequence: a batched SVD on CPU waits on sub-tasks in XLA's thread pool, and
    with the batch sharded over fsdp every device's SVD did so at once, which deadlocked a
    pool of two threads (tests/train/test_loop.py, the sharded diagnostic step)."""
    count = min(ERANK_SEQUENCES, x_BxLxD.shape[0])
    return jnp.mean(jnp.stack([effective_rank(x_BxLxD[i]) for i in range(count)]))


@in_stats_scope
def sublayer_stats(x_BxLxD: jax.Array, branch_BxLxD: jax.Array, y_BxLxD: jax.Array,
                   scale_D: jax.Array, eps: float) -> dict[str, jax.Array]:
    """Statistics of one sublayer: input X, branch output F and norm input y."""
    return {
        "tsim": tsim(x_BxLxD),
        "tsim_branch": tsim(branch_BxLxD),
        "energy_ratio": frobenius_sq(branch_BxLxD) / frobenius_sq(x_BxLxD),
        "erank": mean_effective_rank(x_BxLxD),
        **norm_input_stats(y_BxLxD, scale_D, eps),
    }


@in_stats_scope
def branch_scale_stats(beta_BxLx1: jax.Array) -> dict[str, jax.Array]:
    """The residual budget's per-token branch scale beta (``model.residual_budget=scale``): the
    fraction of tokens whose branch it scales down (beta < 1) and whose branch it switches off
    (beta = 0, where the skip alone is over the budget)."""
    beta = _f32(beta_BxLx1)
    return {"budget_scaled": jnp.mean((beta < 1).astype(jnp.float32)),
            "budget_off": jnp.mean((beta == 0).astype(jnp.float32))}


def layer_norms(layer_params: dict) -> dict[str, jax.Array]:
    """||.|| per layer of the attention, FFN and norm-gain parameters: {group: [n_layers]}."""

    def group_norm(prefix: str) -> jax.Array:
        leaves = jax.tree.leaves([v for k, v in layer_params.items() if k.startswith(prefix)])
        squares = [jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
                   for x in leaves]
        return jnp.sqrt(sum(squares))

    return {group: group_norm(prefix) for group, prefix in PARAM_GROUPS.items()}
