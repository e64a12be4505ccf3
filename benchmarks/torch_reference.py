"""The config's model in PyTorch, trained side by side with the JAX train step: MFU of both.

    pip install -r benchmarks/requirements-torch.txt
    python -m benchmarks.torch_reference --config configs/default.py --repeats 7
    taskset -c 0 python -m benchmarks.torch_reference --config configs/default.py --repeats 5

What PyTorch's CPU kernels reach on the same shapes, on the same machine, in the same run. The
PyTorch model is the usual way to write this network: ``nn.Linear`` layers with the Q, K, V
and the gate/up projections fused, ``nn.RMSNorm``, rotary positions on (i, i + K/2) pairs,
``scaled_dot_product_attention(is_causal=True)`` (PyTorch's fused CPU attention kernel) and
fused AdamW with the JAX optimizer's settings, eager (``--torch_compile``: ``torch.compile``,
which needs a C++ compiler). It keeps every activation for the backward pass, as PyTorch does
by default; the JAX step is the trainer's, with the config's remat policy.

Before timing, the PyTorch model is loaded with the JAX model's initial parameters and both
compute the loss and its gradient on one batch: their largest relative differences are
reported (``equivalence``; beyond 1e-5 in the loss or 1e-3 in a gradient it stops), so the
two timings are of the same network. Repeats are
interleaved (JAX peak matmul, PyTorch peak matmul, JAX step, PyTorch step); MFU counts the
model FLOPs of ``postnorm.flops`` against each framework's own fastest 2048² float32 matmul
of that repeat. Both steps' minor page faults per call and the kernel's transparent huge page
mode are reported too (``benchmarks.programs.transparent_hugepage_mode``); ``--profile_ops``
adds the largest ops of one profiled PyTorch step. Prints JSON.
"""

import collections
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import torch
from absl import app, flags
from flax.linen import meta
from ml_collections import config_flags
from torch import nn
from torch.nn import functional

from benchmarks.programs import build_programs, minor_page_faults, timed, transparent_hugepage_mode
from postnorm.flops import train_flops_per_token
from postnorm.model import Decoder, ModelSpec
from postnorm.steps import cross_entropy
from postnorm.validation import check_backend, check_model, check_opt

config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")
flags.DEFINE_integer("repeats", 7, "Timed repeats of each step (after one warm-up).")
flags.DEFINE_integer("vocab_size", 0, "Vocabulary size; 0: data.vocab_size.")
flags.DEFINE_integer("peak_calls", 5, "Back-to-back peak matmuls per repeat; the fastest counts.")
flags.DEFINE_bool("torch_compile", False, "Time the PyTorch step under torch.compile.")
flags.DEFINE_integer("profile_ops", 0, "After timing, profile one PyTorch step and report its "
                     "this many largest ops by self CPU time; 0: no profile.")
FLAGS = flags.FLAGS
PEAK_SIZE = 2048


def check_supported(spec: ModelSpec) -> None:
    """The PyTorch model covers float32 and rotary or no positions."""
    if spec.dtype != "float32":
        raise app.UsageError(f"model.dtype={spec.dtype}: the PyTorch reference is float32 only")
    if spec.positions not in ("rope", "none"):
        raise app.UsageError(f"model.positions={spec.positions}: the PyTorch reference "
                             "supports rope and none")


def rotary_tables(length: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [L, K/2] of the rotary angles, as in ``postnorm.layers.rotary_embedding``."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(angle), torch.sin(angle)


def rotate(x_BxHxLxK: torch.Tensor, cos_LxK2: torch.Tensor, sin_LxK2: torch.Tensor
           ) -> torch.Tensor:
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
    logits = model(tokens_BxL1[:, :-1])
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                    tokens_BxL1[:, 1:].reshape(-1))


