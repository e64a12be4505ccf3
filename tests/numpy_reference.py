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
              rope_base: float) -> np.ndarray:
    length, d = x_LxD.shape
    k_dim = d // n_heads
    q, k, v = (
        (x_LxD @ p[name]).reshape(length, n_heads, k_dim) for name in ("w_q", "w_k", "w_v"))
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
    stack = params["layers"]
    return {group: {k: np.asarray(v[layer], np.float64) for k, v in stack[group].items()}
            for group in stack}


def forward(params: dict, tokens_L: np.ndarray, *, n_layers: int, n_heads: int, norm: str,
            positions: str, eps: float, rope_base: float, tie: bool) -> np.ndarray:
    """Logits ``[L, V]`` of one sequence."""
    emb = np.asarray(params["embedding"], np.float64)
    x = emb[tokens_L]
    if positions == "learned":
        x = x + np.asarray(params["pos_embedding"], np.float64)[: len(tokens_L)]
    for layer in range(n_layers):
        p = layer_params(params, layer)
        for name, fn in (("attn", lambda z, p=p: attention(z, p["attn"], n_heads, positions,
                                                             rope_base)),
                         ("ffn", lambda z, p=p: swiglu(z, p["ffn"]))):
            scale = p[f"norm_{name}"]["scale"]
            if norm == "post":
                x = rms_norm(x + fn(x), scale, eps)
            else:
                x = x + fn(rms_norm(x, scale, eps))
    if norm == "pre":
        x = rms_norm(x, np.asarray(params["final_norm"]["scale"], np.float64), eps)
    if tie:
        return x @ emb.T / np.sqrt(emb.shape[1])
    return x @ np.asarray(params["lm_head"], np.float64)
