"""Decoder-only Transformer with selectable norm placement, layers stacked with ``nn.scan``.

``model.norm``:

* ``post``: x <- N(x + Attn(x)); x <- N(x + FFN(x)). The last layer's output is already
  normalised, so there is no final norm.
* ``pre``:  x <- x + Attn(N(x)); x <- x + FFN(N(x)); a final N before the LM head.

Parameters of the layer stack carry a leading ``[n_layers]`` axis (logical name ``layers``).

``model.remat`` picks what the backward pass keeps of each layer's forward (``REMAT_POLICIES``):
``none`` keeps every intermediate; ``dots`` keeps matmul outputs and recomputes elementwise
work; ``dots_no_batch`` keeps only
matmul outputs without batch dimensions, so it also recomputes the attention scores and
probabilities (the [B, H, n, n] arrays); ``full`` keeps only the layer input. Every policy
also keeps the ``cpu`` attention kernel's output and log-sum-exp (``KERNEL_RESIDUALS``), so
its backward never reruns its forward.
``model.scan_unroll`` layers are unrolled per iteration of the layer loop (compile time grows
with it). A scanned loop copies what the backward pass keeps into buffers stacked over the
layers and back out; with ``scan_unroll = n_layers`` there is no loop and no such copy, so
``remat=none`` then gave the fastest train step measured for the default config on CPU
(``docs/PERFORMANCE.md``).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from postnorm.diagnostics import sublayer_stats, tsim
from postnorm.initializers import embedding_init
from postnorm.kernels.causal_attention import KERNEL_RESIDUALS
from postnorm.layers import CausalSelfAttention, RMSNorm, SwiGLU, dense_kernel, token_matmul
from postnorm.taps import tap

NORM_PLACEMENTS = ("post", "pre")
POSITION_SCHEMES = ("rope", "learned", "none")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_SAVE_KERNEL_RESIDUALS = jax.checkpoint_policies.save_only_these_names(*KERNEL_RESIDUALS)
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots, _SAVE_KERNEL_RESIDUALS),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _SAVE_KERNEL_RESIDUALS),
    "full": _SAVE_KERNEL_RESIDUALS,
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything the network needs; built from ``config.model`` plus data-derived sizes."""

    vocab_size: int
    max_len: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    norm: str = "post"
    positions: str = "rope"
    init: str = "torch_default"
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    dtype: str = "float32"
    attention: str = "einsum"
    attention_block: int = 128
    remat: str = "none"
    scan_unroll: int = 1

    @classmethod
    def from_config(cls, model_cfg: ml_collections.ConfigDict, *, vocab_size: int,
                    max_len: int) -> "ModelSpec":
        fields = {f.name for f in dataclasses.fields(cls)} - {"vocab_size", "max_len"}
        return cls(vocab_size=vocab_size, max_len=max_len,
                   **{k: model_cfg[k] for k in fields if k in model_cfg})


class Block(nn.Module):
    """One layer: an attention sublayer then an FFN sublayer, each with a residual and a norm.

    With ``probes_2xS`` (diagnostic mode) each sublayer input X_k is tapped (``postnorm.taps``)
    and the layer also returns its forward statistics; otherwise it returns ``None``.
    """

    spec: ModelSpec

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array,
                 probes_2xS: jax.Array | None) -> tuple[jax.Array, dict | None]:
        s = self.spec
        dtype = DTYPES[s.dtype]
        diag = probes_2xS is not None
        attn = CausalSelfAttention(s.n_heads, s.init, s.positions, s.rope_base, dtype,
                                   kernel=s.attention, block=s.attention_block,
                                   collect_stats=diag, name="attn")
        ffn = SwiGLU(s.d_ff, s.init, dtype, name="ffn")
        stats = {}
        for index, (kind, sublayer) in enumerate((("attn", attn), ("ffn", ffn))):
            norm = RMSNorm(s.norm_eps, name=f"norm_{kind}")
            if diag:
                x_BxLxD = tap(x_BxLxD, probes_2xS[index])
            branch = sublayer(x_BxLxD if s.norm == "post" else norm(x_BxLxD))
            if diag and kind == "attn":
                branch, attn_stats = branch
                stats.update(attn_stats)
            if s.norm == "post":
                y_BxLxD = x_BxLxD + branch
                x_next = norm(y_BxLxD)
            else:
                y_BxLxD = x_BxLxD
                x_next = x_BxLxD + branch
            if diag:
                scale_D = norm.variables["params"]["scale"]
                for key, value in sublayer_stats(x_BxLxD, branch, y_BxLxD, scale_D,
                                                 s.norm_eps).items():
                    stats[f"{key}_{kind}"] = value
            x_BxLxD = x_next
        return x_BxLxD, (stats if diag else None)


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

        block = Block
        if s.remat != "none":
            block = nn.remat(Block, prevent_cse=False, policy=REMAT_POLICIES[s.remat])
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=s.n_layers, unroll=s.scan_unroll,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        layer_probes = None if probes is None else probes["layers"]
        x_BxLxD, stats = stack(s, name="layers")(x_BxLxD, layer_probes)
        if probes is not None:  # the residual stream leaving the last layer
            x_BxLxD = tap(x_BxLxD, probes["final"])
            stats["tsim_final"] = tsim(x_BxLxD)
        if s.norm == "pre":
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


def param_count_formula(spec: ModelSpec) -> dict[str, int]:
    """Parameter counts by group, from the architecture (no initialisation needed)."""
    d, f = spec.d_model, spec.d_ff
    per_layer = 4 * d * d + 3 * d * f + 2 * d
    counts = {
        "embedding": spec.vocab_size * d,
        "pos_embedding": spec.max_len * d if spec.positions == "learned" else 0,
        "layers": spec.n_layers * per_layer,
        "final_norm": d if spec.norm == "pre" else 0,
        "lm_head": 0 if spec.tie_embeddings else d * spec.vocab_size,
    }
    counts["total"] = sum(counts.values())
    return counts