def make_optimizer(model: TorchDecoder,
                   opt_cfg: ml_collections.ConfigDict) -> torch.optim.Optimizer:
    """Fused AdamW with the config's betas, eps and decay on the weight matrices only."""
    matrices = [p for n, p in model.named_parameters() if n.endswith("weight") and p.ndim == 2
                and (opt_cfg.decay_norms_and_embeddings or not n.startswith("embedding"))]
    chosen = {id(p) for p in matrices}
    others = [p for p in model.parameters() if id(p) not in chosen]
    groups = [{"params": matrices, "weight_decay": opt_cfg.weight_decay},
              {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opt_cfg.lr, betas=(opt_cfg.b1, opt_cfg.b2),
                             eps=opt_cfg.eps, fused=True)


def profile_step(step_fn: Callable[[], None], top: int) -> dict:
    """Self CPU seconds of one step's ops (``torch.profiler``), the ``top`` largest by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step_fn()
    by_op = collections.Counter()
    for event in prof.key_averages():
        by_op[event.key] += event.self_cpu_time_total / 1e6
    largest = dict(by_op.most_common(top))
    return {"total_self_s": sum(by_op.values()), "largest_ops_self_s": largest,
            "other_self_s": sum(by_op.values()) - sum(largest.values())}


def main(_):
    config = FLAGS.config
    check_model(config)
    check_opt(config)
    check_backend(config, platform=jax.default_backend())
    vocab = FLAGS.vocab_size or config.data.vocab_size
    seq_len, batch_size = config.data.seq_len, config.data.batch_size
    spec = ModelSpec.from_config(config.model, vocab_size=vocab, max_len=seq_len)
    check_supported(spec)
    if config.opt.clip_norm:
        raise app.UsageError("opt.clip_norm: the PyTorch reference step has no clipping; set 0")

    torch.manual_seed(config.seed)
    model = TorchDecoder(spec)
    tokens = np.random.default_rng(0).integers(0, vocab, (batch_size, seq_len + 1), np.int32)
    check = equivalence(spec, model, tokens, config.seed)
    worst = max(check["grad_max_relative_difference"].values())
    if abs(check["torch_loss"] - check["jax_loss"]) > 1e-5 * check["jax_loss"] or worst > 1e-3:
        raise RuntimeError(f"the PyTorch model does not compute the JAX model's loss and "
                           f"gradients: {check}")
    optimizer = make_optimizer(model, config.opt)
    tokens_t = torch.from_numpy(tokens).long()

    def torch_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        train_loss(model, tokens_t).backward()
        optimizer.step()

    step_fn = torch.compile(torch_step) if FLAGS.torch_compile else torch_step
    jax_train = build_programs(config, ["train"], vocab)[0]["train"]

    a_jax = jax.random.normal(jax.random.key(1), (PEAK_SIZE, PEAK_SIZE), jnp.float32)
    jax_matmul = jax.jit(lambda x: x @ x).lower(a_jax).compile()
    a_torch = torch.randn(PEAK_SIZE, PEAK_SIZE)

    def torch_timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    start = time.perf_counter()
    step_fn()  # warm-up (and, with --torch_compile, compilation)
    torch_first_s = time.perf_counter() - start
    jax_train.run()
    jax_train.times.clear()
    jax_train.page_faults.clear()
    jax_peak, torch_peak, torch_times, torch_faults = [], [], [], []
    for _ in range(FLAGS.repeats):
        jax_peak.append(min(timed(lambda: jax_matmul(a_jax)) for _ in range(FLAGS.peak_calls)))
        torch_peak.append(min(torch_timed(lambda: a_torch @ a_torch)
                              for _ in range(FLAGS.peak_calls)))
        jax_train.run()
        faults = minor_page_faults()
        torch_times.append(torch_timed(step_fn))
        torch_faults.append(minor_page_faults() - faults)

    flops = train_flops_per_token(spec, seq_len) * batch_size * seq_len
    peak_flops = 2 * PEAK_SIZE**3

    def summary(times: list[float], peak_times: list[float], faults: list[int]) -> dict:
        median = statistics.median(times)
        peak = peak_flops / statistics.median(peak_times)
        return {"median_s": median, "min_s": min(times), "max_s": max(times),
                "tokens_per_s": batch_size * seq_len / median,
                "achieved_gflop_s": flops / median / 1e9, "peak_gflop_s": peak / 1e9,
                "mfu": flops / median / peak, "minor_page_faults": statistics.median(faults)}

    jax_summary = summary(jax_train.times, jax_peak, jax_train.page_faults)
    torch_summary = summary(torch_times, torch_peak, torch_faults)
    torch_summary.update({"first_call_s": torch_first_s, "compiled": FLAGS.torch_compile,
                          "threads": torch.get_num_threads(), "version": torch.__version__})
    jax_summary.update({"compile_s": jax_train.compile_s, "attention": spec.attention,
                        "remat": spec.remat, "version": jax.__version__})
    profile = profile_step(step_fn, FLAGS.profile_ops) if FLAGS.profile_ops else None
    print(json.dumps({
        "model": {"n_layers": spec.n_layers, "d_model": spec.d_model, "d_ff": spec.d_ff,
                  "n_heads": spec.n_heads, "vocab_size": vocab, "seq_len": seq_len,
                  "batch_size": batch_size, "norm": spec.norm, "model_gflop": flops / 1e9},
        "repeats": FLAGS.repeats, "transparent_hugepages": transparent_hugepage_mode(),
        "equivalence": check, "jax": jax_summary,
        "torch": torch_summary,
        "torch_time_vs_jax": torch_summary["median_s"] / jax_summary["median_s"],
        "torch_profile": profile,
    }, indent=2))


if __name__ == "__main__":
    app.run(main)
