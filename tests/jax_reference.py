"""A hand-written, unscanned JAX forward of the decoder, split at every sublayer input X_k.

It shares no code with ``postnorm.model``: it slices layer l out of the stacked parameters and
applies the sublayers one by one, so cotangents dL/dX_k can be taken with ``jax.vjp``.
"""

import jax
import jax.numpy as jnp


def rms_norm(y, scale, eps):
    return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps) * scale


def rope(x_BxLxHxK, base):
    """Rotary positions: the pair (x_i, x_{i+K/2}) of position t turns by t * base^(-2i/K)."""
    n, k_dim = x_BxLxHxK.shape[1], x_BxLxHxK.shape[3]
    half = k_dim // 2
    angle = jnp.arange(n)[:, None] * base ** (-2.0 * jnp.arange(half) / k_dim)
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    first, second = x_BxLxHxK[..., :half], x_BxLxHxK[..., half:]
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def attention(x_BxLxD, p, n_heads, rope_base=None):
    """Causal softmax attention, with rotary positions when ``rope_base`` is given."""
    b, n, d = x_BxLxD.shape
    k_dim = d // n_heads
    q, k, v = ((x_BxLxD @ p[w]).reshape(b, n, n_heads, k_dim) for w in ("w_q", "w_k", "w_v"))
    if rope_base is not None:
        q, k = rope(q, rope_base), rope(k, rope_base)
    logits = jnp.einsum("bihk,bjhk->bhij", q, k) / jnp.sqrt(k_dim)
    logits = jnp.where(jnp.tril(jnp.ones((n, n), bool)), logits, -jnp.inf)
    out = jnp.einsum("bhij,bjhk->bihk", jax.nn.softmax(logits, -1), v)
    return out.reshape(b, n, d) @ p["w_o"]


def swiglu(x_BxLxD, p):
    return (jax.nn.silu(x_BxLxD @ p["w_gate"]) * (x_BxLxD @ p["w_up"])) @ p["w_down"]


def sublayers(params, *, n_layers, n_heads, norm, eps, rope_base=None):
    """The ordered list of sublayer maps X_k -> X_{k+1}."""
    maps = []
    for layer in range(n_layers):
        p = jax.tree.map(lambda a, layer=layer: a[layer], params["layers"])
        for kind, branch in (("attn", lambda z, p=p: attention(z, p["attn"], n_heads,
                                                               rope_base)),
                             ("ffn", lambda z, p=p: swiglu(z, p["ffn"]))):
            scale = p[f"norm_{kind}"]["scale"]
            if norm == "post":
                maps.append(lambda x, f=branch, s=scale: rms_norm(x + f(x), s, eps))
            else:
                maps.append(lambda x, f=branch, s=scale: x + f(rms_norm(x, s, eps)))
    return maps


def head(params, x, *, norm, eps):
    if norm == "pre":
        x = rms_norm(x, params["final_norm"]["scale"], eps)
    return x @ params["lm_head"]
