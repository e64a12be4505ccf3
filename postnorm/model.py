"""Decoder-only Transformer with selectable norm placement, layers stacked with ``nn.scan``.

``model.norm``:

* ``post``: x <- N(x + Attn(x)); x <- N(x + FFN(x)). The last layer's output is already
  normalised, so there is no final norm.
* ``pre``:  x <- x + Attn(N(x)); x <- x + FFN(N(x)); a final N before the LM head.

Parameters of the layer stack carry a leading ``[n_layers]`` axis (logical name ``layers``).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from postnorm.initializers import embedding_init
from postnorm.layers import CausalSelfAttention, RMSNorm, SwiGLU, dense_kernel

NORM_PLACEMENTS = ("post", "pre")
POSITION_SCHEMES = ("rope", "learned", "none")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


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

    @classmethod
    def from_config(cls, model_cfg: ml_collections.ConfigDict, *, vocab_size: int,
                    max_len: int) -> "ModelSpec":
        fields = {f.name for f in dataclasses.fields(cls)} - {"vocab_size", "max_len"}
        return cls(vocab_size=vocab_size, max_len=max_len,
                   **{k: model_cfg[k] for k in fields if k in model_cfg})


class Block(nn.Module):
    """One layer: an attention sublayer then an FFN sublayer, each with a residual and a norm."""

    spec: ModelSpec

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, _: None) -> tuple[jax.Array, None]:
        s = self.spec
        dtype = DTYPES[s.dtype]
        sublayers = (
            CausalSelfAttention(s.n_heads, s.init, s.positions, s.rope_base, dtype, name="attn"),
            SwiGLU(s.d_ff, s.init, dtype, name="ffn"),
        )
        for sublayer, norm_name in zip(sublayers, ("norm_attn", "norm_ffn"), strict=True):
            norm = RMSNorm(s.norm_eps, name=norm_name)
            if s.norm == "post":
                x_BxLxD = norm(x_BxLxD + sublayer(x_BxLxD))
            else:
                x_BxLxD = x_BxLxD + sublayer(norm(x_BxLxD))
        return x_BxLxD, None


class Decoder(nn.Module):
    """Token embedding -> [positions] -> n_layers x Block (scanned) -> [final norm] -> logits."""

    spec: ModelSpec

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
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
        x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("batch", "length", "embed"))

        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=s.n_layers, metadata_params={nn.PARTITION_NAME: "layers"})
        x_BxLxD, _ = stack(s, name="layers")(x_BxLxD, None)
        if s.norm == "pre":
            x_BxLxD = RMSNorm(s.norm_eps, name="final_norm")(x_BxLxD)
        return self.logits(x_BxLxD, embedding_VxD)

    def logits(self, h_BxLxD: jax.Array, embedding_VxD: jax.Array) -> jax.Array:
        """LM head in float32. Tied heads use E^T / sqrt(d) so logits start at unit scale."""
        s = self.spec
        h = h_BxLxD.astype(jnp.float32)
        if s.tie_embeddings:
            return (h @ embedding_VxD.T) / jnp.sqrt(s.d_model)
        w_lm_DxV = dense_kernel(self, "lm_head", (s.d_model, s.vocab_size), ("embed", "vocab"),
                                s.init)
        return h @ w_lm_DxV


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

