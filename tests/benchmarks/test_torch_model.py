"""The PyTorch model of the reference benchmark is the same network as the JAX model.

Needs PyTorch (``pip install -r benchmarks/requirements-torch.txt``); skipped without it.
"""

import jax
import ml_collections
import numpy as np
import pytest
from flax.linen import meta

from postnorm.model import Decoder, ModelSpec
from postnorm.train.optim import weight_decay_mask

pytest.importorskip("torch")

from benchmarks import torch_model  # noqa: E402  (needs torch)


@pytest.mark.parametrize("norm,tie,positions", [("post", False, "rope"), ("pre", True, "rope"),
                                                ("post", False, "none")])
def test_torch_model_computes_the_jax_models_loss_and_gradients(norm, tie, positions):
    spec = ModelSpec(vocab_size=64, max_len=16, n_layers=3, d_model=32, n_heads=4, d_ff=48,
                     norm=norm, tie_embeddings=tie, positions=positions)
    tokens = np.random.default_rng(1).integers(0, spec.vocab_size, (4, 17), np.int32)
    check = torch_model.equivalence(spec, torch_model.TorchDecoder(spec), tokens, seed=3)
    assert check["torch_loss"] == pytest.approx(check["jax_loss"], rel=1e-5)
    assert max(check["grad_max_relative_difference"].values()) < 1e-4


@pytest.mark.parametrize("decay_all", [False, True])
def test_torch_optimizer_decays_what_the_jax_mask_decays(decay_all):
    spec = ModelSpec(vocab_size=64, max_len=16, n_layers=2, d_model=32, n_heads=4, d_ff=48,
                     norm="pre")
    opt_cfg = ml_collections.ConfigDict(dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8,
                                             weight_decay=0.1,
                                             decay_norms_and_embeddings=decay_all))
    groups = torch_model.make_optimizer(torch_model.TorchDecoder(spec), opt_cfg).param_groups
    torch_decayed = sum(p.numel() for g in groups if g["weight_decay"] > 0 for p in g["params"])
    torch_total = sum(p.numel() for g in groups for p in g["params"])
    tokens = np.zeros((1, 16), np.int32)
    params = meta.unbox(Decoder(spec).init(jax.random.key(0), tokens)["params"])
    leaves, masks = jax.tree.leaves(params), jax.tree.leaves(weight_decay_mask(params, decay_all))
    jax_decayed = sum(p.size for p, m in zip(leaves, masks, strict=True) if m)
    assert torch_total == sum(p.size for p in jax.tree.leaves(params))
    assert torch_decayed == jax_decayed
