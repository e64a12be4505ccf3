"""A hand-written, unscanned JAX forward of the decoder, split at every sublayer input X_k.

Its attention, FFN, norms and layer loop share no code with ``postnorm.model``: it slices layer
l out of the stacked parameters and applies the sublayers one by one, so cotangents dL/dX_k
can be taken with ``jax.vjp``. Only each arrangement's sublayer rules (how X, F and the norms
combine) and its flags come from the registry ``postnorm.model.placements.PLACEMENTS`` (whose
forward tests/numpy_reference.py checks rule by rule), so every registered arrangement runs here.
"""

import jax
import jax.numpy as jnp

from postnorm.model.placements import PLACEMENTS, SublayerIn


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


class LayerNorms:
    """The ``placements.Norms`` of one sublayer, read from layer parameters ``p``: plain RMSNorms
    (no residual budget)."""

    def __init__(self, p, kind, eps):
        self.p, self.kind, self.eps = p, kind, eps

    def __call__(self, suffix):
        scale = self.p[f"norm_{self.kind}{suffix}"]["scale"]
        return lambda z: rms_norm(z, scale, self.eps)

    def residual(self, suffix):
        def plain(skip, branch):
            y = skip + branch
            return self(suffix)(y), y
        return plain

    def admin(self, suffix):
        omega = self.p[f"norm_{self.kind}{suffix}"]["admin_omega"]
        return lambda skip, branch: self.residual(suffix)(omega * skip, branch)


def embed(params, tokens_BxL, spec):
    """X_0: the token embedding [+ learned positions] [+ the arrangement's embedding norm]."""
    x = params["embedding"][tokens_BxL]
    if spec.positions == "learned":
        x = x + params["pos_embedding"][: tokens_BxL.shape[1]]
    if PLACEMENTS[spec.norm].embedding_norm:
        x = rms_norm(x, params["embedding_norm"]["scale"], spec.norm_eps)
    return x


def sublayers(params, spec):
    """The ordered sublayer maps (X_k, X_layer) -> X_{k+1} of ``spec``'s arrangement, X_layer
    the input of X_k's layer (which B2T's FFN sublayer reads)."""
    if spec.residual_budget != "none" or spec.qk_norm:
        raise ValueError("the reference has no residual budget and no qk-norm")
    arrangement = PLACEMENTS[spec.norm]
    post_mix_Lx2 = arrangement.post_mix(spec)
    rope_base = spec.rope_base if spec.positions == "rope" else None
    maps = []
    for layer in range(spec.n_layers):
        p = jax.tree.map(lambda a, layer=layer: a[layer], params["layers"])
        branches = (lambda z, p=p: attention(z, p["attn"], spec.n_heads, rope_base),
                    lambda z, p=p: swiglu(z, p["ffn"]))
        for index, (kind, branch, rule) in enumerate(
                zip(("attn", "ffn"), branches, arrangement.sublayers, strict=True)):
            lam = None if post_mix_Lx2 is None else jnp.asarray(post_mix_Lx2[layer, index])
            norms = LayerNorms(p, kind, spec.norm_eps)

            def apply(x, layer_input, rule=rule, branch=branch, norms=norms, lam=lam):
                return rule(x, branch, norms, SublayerIn(layer_input, spec.n_layers, lam)).out
            maps.append(apply)
    return maps


def run_from(maps, k, x, layer_input=None):
    """The last layer's output from X_k = ``x``. A layer's input is its attention sublayer's
    input; for an FFN input X_k, ``layer_input`` is its layer's, held fixed."""
    for j in range(k, len(maps)):
        if j % 2 == 0:
            layer_input = x
        x = maps[j](x, layer_input)
    return x


def stream(maps, x):
    """[(X_k, the input of X_k's layer)] for every sublayer input k, and the last layer's output."""
    inputs = []
    for j, f in enumerate(maps):
        if j % 2 == 0:
            layer_input = x
        inputs.append((x, layer_input))
        x = f(x, layer_input)
    return inputs, x


def head(params, x, *, norm, eps, post_mix_Lx2=None):
    """Logits: the arrangement's final norm if it has one (mixed in by the last sublayer's
    lambda where it has a lambda profile ``post_mix_Lx2``), then the LM head."""
    if PLACEMENTS[norm].final_norm:
        z = rms_norm(x, params["final_norm"]["scale"], eps)
        lam = None if post_mix_Lx2 is None else post_mix_Lx2[-1, 1]
        x = z if lam is None else lam * x + (1 - lam) * z
    return x @ params["lm_head"]
