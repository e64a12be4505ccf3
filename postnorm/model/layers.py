"""Transformer sublayers: RMSNorm, rotary positions, causal attention and the SwiGLU FFN."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from postnorm.diagnostics.stats import attention_row_stats, mean_attention_stats
from postnorm.kernels.causal_attention import cpu_causal_attention, cpu_causal_attention_with_stats
from postnorm.model.initializers import kernel_init
from postnorm.model.repair import repaired

ATTENTION_KERNELS = ("einsum", "blocked", "xla", "cudnn", "cpu")


def token_matmul(x_BxLxD: jax.Array, w_DxF: jax.Array) -> jax.Array:
    """``x @ w`` with the token axes flattened to one: ``[B, L, D] @ [D, F] -> [B, L, F]``.

    The same product as ``x @ w``, but its weight gradient becomes one ``[D, B*L] @ [B*L, F]``
    matmul. Contracting two token axes instead makes XLA's CPU backend transpose the output
    gradient and fall back to a kernel 3x slower (``docs/PERFORMANCE.md``).
    """
    *lead, d = x_BxLxD.shape
    return (x_BxLxD.reshape(-1, d) @ w_DxF).reshape(*lead, w_DxF.shape[-1])


Gains = tuple[tuple[str, float], ...]  # (parameter name, init gain) pairs; 1 where absent


def dense_kernel(module: nn.Module, name: str, shape: tuple[int, int], axes: tuple[str, str],
                 init: str, gains: Gains = ()) -> jax.Array:
    """A ``[fan_in, fan_out]`` float32 kernel with logical partitioning, drawn under ``init``
    and multiplied by its gain in ``gains``."""
    return module.param(name, nn.with_logical_partitioning(kernel_init(init, dict(gains).get(
        name, 1.0)), axes), shape, jnp.float32)


class RMSNorm(nn.Module):
    """z = scale * y / sqrt(mean(y^2) + eps), statistics in float32; scale starts at 1.

    With ``repair_cap``, the backward signal reaching y is repaired (``postnorm.model.repair``)
    with that cap and ``repair_threshold``.
    """

    eps: float
    repair_cap: float | None = None
    repair_threshold: float = 1.0

    @nn.compact
    def __call__(self, y_BxLxD: jax.Array) -> jax.Array:
        d = y_BxLxD.shape[-1]
        scale_D = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                             (d,), jnp.float32)
        return rms_normalize(y_BxLxD, scale_D, self.eps, self.repair_cap, self.repair_threshold)


def rms_normalize(y_BxLxD: jax.Array, scale_D: jax.Array, eps: float, repair_cap: float | None,
                  repair_threshold: float) -> jax.Array:
    """``RMSNorm``'s output for gain ``scale_D`` (repaired where ``repair_cap`` is given)."""
    if repair_cap is not None:
        y_BxLxD = repaired(y_BxLxD, scale_D, eps, repair_cap, repair_threshold)
    y32 = y_BxLxD.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + eps)
    return (y32 * inv_rms * scale_D).astype(y_BxLxD.dtype)


ADMIN_CARRY = "admin_carry"  # Admin's profiling pass: its running ratio, carried over the layers
ADMIN_PROFILE = "admin_profile"  # Admin's profiling pass: the omega it set at each sublayer


def flat_variance(x: jax.Array) -> jax.Array:
    """The variance of all of ``x``'s entries together, in float32 (numpy's ``var`` of the
    flattened array: about the mean of every entry)."""
    return jnp.var(x.astype(jnp.float32))


class AdminNorm(nn.Module):
    """Admin's norm of a weighted residual sum (Liu et al. 2020): (N(y), y) with
    y = omega * skip + F, N an RMSNorm (``scale``) and omega [D] the learnable skip weight
    ``admin_omega``, which Admin's profiling pass sets at init (``postnorm.model.admin``; 1
    before it). During that pass, ``profiled_omega`` (a scalar) is omega at every feature and is
    recorded into ``ADMIN_PROFILE`` as ``admin_omega``. ``repair_cap``, ``repair_threshold``: as
    ``RMSNorm``'s."""

    eps: float
    repair_cap: float | None = None
    repair_threshold: float = 1.0

    @nn.compact
    def __call__(self, skip_BxLxD: jax.Array, branch_BxLxD: jax.Array,
                 profiled_omega: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        d = skip_BxLxD.shape[-1]
        scale_D = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                             (d,), jnp.float32)
        omega_D = self.param("admin_omega",
                             nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                             (d,), jnp.float32)
        if profiled_omega is not None:
            omega_D = jnp.full((d,), profiled_omega, jnp.float32)
            self.put_variable(ADMIN_PROFILE, "admin_omega", omega_D)
        y_BxLxD = omega_D.astype(skip_BxLxD.dtype) * skip_BxLxD + branch_BxLxD
        return (rms_normalize(y_BxLxD, scale_D, self.eps, self.repair_cap, self.repair_threshold),
                y_BxLxD)


