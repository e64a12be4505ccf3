"""The registry of residual/norm arrangements (``model.norm``) that ``Block`` consults."""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax

from postnorm.theory import POST_GRAM, PRE_GRAM, GramMaps

Fn = Callable[[jax.Array], jax.Array]


class SublayerOut(NamedTuple):
    """What a sublayer computed: its output X_{k+1}, its branch's output F, and y, the input of
    the norm whose contraction c_k the diagnostics report."""

    out: jax.Array
    branch: jax.Array
    norm_input: jax.Array


@dataclasses.dataclass(frozen=True)
class Arrangement:
    """One entry of the registry: ``sublayer(x, branch_fn, norm)`` computes a sublayer,
    ``final_norm`` adds a norm before the LM head, ``gram`` is its mean-field action."""

    sublayer: Callable[[jax.Array, Fn, Fn], SublayerOut]
    final_norm: bool
    gram: GramMaps


def post_sublayer(x: jax.Array, branch_fn: Fn, norm: Fn) -> SublayerOut:
    branch = branch_fn(x)
    y = x + branch
    return SublayerOut(norm(y), branch, y)


def pre_sublayer(x: jax.Array, branch_fn: Fn, norm: Fn) -> SublayerOut:
    branch = branch_fn(norm(x))
    return SublayerOut(x + branch, branch, x)


PLACEMENTS: dict[str, Arrangement] = {
    "post": Arrangement(post_sublayer, final_norm=False, gram=POST_GRAM),  # x <- N(x + F(x))
    "pre": Arrangement(pre_sublayer, final_norm=True, gram=PRE_GRAM),  # x <- x + F(N(x))
}
