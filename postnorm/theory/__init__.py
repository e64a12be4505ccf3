"""The paper's theory in numpy: closed forms of the one-step theorems and the depth recursions."""

from postnorm.theory.closed_forms import (
    INIT_SCHEMES,
    S_READINGS,
    Amounts,
    amounts,
    amounts_from_config,
    attn_f1,
    attn_f2,
    collapse_distance,
    collapse_loss_bound,
    delta_attn,
    delta_ffn,
    ec_rho,
    frequency_loss,
    gate_kernel,
    gate_kernel_table,
    harmonic,
    kernel_variance,
    rmsnorm_contraction,
    tsim,
    tsim_of_gram,
    unigram_entropy,
)
from postnorm.theory.recursions import (
    POST_GRAM,
    PRE_GRAM,
    GramMaps,
    MeanFieldTrace,
    attn_branch_gram,
    correlation,
    ffn_branch_gram,
    mean_field_ffn_step,
    mean_field_recursion,
    prefix_average,
    scalar_recursion,
)

__all__ = [
    "INIT_SCHEMES", "POST_GRAM", "PRE_GRAM", "S_READINGS", "Amounts", "GramMaps",
    "MeanFieldTrace", "amounts", "amounts_from_config", "attn_branch_gram", "attn_f1", "attn_f2",
    "collapse_distance", "collapse_loss_bound", "correlation", "delta_attn", "delta_ffn",
    "ec_rho", "ffn_branch_gram", "frequency_loss", "gate_kernel", "gate_kernel_table",
    "harmonic", "kernel_variance", "mean_field_ffn_step", "mean_field_recursion",
    "prefix_average", "rmsnorm_contraction", "scalar_recursion", "tsim", "tsim_of_gram",
    "unigram_entropy",
]
