"""The ops of a compiled program by model part, from the HLO's ``op_name`` metadata
(``benchmarks.profile_step``)."""

import re

from postnorm.diagnostics.stats import STATS_SCOPE


def op_group(op_name: str, hlo_name: str) -> tuple[str, str, str]:
    """(part, pass, kind) of one op from its ``op_name`` metadata."""
    direction = "backward" if "transpose(" in op_name else "forward"
    kind = "matmul" if ("dot_general" in op_name or hlo_name.startswith("dot")) else "other"
    scopes = op_name.split("/")
    parts = [p for p in scopes
             if p in ("attn", "attn_core", "ffn", "norm_attn", "norm_ffn", "Decoder.logits")]
    if STATS_SCOPE in scopes:
        part = STATS_SCOPE
    elif parts:
        part = parts[-1]
    elif "Decoder" in op_name:
        part = "decoder_other"  # embedding, scan bookkeeping
    elif "jvp" in op_name:
        part = "loss"
    else:
        part = "optimizer_and_guard"
    return part, direction, kind


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """``{HLO instruction name: its op_name metadata}`` of a compiled program's text."""
    return dict(re.findall(r'^\s+%([\w.\-]+) = .*?op_name="([^"]*)"', hlo_text, re.M))
