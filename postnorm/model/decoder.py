"""Decoder-only Transformer: embedding, ``nn.scan`` over ``Block``s, final norm if any, LM head."""

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from postnorm.diagnostics.stats import branch_scale_stats, sublayer_stats, tsim
from postnorm.diagnostics.taps import tap
from postnorm.kernels.causal_attention import KERNEL_RESIDUALS
from postnorm.model.initializers import embedding_init
from postnorm.model.layers import (
    ADMIN_CARRY,
    ADMIN_PROFILE,
    BUDGET_COLLECTION,
    AdminNorm,
    CausalSelfAttention,
    ResidualNorm,
    RMSNorm,
    SwiGLU,
    cap_rms,
    dense_kernel,
    flat_variance,
    token_matmul,
)
from postnorm.model.placements import PLACEMENTS, SublayerIn, init_gains
from postnorm.model.spec import DTYPES, ModelSpec

SUBLAYERS = ("attn", "ffn")
_SAVE_KERNEL_RESIDUALS = jax.checkpoint_policies.save_only_these_names(*KERNEL_RESIDUALS)
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots, _SAVE_KERNEL_RESIDUALS),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _SAVE_KERNEL_RESIDUALS),
    "full": _SAVE_KERNEL_RESIDUALS,
}


class SublayerNorms:
    """The ``placements.Norms`` of one sublayer inside ``Block``: each norm is created on first
    use, named ``norm_<kind><suffix>``; without a residual budget, the residual sum's norm is a
    plain RMSNorm of skip + F. Gradient repair (``spec.grad_repair``) acts at the residual
    sums' norms only: they alone contract the skip path. ``branch_scales``: {suffix: the branch
    scale beta [B, L, 1] its residual norm applied} (``model.residual_budget=scale`` only).
    ``admin_ratio``: the running ratio of Admin's profiling pass (a variable of ``Block``), only
    during that pass."""

    def __init__(self, kind: str, spec: ModelSpec, admin_ratio: nn.Variable | None = None):
        self.kind, self.eps = kind, spec.norm_eps
        self.admin_ratio = admin_ratio
        self.budget, self.budget_c = spec.residual_budget, spec.residual_budget_c
        rule = spec.grad_repair
        self.repair = ({} if rule is None else
                       {"repair_cap": rule.sublayer_cap(spec.n_layers),
                        "repair_threshold": rule.threshold})
        self.created: dict[str, nn.Module] = {}
        self.branch_scales: dict[str, jax.Array] = {}

    def __call__(self, suffix: str) -> RMSNorm:
        if suffix not in self.created:
            self.created[suffix] = RMSNorm(self.eps, name=f"norm_{self.kind}{suffix}")
        return self.created[suffix]

    def residual(self, suffix: str) -> Callable[[jax.Array, jax.Array],
                                                tuple[jax.Array, jax.Array]]:
        name = f"norm_{self.kind}{suffix}"
        if self.budget == "none":
            if suffix not in self.created:
                self.created[suffix] = RMSNorm(self.eps, **self.repair, name=name)

            def plain(skip_BxLxD: jax.Array, branch_BxLxD: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
                y_BxLxD = skip_BxLxD + branch_BxLxD
                return self.created[suffix](y_BxLxD), y_BxLxD
            return plain
        if suffix not in self.created:
            self.created[suffix] = ResidualNorm(self.eps, self.budget, self.budget_c,
                                                **self.repair, name=name)

        def budgeted(skip_BxLxD: jax.Array, branch_BxLxD: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
            out_BxLxD, y_BxLxD, beta_BxLx1 = self.created[suffix](skip_BxLxD, branch_BxLxD)
            if beta_BxLx1 is not None:
                self.branch_scales[suffix] = beta_BxLx1
            return out_BxLxD, y_BxLxD
        return budgeted

    def admin(self, suffix: str) -> Callable[[jax.Array, jax.Array],
                                             tuple[jax.Array, jax.Array]]:
        """Admin's norm of omega * skip + F (``layers.AdminNorm``). During the profiling pass,
        omega is the running ratio (1 at the first sublayer), which then becomes
        sqrt(Var[omega * skip] + Var[F]) (each over all entries) for the next sublayer: the
        released code's rule (Transformer-Clinic, ``transformer_layer.py``)."""
        if suffix not in self.created:
            self.created[suffix] = AdminNorm(self.eps, **self.repair,
                                             name=f"norm_{self.kind}{suffix}")
        norm = self.created[suffix]
        if self.admin_ratio is None:
            return norm

        def profiled(skip_BxLxD: jax.Array, branch_BxLxD: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
            omega = self.admin_ratio.value
            self.admin_ratio.value = jnp.sqrt(flat_variance(omega * skip_BxLxD)
                                              + flat_variance(branch_BxLxD))
            return norm(skip_BxLxD, branch_BxLxD, omega)
        return profiled


class Block(nn.Module):
    """One layer: an attention sublayer then an FFN sublayer, combined with their residuals and
    norms as the arrangement ``spec.norm`` says (``postnorm.model.placements``).

    ``post_mix_2`` is lambda for the two sublayers where the arrangement mixes Post and Pre
    (else None). With ``probes_2xS`` (diagnostic mode) each sublayer input X_k is tapped
    (``postnorm.diagnostics.taps``) and the layer also returns its forward statistics;
    otherwise it returns ``None``. Given the running ratio of Admin's profiling pass (variable
    ``ratio`` of ``ADMIN_CARRY``: ``postnorm.model.admin``), its Admin norms take part in it.
    """

    spec: ModelSpec

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, probes_2xS: jax.Array | None,
                 post_mix_2: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
        s = self.spec
        dtype = DTYPES[s.dtype]
        diag = probes_2xS is not None
        arrangement = PLACEMENTS[s.norm]
        if s.residual_budget != "none" and not arrangement.budgetable:
            raise ValueError(f"model.norm={s.norm!r} takes no residual budget")
        gains = tuple(sorted(init_gains(s).items()))
        attn = CausalSelfAttention(s.n_heads, s.init, s.positions, s.rope_base, dtype,
                                   kernel=s.attention, block=s.attention_block,
                                   collect_stats=diag, gains=gains, qk_norm=s.qk_norm,
                                   norm_eps=s.norm_eps, name="attn")
        ffn = SwiGLU(s.d_ff, s.init, dtype, gains=gains, name="ffn")
        stats = {}

        def attend(h_BxLxD: jax.Array) -> jax.Array:
            if not diag:
                return attn(h_BxLxD)
            out_BxLxD, attn_stats = attn(h_BxLxD)
            stats.update(attn_stats)
            return out_BxLxD

        admin_ratio = (self.variable(ADMIN_CARRY, "ratio")
                       if self.has_variable(ADMIN_CARRY, "ratio") else None)
        for index, (kind, branch_fn, sublayer) in enumerate(
                zip(SUBLAYERS, (attend, ffn), arrangement.sublayers, strict=True)):
            norms = SublayerNorms(kind, s, admin_ratio)
            if diag:
                x_BxLxD = tap(x_BxLxD, probes_2xS[index])
            if index == 0:  # after the tap: a layer skip (B2T's) is then a use of the tapped X
                layer_input_BxLxD = x_BxLxD
            ctx = SublayerIn(layer_input_BxLxD, s.n_layers,
                             None if post_mix_2 is None else post_mix_2[index])
            sub = sublayer(x_BxLxD, branch_fn, norms, ctx)
            if diag:
                scale_D = norms.created[sub.norm_suffix].variables["params"]["scale"]
                for key, value in sublayer_stats(x_BxLxD, sub.branch, sub.norm_input, scale_D,
                                                 s.norm_eps).items():
                    stats[f"{key}_{kind}"] = value
                if sub.norm_suffix in norms.branch_scales:
                    for key, value in branch_scale_stats(
                            norms.branch_scales[sub.norm_suffix]).items():
                        stats[f"{key}_{kind}"] = value
            x_BxLxD = sub.out
        return x_BxLxD, (stats if diag else None)


def layer_class(spec: ModelSpec) -> type[nn.Module]:
    """``Block``, wrapped in ``nn.remat`` with ``spec.remat``'s policy unless it is ``none``."""
    if spec.remat == "none":
        return Block
    return nn.remat(Block, prevent_cse=False, policy=REMAT_POLICIES[spec.remat])


class Decoder(nn.Module):
    """Token embedding -> [positions] -> n_layers x Block (scanned) -> [final norm] -> logits."""

    spec: ModelSpec

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array, probes: dict[str, jax.Array] | None = None,
                 post_mix_Lx2: jax.Array | None = None,
                 repair: bool = True) -> jax.Array | tuple[jax.Array, dict]:
        """Logits ``[B, L, V]``; with ``probes`` (``taps.zero_probes``) also the per-layer
        forward statistics, each stacked ``[n_layers]``. ``post_mix_Lx2`` overrides the
        arrangement's lambda profile (an arrangement that mixes Post and Pre only).
        ``repair=False`` leaves out ``spec.grad_repair``: the same forward, and the loss's own
        gradient."""
        s = self.spec
        arrangement = PLACEMENTS[s.norm]
        if post_mix_Lx2 is None and arrangement.post_mix(s) is not None:
            post_mix_Lx2 = jnp.asarray(arrangement.post_mix(s))
        elif post_mix_Lx2 is not None and arrangement.post_mix(s) is None:
            raise ValueError(f"model.norm={s.norm!r} does not mix Post and Pre: no lambda profile")
        embedding_VxD = self.param(
            "embedding", nn.with_logical_partitioning(embedding_init(s.init), ("vocab", "embed")),
            (s.vocab_size, s.d_model), jnp.float32)
        x_BxLxD = jnp.take(embedding_VxD, tokens_BxL, axis=0)
        if s.positions == "learned":
            pos_LxD = self.param(
                "pos_embedding",
                nn.with_logical_partitioning(embedding_init(s.init), ("length", "embed")),
                (s.max_len, s.d_model), jnp.float32)
            x_BxLxD = x_BxLxD + pos_LxD[: tokens_BxL.shape[1]]
        if arrangement.embedding_norm:
            x_BxLxD = RMSNorm(s.norm_eps, name="embedding_norm")(x_BxLxD)
        if s.residual_budget != "none":
            # layer 0's skip is the embedding: its rows enter at RMS <= 1, as every later skip
            # (a norm's output) does at unit gains, so that a scale on F can meet the budget there
            x_BxLxD = cap_rms(x_BxLxD)
        x_BxLxD = x_BxLxD.astype(DTYPES[s.dtype])

        stack = nn.scan(layer_class(s),
                        variable_axes={"params": 0, BUDGET_COLLECTION: 0, ADMIN_PROFILE: 0},
                        variable_carry=ADMIN_CARRY, split_rngs={"params": True},
                        length=s.n_layers, unroll=s.scan_unroll,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        layer_probes = None if probes is None else probes["layers"]
        layer_spec = s if repair else dataclasses.replace(s, grad_repair=None)
        x_BxLxD, stats = stack(layer_spec, name="layers")(x_BxLxD, layer_probes, post_mix_Lx2)
        if probes is not None:  # the residual stream leaving the last layer
            x_BxLxD = tap(x_BxLxD, probes["final"])
            stats["tsim_final"] = tsim(x_BxLxD)
        if arrangement.final_norm:
            z_BxLxD = RMSNorm(s.norm_eps, name="final_norm")(x_BxLxD)
            if post_mix_Lx2 is None:
                x_BxLxD = z_BxLxD
            else:  # phased in as the last sublayer's Post share falls
                lam = post_mix_Lx2[-1, 1].astype(x_BxLxD.dtype)
                x_BxLxD = lam * x_BxLxD + (1 - lam) * z_BxLxD
        logits_BxLxV = self.logits(x_BxLxD, embedding_VxD)
        return logits_BxLxV if probes is None else (logits_BxLxV, stats)

    def logits(self, h_BxLxD: jax.Array, embedding_VxD: jax.Array) -> jax.Array:
        """LM head in float32. Tied heads use E^T / sqrt(d) so logits start at unit scale."""
        s = self.spec
        h = h_BxLxD.astype(jnp.float32)
        if s.tie_embeddings:
            return token_matmul(h, embedding_VxD.T) / jnp.sqrt(s.d_model)
        w_lm_DxV = dense_kernel(self, "lm_head", (s.d_model, s.vocab_size), ("embed", "vocab"),
                                s.init)
        return token_matmul(h, w_lm_DxV)


def abstract_params(spec: ModelSpec) -> dict:
    """The Decoder's parameters as shapes (``jax.eval_shape`` of its init: nothing computed)."""
    model = Decoder(dataclasses.replace(spec, attention="einsum"))  # the same parameters
    tokens_1xL = jnp.zeros((1, spec.max_len), jnp.int32)
    return nn.unbox(jax.eval_shape(lambda key: model.init(key, tokens_1xL)["params"],
                                   jax.random.key(0)))


def param_counts(spec: ModelSpec) -> dict[str, int]:
    """Parameter counts of the real model by top-level group (embedding, layers, ...), and
    their total."""
    counts = {group: sum(leaf.size for leaf in jax.tree.leaves(tree))
              for group, tree in abstract_params(spec).items()}
    return {**counts, "total": sum(counts.values())}
