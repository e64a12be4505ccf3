"""Model FLOPs (postnorm.model.flops) against XLA's own count, and the benchmark script."""

import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from postnorm.model import Decoder, ModelSpec
from postnorm.model.flops import forward_flops_per_token, matmul_params, train_flops_per_token


def xla_forward_flops(spec: ModelSpec, tokens: jax.Array) -> float:
    """XLA's cost analysis of the compiled forward pass at init."""
    model = Decoder(spec)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    compiled = jax.jit(lambda p, x: model.apply({"params": p}, x)).lower(params, tokens).compile()
    analysis = compiled.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]


@pytest.mark.parametrize("tie", [False, True])
def test_forward_flops_match_xla_cost_analysis(tie):
    """XLA counts every dot (2 M N K) plus elementwise work, which adds about 2% here.

    The layer loop is fully unrolled: XLA's cost analysis counts a while loop's body once.
    """
    spec = ModelSpec(vocab_size=512, max_len=64, n_layers=3, d_model=64, n_heads=4, d_ff=256,
                     tie_embeddings=tie, positions="none", scan_unroll=3)
    tokens = jnp.zeros((2, 64), jnp.int32)
    xla_flops = xla_forward_flops(spec, tokens)
    formula = forward_flops_per_token(spec, 64) * tokens.size
    assert formula <= xla_flops <= 1.05 * formula
    assert matmul_params(spec) == 3 * (4 * 64**2 + 3 * 64 * 256) + 64 * 512
    assert train_flops_per_token(spec, 64) == 3 * forward_flops_per_token(spec, 64)


def test_attention_flops_against_xla_where_attention_dominates():
    """n = 512 with one 64-dim head: scores and P V are about 2/3 of the forward FLOPs, so the
    attention term's coefficient (4 n d per token and layer) is pinned, not just the total."""
    spec = ModelSpec(vocab_size=64, max_len=512, n_layers=1, d_model=64, n_heads=1, d_ff=64,
                     positions="none")
    tokens = jnp.zeros((1, 512), jnp.int32)
    xla_flops = xla_forward_flops(spec, tokens)
    formula = forward_flops_per_token(spec, 512) * tokens.size
    assert formula <= xla_flops <= 1.05 * formula, xla_flops / formula


@pytest.mark.slow
def test_bench_script_reports_every_program_and_variant():
    config = ("configs/default.py:model.n_layers=2,model.d_model=32,model.d_ff=64,"
              "data.seq_len=16,data.batch_size=8,data.vocab_size=128")  # 8 test devices
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", f"--config={config}",
         "--programs=train,diag,forward", "--repeats=2", "--peak_size=256",
         "--variant=model.remat=none", "--variant=model.remat=full"],
        capture_output=True, text=True, check=True, timeout=600).stdout
    report = json.loads(out)
    assert report["peak"]["gflop_s"] > 0
    assert list(report["variants"]) == ["model.remat=none", "model.remat=full"]
    for variant in report["variants"].values():
        assert list(variant["programs"]) == ["train", "diag", "forward"]
        for program in variant["programs"].values():
            assert program["mfu"] > 0 and program["median_s"] > 0
            assert program["memory"]["peak_estimate_bytes"] > 0
            assert isinstance(program["minor_page_faults"], (int, float))
    assert report["transparent_hugepages"] in (None, "always", "madvise", "never")
    assert report["cpu"]["cores"] >= 1
    first = report["variants"]["model.remat=none"]["programs"]["train"]
    assert first["time_vs_first_variant"] == 1.0
