"""The PyTorch reference benchmark times the same network as the JAX model.

Needs PyTorch (``pip install -r benchmarks/requirements-torch.txt``); skipped without it.
"""

import numpy as np
import pytest

from postnorm.model import ModelSpec

torch = pytest.importorskip("torch")
torch_reference = pytest.importorskip("benchmarks.torch_reference")


@pytest.mark.parametrize("norm,tie,positions", [("post", False, "rope"), ("pre", True, "rope"),
                                                ("post", False, "none")])
def test_torch_model_computes_the_jax_models_loss_and_gradients(norm, tie, positions):
    spec = ModelSpec(vocab_size=64, max_len=16, n_layers=3, d_model=32, n_heads=4, d_ff=48,
                     norm=norm, tie_embeddings=tie, positions=positions)
    tokens = np.random.default_rng(1).integers(0, spec.vocab_size, (4, 17), np.int32)
    check = torch_reference.equivalence(spec, torch_reference.TorchDecoder(spec), tokens, seed=3)
    assert check["torch_loss"] == pytest.approx(check["jax_loss"], rel=1e-5)
    assert set(check["grad_max_relative_difference"]) >= {"embedding", "layer0_w_q"}
    assert max(check["grad_max_relative_difference"].values()) < 1e-4