BUDGET_MODES = ("none", "scale", "penalty")
BUDGET_COLLECTION = "budget"  # the sown hinge penalties (model.residual_budget=penalty)


def budget_branch_scale(skip_BxLxD: jax.Array, branch_BxLxD: jax.Array,
                        limit_sq: jax.Array) -> jax.Array:
    """Per token, the largest beta in [0, 1] with ||skip + beta F||^2 <= limit_sq: [B, L, 1].

    The larger root of ||F||^2 b^2 + 2 (skip . F) b + ||skip||^2 - limit_sq, clipped to [0, 1];
    0 where the skip alone is over the limit.
    """
    skip = skip_BxLxD.astype(jnp.float32)
    branch = branch_BxLxD.astype(jnp.float32)
    f_sq = jnp.sum(branch * branch, axis=-1, keepdims=True)
    cross = jnp.sum(skip * branch, axis=-1, keepdims=True)
    room = limit_sq - jnp.sum(skip * skip, axis=-1, keepdims=True)
    fits = f_sq + 2 * cross <= room  # beta = 1 already keeps the sum within the limit
    solve = ~fits & (room > 0)  # then the root lies in (0, 1), and f_sq > 0
    # where no root is taken its inputs are replaced by harmless ones, so that the unused branch
    # of the where puts no inf or NaN into the gradient
    f_sq = jnp.where(solve, f_sq, 1.0)
    cross = jnp.where(solve, cross, 0.0)
    room = jnp.where(solve, room, 1.0)
    disc = jnp.sqrt(cross * cross + f_sq * room)
    # the two forms of the root, each free of cancellation on its side of cross = 0
    root = jnp.where(cross >= 0, room / (cross + disc), (disc - cross) / f_sq)
    return jnp.where(fits, 1.0, jnp.where(solve, jnp.clip(root, 0.0, 1.0), 0.0))


def cap_rms(x_BxLxD: jax.Array, cap: float = 1.0) -> jax.Array:
    """Each row divided by max(1, rms(row) / cap): a row of RMS above ``cap`` is brought down to
    it, any other row is left as it is."""
    x32 = x_BxLxD.astype(jnp.float32)
    rms_BxLx1 = jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True))
    return (x32 / jnp.maximum(1.0, rms_BxLx1 / cap)).astype(x_BxLxD.dtype)


class ResidualNorm(nn.Module):
    """The norm of a residual sum, N(skip + F), with a budget on the sum's size.

    Its parameter is RMSNorm's (``scale``), so it is an RMSNorm wherever it stands. The budget
    keeps the contraction the diagnostics report, c = rms(scale) / sqrt(||y||^2 / d + eps), at
    or above ``budget_c``, i.e. ||y||^2 / d + eps <= rms(scale)^2 / budget_c^2: ``scale``
    multiplies F per token by the largest beta in [0, 1] that meets it (in the graph,
    differentiated through), ``penalty`` sows the hinge
    mean(max(0, (||y||^2 / d + eps) / rms(scale)^2 - 1 / budget_c^2)) into ``BUDGET_COLLECTION``
    for the objective. Returns the norm's output, y, and ``scale``'s branch scale beta [B, L, 1]
    (None under any other budget). ``repair_cap`` and ``repair_threshold``: as ``RMSNorm``'s, on
    the normalisation's input only (not the hinge's, nor the y returned).
    """

    eps: float
    budget: str = "none"
    budget_c: float = 0.9
    repair_cap: float | None = None
    repair_threshold: float = 1.0

    @nn.compact
    def __call__(self, skip_BxLxD: jax.Array, branch_BxLxD: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        d = skip_BxLxD.shape[-1]
        scale_D = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                             (d,), jnp.float32)
        gain_sq = jnp.mean(scale_D * scale_D)
        beta_BxLx1 = None
        if self.budget == "scale":
            beta_BxLx1 = budget_branch_scale(skip_BxLxD, branch_BxLxD,
                                             d * (gain_sq / self.budget_c**2 - self.eps))
            branch_BxLxD = branch_BxLxD * beta_BxLx1.astype(branch_BxLxD.dtype)
        y_BxLxD = skip_BxLxD + branch_BxLxD
        y32 = y_BxLxD.astype(jnp.float32)
        mean_sq = jnp.mean(y32 * y32, axis=-1, keepdims=True)
        if self.budget == "penalty":
            excess = (mean_sq + self.eps) / gain_sq - 1.0 / self.budget_c**2
            self.sow(BUDGET_COLLECTION, "hinge", jnp.mean(jnp.maximum(excess, 0.0)))
        if self.repair_cap is not None:  # on the normalisation's path only
            y32 = repaired(y32, scale_D, self.eps, self.repair_cap, self.repair_threshold)
            mean_sq = jnp.mean(y32 * y32, axis=-1, keepdims=True)
        out = (y32 * jax.lax.rsqrt(mean_sq + self.eps) * scale_D).astype(y_BxLxD.dtype)
        return out, y_BxLxD, beta_BxLx1


