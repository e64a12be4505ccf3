"""Decoder-only Transformer: embedding, ``nn.scan`` over ``Block``s, final norm if any, LM head."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from postnorm.diagnostics.stats import sublayer_stats, tsim
from postnorm.diagnostics.taps import tap
from postnorm.kernels.causal_attention import KERNEL_RESIDUALS
from postnorm.model.initializers import embedding_init
from postnorm.model.layers import CausalSelfAttention, RMSNorm, SwiGLU, dense_kernel, token_matmul
from postnorm.model.placements import PLACEMENTS
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


class Block(nn.Module):
    """One layer: an attention sublayer then an FFN sublayer, each with a residual and a norm.

    With ``probes_2xS`` (diagnostic mode) each sublayer input X_k is tapped
    (``postnorm.diagnostics.taps``) and the layer also returns its forward statistics;
    otherwise it returns ``None``.
    """

    spec: ModelSpec

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array,
                 probes_2xS: jax.Array | None) -> tuple[jax.Array, dict | None]:
        s = self.spec
        dtype = DTYPES[s.dtype]
        diag = probes_2xS is not None
        arrangement = PLACEMENTS[s.norm]
        attn = CausalSelfAttention(s.n_heads, s.init, s.positions, s.rope_base, dtype,
                                   kernel=s.attention, block=s.attention_block,
                                   collect_stats=diag, name="attn")
        ffn = SwiGLU(s.d_ff, s.init, dtype, name="ffn")
        stats = {}

        def attend(h_BxLxD: jax.Array) -> jax.Array:
            if not diag:
                return attn(h_BxLxD)
            out_BxLxD, attn_stats = attn(h_BxLxD)
            stats.update(attn_stats)
            return out_BxLxD

        for index, (kind, branch_fn) in enumerate(zip(SUBLAYERS, (attend, ffn), strict=True)):
            norm = RMSNorm(s.norm_eps, name=f"norm_{kind}")
            if diag:
                x_BxLxD = tap(x_BxLxD, probes_2xS[index])
            sub = arrangement.sublayer(x_BxLxD, branch_fn, norm)
            if diag:
                scale_D = norm.variables["params"]["scale"]
                for key, value in sublayer_stats(x_BxLxD, sub.branch, sub.norm_input, scale_D,
                                                 s.norm_eps).items():
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
    def __call__(self, tokens_BxL: jax.Array,
                 probes: dict[str, jax.Array] | None = None) -> jax.Array | tuple[jax.Array, dict]:
        """Logits ``[B, L, V]``; with ``probes`` (``taps.zero_probes``) also the per-layer
        forward statistics, each stacked ``[n_layers]``."""
        s = self.spec
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
        x_BxLxD = x_BxLxD.astype(DTYPES[s.dtype])

        stack = nn.scan(layer_class(s), variable_axes={"params": 0}, split_rngs={"params": True},
                        length=s.n_layers, unroll=s.scan_unroll,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        layer_probes = None if probes is None else probes["layers"]
        x_BxLxD, stats = stack(s, name="layers")(x_BxLxD, layer_probes)
        if probes is not None:  # the residual stream leaving the last layer
            x_BxLxD = tap(x_BxLxD, probes["final"])
            stats["tsim_final"] = tsim(x_BxLxD)
        if PLACEMENTS[s.norm].final_norm:
            x_BxLxD = RMSNorm(s.norm_eps, name="final_norm")(x_BxLxD)
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
