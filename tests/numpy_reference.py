"""An independent float64 numpy forward of the decoder, one unscanned layer at a time."""

import numpy as np


def rms_norm(y: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return y / np.sqrt(np.mean(y**2, axis=-1, keepdims=True) + eps) * scale


def rope(x_LxHxK: np.ndarray, base: float) -> np.ndarray:
    length, _, head_dim = x_LxHxK.shape
    half = head_dim // 2
    out = np.empty_like(x_LxHxK)
    for pos in range(length):
        for i in range(half):
            theta = pos * base ** (-i / half)
            a, b = x_LxHxK[pos, :, i], x_LxHxK[pos, :, i + half]
            out[pos, :, i] = a * np.cos(theta) - b * np.sin(theta)
            out[pos, :, i + half] = b * np.cos(theta) + a * np.sin(theta)
    return out


def attention(x_LxD: np.ndarray, p: dict, n_heads: int, positions: str,
              rope_base: float, eps: float = 1e-6) -> np.ndarray:
    length, d = x_LxD.shape
    k_dim = d // n_heads
    q, k, v = (
        (x_LxD @ p[name]).reshape(length, n_heads, k_dim) for name in ("w_q", "w_k", "w_v"))
    if "q_norm" in p:  # qk-norm: RMSNorm over each head's vector
        q = rms_norm(q, p["q_norm"]["scale"], eps)
        k = rms_norm(k, p["k_norm"]["scale"], eps)
    if positions == "rope":
        q, k = rope(q, rope_base), rope(k, rope_base)
    out = np.zeros((length, n_heads, k_dim))
    for h in range(n_heads):
        for i in range(length):
            logits = np.array([q[i, h] @ k[j, h] for j in range(i + 1)]) / np.sqrt(k_dim)
            w = np.exp(logits - logits.max())
            w /= w.sum()
            out[i, h] = w @ v[: i + 1, h]
    return out.reshape(length, d) @ p["w_o"]


def swiglu(x_LxD: np.ndarray, p: dict) -> np.ndarray:
    gate = x_LxD @ p["w_gate"]
    return (gate / (1 + np.exp(-gate)) * (x_LxD @ p["w_up"])) @ p["w_down"]


def layer_params(params: dict, layer: int) -> dict:
    """Slice layer ``layer`` out of the scanned ``[L, ...]`` parameter stack, as float64."""

    def take(tree):
        if isinstance(tree, dict):
            return {k: take(v) for k, v in tree.items()}
        return np.asarray(tree[layer], np.float64)

    return take(params["layers"])


def forward(params: dict, tokens_L: np.ndarray, *, n_layers: int, n_heads: int, norm: str,
            positions: str, eps: float, rope_base: float, tie: bool,
            mixln_post_layers: int = 0, post_mix: np.ndarray | None = None) -> np.ndarray:
    """Logits ``[L, V]`` of one sequence, under the arrangement ``norm`` written out here rule by
    rule (Mix-LN: the first ``mixln_post_layers`` layers Post, the rest Pre; adaptive: lambda
    ``post_mix`` [n_layers, 2])."""
    emb = np.asarray(params["embedding"], np.float64)
    x = emb[tokens_L]
    if positions == "learned":
        x = x + np.asarray(params["pos_embedding"], np.float64)[: len(tokens_L)]
    if norm == "periln":
        x = rms_norm(x, np.asarray(params["embedding_norm"]["scale"], np.float64), eps)
    alpha = (2.0 * n_layers) ** 0.25
    for layer in range(n_layers):
        p = layer_params(params, layer)
        layer_input = x

        def attn(z, p=p):
            return attention(z, p["attn"], n_heads, positions, rope_base, eps)

        def ffn(z, p=p):
            return swiglu(z, p["ffn"])

        def n(name, z, p=p):
            return rms_norm(z, p[name]["scale"], eps)

        if norm == "b2t":
            h = n("norm_attn", x + attn(x))
            x = n("norm_ffn", layer_input + h + ffn(h))
            continue
        for sub, (name, fn) in enumerate((("attn", attn), ("ffn", ffn))):
            if norm == "adaptive":
                lam = post_mix[layer, sub]
                y = x + fn(lam * x + (1 - lam) * n(f"norm_{name}_in", x))
                x = lam * n(f"norm_{name}", y) + (1 - lam) * y
            elif norm == "post" or (norm == "mixln" and layer < mixln_post_layers):
                x = n(f"norm_{name}", x + fn(x))
            elif norm == "deepnorm":
                x = n(f"norm_{name}", alpha * x + fn(x))
            elif norm in ("pre", "mixln"):
                x = x + fn(n(f"norm_{name}" + ("_in" if norm == "mixln" else ""), x))
            elif norm in ("sandwich", "periln"):
                x = x + n(f"norm_{name}_out", fn(n(f"norm_{name}", x)))
            else:
                raise ValueError(norm)
    if norm in ("pre", "sandwich", "periln") or (norm == "mixln" and mixln_post_layers < n_layers):
        x = rms_norm(x, np.asarray(params["final_norm"]["scale"], np.float64), eps)
    if norm == "adaptive":
        lam = post_mix[-1, 1]
        x = lam * x + (1 - lam) * rms_norm(x, np.asarray(params["final_norm"]["scale"],
                                                         np.float64), eps)
    if tie:
        return x @ emb.T / np.sqrt(emb.shape[1])
    return x @ np.asarray(params["lm_head"], np.float64)


def admin_forward(params: dict, tokens_BxL: np.ndarray, *, n_layers: int, n_heads: int,
                  positions: str, eps: float, rope_base: float, tie: bool,
                  profile: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Admin's logits ``[B, L, V]`` of a batch: X <- N(omega * X + F(X)) at every sublayer, omega
    its norm's ``admin_omega``. With ``profile``, omega is instead the released code's profiling
    rule, written out here: 1 at the first sublayer, then sqrt(var(omega X) + var(F)) over every
    entry of the batch for the next; also returns those omegas ``[n_layers, 2]``."""
    x = np.asarray(params["embedding"], np.float64)[tokens_BxL]
    if positions == "learned":
        x = x + np.asarray(params["pos_embedding"], np.float64)[: tokens_BxL.shape[1]]
    ratio, omegas_Lx2 = 1.0, np.empty((n_layers, 2))
    for layer in range(n_layers):
        p = layer_params(params, layer)
        for sub, name in enumerate(("attn", "ffn")):
            branch = np.stack([attention(row, p["attn"], n_heads, positions, rope_base, eps)
                               if name == "attn" else swiglu(row, p["ffn"]) for row in x])
            norm_p = p[f"norm_{name}"]
            omega = norm_p["admin_omega"]
            if profile:
                omega = np.full(x.shape[-1], ratio)
                omegas_Lx2[layer, sub] = ratio
                ratio = np.sqrt(np.var(omega * x) + np.var(branch))
            x = rms_norm(omega * x + branch, norm_p["scale"], eps)
    emb = np.asarray(params["embedding"], np.float64)
    logits = x @ emb.T / np.sqrt(emb.shape[1]) if tie else x @ np.asarray(params["lm_head"],
                                                                           np.float64)
    return (logits, omegas_Lx2) if profile else logits