def rotary_embedding(x_BxLxHxK: jax.Array, base: float) -> jax.Array:
    """Rotate pairs (i, i + K/2) of each head vector by position-dependent angles (RoPE)."""
    length, head_dim = x_BxLxHxK.shape[1], x_BxLxHxK.shape[3]
    half = head_dim // 2
    inv_freq_K2 = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_LxK2 = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq_K2[None, :]
    sin = jnp.sin(angle_LxK2)[None, :, None, :]
    cos = jnp.cos(angle_LxK2)[None, :, None, :]
    x1, x2 = x_BxLxHxK[..., :half].astype(jnp.float32), x_BxLxHxK[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxLxHxK.dtype)


def causal_attention_weights(q_BxLxHxK: jax.Array, k_BxMxHxK: jax.Array,
                             query_offset: int = 0) -> jax.Array:
    """Softmax(q k^T / sqrt(K)) with a causal mask, in float32: [B, H, L, M].

    Query row l sits at position ``query_offset + l``, key column m at position m.
    """
    head_dim = q_BxLxHxK.shape[-1]
    logits_BxHxLxM = jnp.matmul(q_BxLxHxK.transpose(0, 2, 1, 3), k_BxMxHxK.transpose(0, 2, 3, 1),
                                preferred_element_type=jnp.float32) / jnp.sqrt(head_dim)
    queries, keys = q_BxLxHxK.shape[1], k_BxMxHxK.shape[1]
    causal_LxM = jnp.tril(jnp.ones((queries, keys), dtype=bool), k=query_offset)
    logits_BxHxLxM = jnp.where(causal_LxM, logits_BxHxLxM, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits_BxHxLxM, axis=-1)


def attend(probs_BxHxLxM: jax.Array, v_BxMxHxK: jax.Array) -> jax.Array:
    """Attention output ``probs @ v`` per head: [B, L, H, K]."""
    out_BxHxLxK = jnp.matmul(probs_BxHxLxM.astype(v_BxMxHxK.dtype), v_BxMxHxK.transpose(0, 2, 1, 3))
    return out_BxHxLxK.transpose(0, 2, 1, 3)


