"""Model FLOPs of the decoder, for throughput and MFU.

Per token, a forward pass costs 2 FLOPs per matmul weight (multiply and add) plus the two
attention matmuls (Q K^T and P V), each 2 n d per layer when the full n x n score matrix is
counted, as is conventional (PaLM, appendix B) even though the causal mask zeroes half of it:

    forward  = 2 N + 4 L n d
    training = 3 x forward = 6 N + 12 L n d      (backward = 2 x forward)

N counts every matmul weight: the layers' matrices (4 d^2 + 3 d d_ff per layer with SwiGLU,
read off the real model's parameter shapes) and the LM head d V (a tied head is still a d x V
matmul). Embedding lookups, norms, softmax and elementwise work are not counted.
Rematerialised recomputation is not counted either: MFU measures useful work.
"""

import jax

from postnorm.model.decoder import abstract_params
from postnorm.model.spec import ModelSpec


def matmul_params(spec: ModelSpec) -> int:
    """N: the weights that enter a matmul once per token (the stacked layers' matrices, whose
    leaves are [n_layers, fan_in, fan_out], and the LM head)."""
    layers = abstract_params(spec)["layers"]
    stacked = sum(leaf.size for leaf in jax.tree.leaves(layers) if leaf.ndim == 3)
    return stacked + spec.d_model * spec.vocab_size


def forward_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    return 2 * matmul_params(spec) + 4 * spec.n_layers * seq_len * spec.d_model


def train_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    return 3 * forward_flops_per_token(spec, seq_len)
