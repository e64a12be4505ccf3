"""The decoder of ``postnorm.model`` written the usual PyTorch way, for side-by-side timing.

``nn.Linear`` layers with the Q, K, V and the gate/up projections fused, ``nn.RMSNorm``, rotary
positions on (i, i + K/2) pairs and ``scaled_dot_product_attention(is_causal=True)``
(PyTorch's fused CPU attention kernel). ``load_jax_params`` copies a ``Decoder``'s parameters
in, ``equivalence`` compares the two models' loss and gradients on one batch, and
``make_optimizer`` is the trainer's AdamW in PyTorch.
"""

import jax
import ml_collections
import numpy as np
import torch
from flax.linen import meta
from torch import nn
from torch.nn import functional

from postnorm.model import Decoder, ModelSpec
from postnorm.train.losses import cross_entropy


def check_supported(spec: ModelSpec) -> None:
    """The PyTorch model covers float32 and rotary or no positions."""
    if spec.dtype != "float32":
        raise ValueError(f"model.dtype={spec.dtype}: the PyTorch reference is float32 only")
    if spec.positions not in ("rope", "none"):
        raise ValueError(f"model.positions={spec.positions}: the PyTorch reference "
                         "supports rope and none")


def rotary_tables(length: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [L, K/2] of the rotary angles (``postnorm.model.layers.rotary_embedding``)."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(angle), torch.sin(angle)


def rotate(x_BxHxLxK: torch.Tensor, cos_LxK2: torch.Tensor, sin_LxK2: torch.Tensor
           ) -> torch.Tensor:
    """Rotate pairs (i, i + K/2) of each head vector by the tabulated angles (RoPE)."""
    x1, x2 = x_BxHxLxK.chunk(2, dim=-1)
    return torch.cat([x1 * cos_LxK2 - x2 * sin_LxK2, x2 * cos_LxK2 + x1 * sin_LxK2], dim=-1)


class TorchBlock(nn.Module):
    """One layer: attention then SwiGLU, each with a residual and RMSNorm (post or pre)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        d = spec.d_model
        self.spec = spec
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * spec.d_ff, bias=False)
        self.down = nn.Linear(spec.d_ff, d, bias=False)
        self.norm_attn = nn.RMSNorm(d, eps=spec.norm_eps)
        self.norm_ffn = nn.RMSNorm(d, eps=spec.norm_eps)

    def attention(self, x_BxLxD: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        batch, length, d = x_BxLxD.shape
        heads = self.spec.n_heads
        qkv = self.qkv(x_BxLxD).view(batch, length, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        q_BxHxLxK, k_BxHxLxK, v_BxHxLxK = qkv.unbind(0)
        if rope is not None:
            q_BxHxLxK, k_BxHxLxK = rotate(q_BxHxLxK, *rope), rotate(k_BxHxLxK, *rope)
        out_BxHxLxK = functional.scaled_dot_product_attention(q_BxHxLxK, k_BxHxLxK, v_BxHxLxK,
                                                     is_causal=True)
        return self.out(out_BxHxLxK.transpose(1, 2).reshape(batch, length, d))

    def ffn(self, x_BxLxD: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x_BxLxD).chunk(2, dim=-1)
        return self.down(functional.silu(gate) * up)

    def forward(self, x_BxLxD: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        if self.spec.norm == "post":
            x_BxLxD = self.norm_attn(x_BxLxD + self.attention(x_BxLxD, rope))
            return self.norm_ffn(x_BxLxD + self.ffn(x_BxLxD))
        x_BxLxD = x_BxLxD + self.attention(self.norm_attn(x_BxLxD), rope)
        return x_BxLxD + self.ffn(self.norm_ffn(x_BxLxD))


class TorchDecoder(nn.Module):
    """Embedding -> n_layers x TorchBlock -> [final norm] -> LM head, like ``Decoder``."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embedding = nn.Embedding(spec.vocab_size, spec.d_model)
        self.blocks = nn.ModuleList(TorchBlock(spec) for _ in range(spec.n_layers))
        self.final_norm = (nn.RMSNorm(spec.d_model, eps=spec.norm_eps) if spec.norm == "pre"
                           else None)
        self.lm_head = None if spec.tie_embeddings else nn.Linear(spec.d_model, spec.vocab_size,
                                                                  bias=False)
        if spec.positions == "rope":
            cos, sin = rotary_tables(spec.max_len, spec.d_model // spec.n_heads, spec.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens_BxL: torch.Tensor) -> torch.Tensor:
        length = tokens_BxL.shape[1]
        rope = None
        if self.spec.positions == "rope":
            rope = (self.rope_cos[:length], self.rope_sin[:length])
        x_BxLxD = self.embedding(tokens_BxL)
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD, rope)
        if self.final_norm is not None:
            x_BxLxD = self.final_norm(x_BxLxD)
        if self.lm_head is None:
            return x_BxLxD @ self.embedding.weight.T / self.spec.d_model**0.5
        return self.lm_head(x_BxLxD)


def load_jax_params(model: TorchDecoder, params: dict) -> None:
    """Copy ``Decoder`` parameters (``[fan_in, fan_out]``, layers stacked) into ``model``."""
    p = jax.tree.map(np.array, meta.unbox(params))  # writable copies, as torch expects
    layers = p["layers"]

    def linear(*kernels_IxO: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(kernels_IxO, axis=1).T.copy())

    with torch.no_grad():
        model.embedding.weight.copy_(torch.from_numpy(p["embedding"]))
        for i, block in enumerate(model.blocks):
            attn, ffn = layers["attn"], layers["ffn"]
            block.qkv.weight.copy_(linear(attn["w_q"][i], attn["w_k"][i], attn["w_v"][i]))
            block.out.weight.copy_(linear(attn["w_o"][i]))
            block.gate_up.weight.copy_(linear(ffn["w_gate"][i], ffn["w_up"][i]))
            block.down.weight.copy_(linear(ffn["w_down"][i]))
            block.norm_attn.weight.copy_(torch.from_numpy(layers["norm_attn"]["scale"][i]))
            block.norm_ffn.weight.copy_(torch.from_numpy(layers["norm_ffn"]["scale"][i]))
        if model.final_norm is not None:
            model.final_norm.weight.copy_(torch.from_numpy(p["final_norm"]["scale"]))
        if model.lm_head is not None:
            model.lm_head.weight.copy_(linear(p["lm_head"]))


def max_relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |a - b| over the largest |b|."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def equivalence(spec: ModelSpec, model: TorchDecoder, tokens: np.ndarray, seed: int) -> dict:
    """Loss and gradients of both models from the same parameters, on one batch."""
    jax_model = Decoder(spec)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params = jax_model.init(jax.random.key(seed), inputs)["params"]
    load_jax_params(model, params)

    def loss_fn(p):
        return cross_entropy(jax_model.apply({"params": p}, inputs), targets)

    jax_loss, jax_grads = jax.value_and_grad(loss_fn)(params)
    jax_grads = jax.tree.map(np.asarray, meta.unbox(jax_grads))
    model.zero_grad(set_to_none=True)
    torch_loss = train_loss(model, torch.from_numpy(tokens).long())
    torch_loss.backward()
    ffn = model.blocks[0].gate_up.weight.grad.numpy()
    pairs = {
        "embedding": (model.embedding.weight.grad.numpy(), jax_grads["embedding"]),
        "layer0_w_q": (model.blocks[0].qkv.weight.grad.numpy()[: spec.d_model].T,
                       jax_grads["layers"]["attn"]["w_q"][0]),
        "layer0_w_gate": (ffn[: spec.d_ff].T, jax_grads["layers"]["ffn"]["w_gate"][0]),
        "last_layer_w_down": (model.blocks[-1].down.weight.grad.numpy().T,
                              jax_grads["layers"]["ffn"]["w_down"][-1]),
        "last_layer_norm_ffn": (model.blocks[-1].norm_ffn.weight.grad.numpy(),
                                jax_grads["layers"]["norm_ffn"]["scale"][-1]),
    }
    if model.lm_head is not None:
        pairs["lm_head"] = (model.lm_head.weight.grad.numpy().T, jax_grads["lm_head"])
    model.zero_grad(set_to_none=True)
    return {"jax_loss": float(jax_loss), "torch_loss": float(torch_loss.detach()),
            "grad_max_relative_difference": {k: max_relative_difference(t, j)
                                             for k, (t, j) in pairs.items()}}


def train_loss(model: nn.Module, tokens_BxL1: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``tokens`` [B, L + 1] (inputs ``[:, :-1]``)."""
    logits = model(tokens_BxL1[:, :-1])
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                    tokens_BxL1[:, 1:].reshape(-1))


def make_optimizer(model: TorchDecoder,
                   opt_cfg: ml_collections.ConfigDict) -> torch.optim.Optimizer:
    """Fused AdamW, decaying what ``postnorm.train.optim.weight_decay_mask`` decays: every weight
    but the norm gains and the embedding, or everything with ``decay_norms_and_embeddings``."""

    def decays(name: str) -> bool:
        return opt_cfg.decay_norms_and_embeddings or not (name.startswith("embedding")
                                                          or "norm" in name)

    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": opt_cfg.weight_decay},
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opt_cfg.lr, betas=(opt_cfg.b1, opt_cfg.b2),
                             eps=opt_cfg.eps, fused=True)