def blocked_causal_attention(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array,
                             block: int, collect_stats: bool = False
                             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Causal attention by blocks of ``block`` query rows; block i reads keys [0, end_i) only.

    With ``block`` >= L this is the einsum kernel: one [B, H, L, L] probability matrix.
    Returns the output [B, L, H, K] and, with ``collect_stats``, the attention-row statistics
    (``attention_row_stats``, [B, H, L] each; otherwise an empty dict).
    """
    length = q_BxLxHxK.shape[1]
    outs, row_stats = [], []
    for start in range(0, length, block):
        end = min(start + block, length)
        probs_BxHxLxM = causal_attention_weights(q_BxLxHxK[:, start:end], k_BxLxHxK[:, :end],
                                                 query_offset=start)
        outs.append(attend(probs_BxHxLxM, v_BxLxHxK[:, :end]))
        if collect_stats:
            row_stats.append(attention_row_stats(probs_BxHxLxM, query_offset=start))
    out_BxLxHxK = jnp.concatenate(outs, axis=1)
    if not collect_stats:
        return out_BxLxHxK, {}
    return out_BxLxHxK, jax.tree.map(lambda *rows: jnp.concatenate(rows, axis=-1), *row_stats)


class CausalSelfAttention(nn.Module):
    """Multi-head causal softmax attention with separate W_Q, W_K, W_V, W_O and no biases.

    With ``qk_norm``, q and k pass an RMSNorm over each head's vector (a [head_dim] gain shared
    by the heads, ``q_norm`` and ``k_norm``) before the rotary embedding.
    """

    n_heads: int
    init_scheme: str
    positions: str
    rope_base: float
    dtype: jnp.dtype
    kernel: str = "einsum"
    block: int = 128
    collect_stats: bool = False
    gains: Gains = ()
    qk_norm: bool = False
    norm_eps: float = 1e-6

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array | tuple[jax.Array, dict]:
        """The attention output; with ``collect_stats`` also the attention-row statistics."""
        batch, length, d = x_BxLxD.shape
        head_dim = d // self.n_heads
        x = x_BxLxD.astype(self.dtype)

        def project(name: str) -> jax.Array:
            w_DxD = dense_kernel(self, name, (d, d), ("embed", "heads"), self.init_scheme,
                                 self.gains)
            return token_matmul(x, w_DxD.astype(self.dtype)).reshape(batch, length, self.n_heads,
                                                                      head_dim)

        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = project("w_q"), project("w_k"), project("w_v")
        if self.qk_norm:
            q_BxLxHxK = RMSNorm(self.norm_eps, name="q_norm")(q_BxLxHxK)
            k_BxLxHxK = RMSNorm(self.norm_eps, name="k_norm")(k_BxLxHxK)
        if self.positions == "rope":
            q_BxLxHxK = rotary_embedding(q_BxLxHxK, self.rope_base)
            k_BxLxHxK = rotary_embedding(k_BxLxHxK, self.rope_base)
        row_stats = {}
        with jax.named_scope("attn_core"):  # scores, softmax and P·V; named for profiles
            if self.kernel == "cpu" and self.collect_stats:
                out_BxLxHxK, row_stats = cpu_causal_attention_with_stats(q_BxLxHxK, k_BxLxHxK,
                                                                         v_BxLxHxK)
            elif self.kernel == "cpu":
                out_BxLxHxK = cpu_causal_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)
            elif self.kernel in ("einsum", "blocked") or self.collect_stats:
                # einsum (and the fallback of xla / cudnn for statistics) is one block of all rows
                block = self.block if self.kernel == "blocked" else length
                out_BxLxHxK, row_stats = blocked_causal_attention(
                    q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, block, self.collect_stats)
            else:
                out_BxLxHxK = jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK,
                                                           is_causal=True,
                                                           implementation=self.kernel)
        w_o_DxD = dense_kernel(self, "w_o", (d, d), ("heads", "embed"), self.init_scheme,
                               self.gains)
        out_BxLxD = token_matmul(out_BxLxHxK.reshape(batch, length, d), w_o_DxD.astype(self.dtype))
        if self.collect_stats:
            return out_BxLxD, mean_attention_stats(row_stats)
        return out_BxLxD


class SwiGLU(nn.Module):
    """FFN(x) = (SiLU(x W_gate) * (x W_up)) W_down; W_gate, W_up: d x d_ff, W_down: d_ff x d.

    W_gate and W_up stay separate parameters but are applied as one [d, 2 d_ff] matmul.
    """

    d_ff: int
    init_scheme: str
    dtype: jnp.dtype
    gains: Gains = ()

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        d = x_BxLxD.shape[-1]
        x = x_BxLxD.astype(self.dtype)
        w_gate, w_up, w_down = (
            dense_kernel(self, name, shape, axes, self.init_scheme, self.gains)
            for name, shape, axes in (("w_gate", (d, self.d_ff), ("embed", "mlp")),
                                      ("w_up", (d, self.d_ff), ("embed", "mlp")),
                                      ("w_down", (self.d_ff, d), ("mlp", "embed"))))
        w_gate_up = jnp.concatenate([w_gate, w_up], axis=1).astype(self.dtype)
        gate_BxLxF, up_BxLxF = jnp.split(token_matmul(x, w_gate_up), 2, axis=-1)
        hidden_BxLxF = nn.silu(gate_BxLxF) * up_BxLxF
        return token_matmul(hidden_BxLxF, w_down.astype(self.dtype))
