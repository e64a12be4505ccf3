"""Model FLOPs of the decoder, for throughput and MFU.

Per token, a forward pass costs 2 FLOPs per matmul weight (multiply and add) plus the two
attention matmuls (Q K^T and P V), each 2 n d per layer when the full n x n score matrix is
counted, as is conventional (PaLM, appendix B) even though the causal mask zeroes half of it:

    forward  = 2 N + 4 L n d
    training = 3 x forward = 6 N + 12 L n d      (backward = 2 x forward)

N counts every matmul weight: the layers' 4 d^2 + 3 d d_ff and the LM head d V (a tied head is
still a d x V matmul). Embedding lookups, norms, softmax and elementwise work are not counted.
Rematerialised recomputation is not counted either: MFU measures useful work.
"""

from postnorm.model import ModelSpec


def matmul_params(spec: ModelSpec) -> int:
    """N: the weights that enter a matmul once per token."""
    per_layer = 4 * spec.d_model**2 + 3 * spec.d_model * spec.d_ff
    return spec.n_layers * per_layer + spec.d_model * spec.vocab_size


def forward_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    return 2 * matmul_params(spec) + 4 * spec.n_layers * seq_len * spec.d_model


def train_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    return 3 * forward_flops_per_token(spec, seq_len)
