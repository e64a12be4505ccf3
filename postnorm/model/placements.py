"""The registry of residual/norm arrangements (``model.norm``) that ``Block`` consults.

Each entry says how a sublayer combines its input X, its branch F (attention or FFN) and its
norms, whether the stack has a final norm (and an embedding norm), how its weights are scaled
at init, and its action on the mean-field Gram (``postnorm.theory.GramMaps``). Constants come
from the depth, never typed in.

=========  ============================================  =========================================
name       sublayer (N: RMSNorm)                          source
=========  ============================================  =========================================
post       X <- N(X + F(X))                              Vaswani et al. 2017
pre        X <- X + F(N(X)); final norm                  Xiong et al. 2020
deepnorm   X <- N(alpha X + F(X)), alpha = (2L)^(1/4);   DeepNet (Wang et al. 2022), decoder-only
           W_V, W_O, W_up, W_down x beta = (8L)^(-1/4)
mixln      Post for the first ceil(rho L) layers, Pre    Mix-LN (Li et al. 2024)
           after; final norm
sandwich   X <- X + N_out(F(N_in(X))); final norm        CogView (Ding et al. 2021)
periln     sandwich, plus a norm on the embedding        Peri-LN (Kim et al. 2025)
b2t        h = N(X + A(X)); X <- N(X + h + FFN(h))       B2T (Takase et al. 2023)
adaptive   lambda N(X + F(X')) + (1 - lambda)(X + F(X')),  the paper's improvement 1 (adaptive norm
           X' = lambda X + (1 - lambda) N_in(X); lambda    placement)
           per sublayer is training state; final norm
admin      X <- N(omega * X + F(X)), omega [D] learnable,  Admin (Liu et al. 2020)
           set at init by a profiling pass
=========  ============================================  =========================================
"""

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import numpy as np

from postnorm.model.spec import ModelSpec
from postnorm.theory import POST_GRAM, PRE_GRAM, GramMaps, LayerMaps, mixed_gram

Fn = Callable[[jax.Array], jax.Array]
LAYER_MATRICES = ("w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down")


class Norms(Protocol):
    """A sublayer's norms, each created on first use and named ``norm_<kind><suffix>``.

    ``norms(suffix)`` is an RMSNorm. ``norms.residual(suffix)(skip, branch)`` is the norm of the
    residual sum: (N(y), y) with y = skip + F, where ``model.residual_budget`` may scale F
    (``postnorm.model.layers.ResidualNorm``). ``norms.admin(suffix)(skip, branch)`` is Admin's:
    (N(y), y) with y = omega * skip + F, omega the norm's learnable ``admin_omega``
    (``postnorm.model.layers.AdminNorm``).
    """

    def __call__(self, suffix: str) -> Fn: ...

    def residual(self, suffix: str) -> Callable[[jax.Array, jax.Array],
                                                tuple[jax.Array, jax.Array]]: ...

    def admin(self, suffix: str) -> Callable[[jax.Array, jax.Array],
                                             tuple[jax.Array, jax.Array]]: ...


class SublayerIn(NamedTuple):
    """What a sublayer may read besides its input: the layer's input (the attention sublayer's
    X), the stack's depth, and lambda, this sublayer's Post-Norm share (``mixed``; else None)."""

    layer_input: jax.Array
    n_layers: int
    post_mix: jax.Array | None


class SublayerOut(NamedTuple):
    """What a sublayer computed: its output X_{k+1}, its branch's output F, y, the input of the
    norm whose contraction c_k the diagnostics report, and that norm's suffix."""

    out: jax.Array
    branch: jax.Array
    norm_input: jax.Array
    norm_suffix: str = ""


Sublayer = Callable[[jax.Array, Fn, Norms, SublayerIn], SublayerOut]


def post_sublayer(x: jax.Array, branch_fn: Fn, norms: Norms, ctx: SublayerIn) -> SublayerOut:
    branch = branch_fn(x)
    out, y = norms.residual("")(x, branch)
    return SublayerOut(out, branch, y)


def pre_sublayer(x: jax.Array, branch_fn: Fn, norms: Norms, ctx: SublayerIn) -> SublayerOut:
    branch = branch_fn(norms("")(x))
    return SublayerOut(x + branch, branch, x)


def deepnorm_alpha(n_layers: int) -> float:
    """DeepNet's decoder-only skip gain alpha = (2L)^(1/4), L the number of layers."""
    return (2.0 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    """DeepNet's decoder-only init gain beta = (8L)^(-1/4)."""
    return (8.0 * n_layers) ** -0.25


def deepnorm_sublayer(x: jax.Array, branch_fn: Fn, norms: Norms, ctx: SublayerIn) -> SublayerOut:
    branch = branch_fn(x)
    out, y = norms.residual("")(deepnorm_alpha(ctx.n_layers) * x, branch)
    return SublayerOut(out, branch, y)


def sandwich_sublayer(x: jax.Array, branch_fn: Fn, norms: Norms, ctx: SublayerIn) -> SublayerOut:
    branch = norms("_out")(branch_fn(norms("")(x)))
    return SublayerOut(x + branch, branch, x)


def mixed_sublayer(x: jax.Array, branch_fn: Fn, norms: Norms, ctx: SublayerIn) -> SublayerOut:
    """lambda Post + (1 - lambda) Pre with one branch evaluation: the branch reads
    lambda X + (1 - lambda) N_in(X), and the sublayer returns lambda N(y) + (1 - lambda) y with
    y = X + F. lambda = 1 is exactly ``post``, lambda = 0 exactly ``pre``. c is reported for the
    Post norm's input y (the contraction it applies, or would apply at lambda = 0)."""
    lam = ctx.post_mix.astype(x.dtype)
    branch = branch_fn(lam * x + (1 - lam) * norms("_in")(x))
    normed, y = norms.residual("")(x, branch)
    return SublayerOut(lam * normed + (1 - lam) * y, branch, y)


def b2t_attn_sublayer(x: jax.Array, branch_fn: Fn, norms: Norms, ctx: SublayerIn) -> SublayerOut:
    return post_sublayer(x, branch_fn, norms, ctx)


def b2t_ffn_sublayer(x: jax.Array, branch_fn: Fn, norms: Norms, ctx: SublayerIn) -> SublayerOut:
    """y = X_layer + h + FFN(h), h the attention sublayer's output: the skip over its norm."""
    branch = branch_fn(x)
    out, y = norms.residual("")(ctx.layer_input + x, branch)
    return SublayerOut(out, branch, y)


def admin_sublayer(x: jax.Array, branch_fn: Fn, norms: Norms, ctx: SublayerIn) -> SublayerOut:
    branch = branch_fn(x)
    out, y = norms.admin("")(x, branch)
    return SublayerOut(out, branch, y)


def _no_gains(spec: ModelSpec) -> dict[str, float]:
    return {}


def _deepnorm_gains(spec: ModelSpec) -> dict[str, float]:
    """beta on W_V, W_O and the FFN's linear path W_up, W_down. W_gate keeps its scale: scaling
    it would move SiLU's operating point, which DeepNet's derivation (a linear FFN) does not."""
    beta = deepnorm_beta(spec.n_layers)
    return {"w_v": beta, "w_o": beta, "w_up": beta, "w_down": beta}


def _b2t_gains(spec: ModelSpec) -> dict[str, float]:
    """With ``b2t_rescaled_init``, every layer matrix x L^(-1/2) (B2T's rescaled init);
    the embedding and the LM head keep theirs."""
    if not spec.b2t_rescaled_init:
        return {}
    return dict.fromkeys(LAYER_MATRICES, spec.n_layers ** -0.5)


def mixln_post_layers(spec: ModelSpec) -> int:
    """Mix-LN's Post-Norm layers: the first ceil(rho L)."""
    return math.ceil(spec.mixln_post_fraction * spec.n_layers - 1e-9)


def _mixln_profile(spec: ModelSpec) -> np.ndarray:
    """lambda per (layer, sublayer): 1 in the first ceil(rho L) layers, 0 after."""
    profile_Lx2 = np.zeros((spec.n_layers, 2), np.float32)
    profile_Lx2[: mixln_post_layers(spec)] = 1.0
    return profile_Lx2


SANDWICH_GRAM = GramMaps(reads_normalized=True, normalized_stream=False, output_normalized=True)


def _uniform_gram(maps: GramMaps) -> Callable[[ModelSpec], list[LayerMaps]]:
    return lambda spec: [(maps, maps)] * spec.n_layers


def _deepnorm_gram(spec: ModelSpec) -> list[LayerMaps]:
    maps = GramMaps(reads_normalized=False, normalized_stream=True,
                    skip_gain=deepnorm_alpha(spec.n_layers))
    return [(maps, maps)] * spec.n_layers


def _mixln_gram(spec: ModelSpec) -> list[LayerMaps]:
    return [(POST_GRAM, POST_GRAM) if lam[0] == 1 else (PRE_GRAM, PRE_GRAM)
            for lam in _mixln_profile(spec)]


def profile_values(text: str, n_layers: int) -> np.ndarray:
    """``model.adaptive_profile`` (``profile_text``) as lambda [n_layers, 2]; ValueError naming
    the field when it is not 2 n_layers numbers in [0, 1]."""
    try:
        values = np.array([float(v) for v in text.split()], np.float64)
    except ValueError as err:
        raise ValueError(f"model.adaptive_profile={text!r} is not a list of numbers separated "
                         f"by spaces ({err})") from err
    if values.size != 2 * n_layers:
        raise ValueError(f"model.adaptive_profile holds {values.size} values, not 2 x "
                         f"model.n_layers = {2 * n_layers}: one lambda per sublayer, layer by "
                         "layer, attention then FFN")
    if not np.all((values >= 0) & (values <= 1)):
        raise ValueError(f"model.adaptive_profile holds values outside [0, 1]: "
                         f"{values[~((values >= 0) & (values <= 1))].tolist()}")
    return values.astype(np.float32).reshape(n_layers, 2)


def profile_text(profile_Lx2) -> str:
    """lambda [n_layers, 2] as ``model.adaptive_profile`` takes it: the shortest text of each
    float32 value that reads back as the same float32, layer by layer, attention then FFN."""
    return " ".join(np.format_float_positional(np.float32(v), unique=True, trim="-")
                    for v in np.asarray(profile_Lx2, np.float32).ravel())


def _adaptive_profile(spec: ModelSpec) -> np.ndarray:
    """lambda at init: ``spec.adaptive_profile`` where given, else ``spec.adaptive_initial_mix``
    at every sublayer (the training state carries it from there:
    ``postnorm.train.placement_control``)."""
    if spec.adaptive_profile:
        return profile_values(spec.adaptive_profile, spec.n_layers)
    return np.full((spec.n_layers, 2), spec.adaptive_initial_mix, np.float32)


def _adaptive_gram(spec: ModelSpec) -> list[LayerMaps]:
    """The Gram maps at init, per sublayer: Post where lambda is 1, Pre where 0, the mixture
    in between (``postnorm.theory.mixed_gram``)."""
    return [tuple(mixed_gram(float(lam)) for lam in pair) for pair in _adaptive_profile(spec)]


def _b2t_gram(spec: ModelSpec) -> list[LayerMaps]:
    return [(POST_GRAM, dataclasses.replace(POST_GRAM, layer_skip=True))] * spec.n_layers


ADMIN_GRAM = dataclasses.replace(POST_GRAM, profiled_skip=True)


@dataclasses.dataclass(frozen=True)
class Arrangement:
    """One entry of the registry.

    sublayers: the attention and the FFN sublayer's rule, ``(x, branch_fn, norms, ctx)``.
    final_norm: a norm before the LM head (with a lambda profile, mixed in by the last
      sublayer's lambda: lambda X + (1 - lambda) N(X)).
    embedding_norm: a norm on the embedding's output.
    init_gains: the spec -> the gain each layer matrix is drawn with (1 where absent).
    post_mix: the spec -> lambda [n_layers, 2], each sublayer's Post-Norm share, or None.
    gram_maps: the spec -> its action on the mean-field Gram, one (attention, FFN) pair per layer.
    branch_output_norm: each branch's output passes a norm, which undoes any gain on its last
      matrix (so the similarity-aware init's W_O gain has nothing to act on).
    budgetable: every sublayer normalises a residual sum X + F whose skip X leaves a norm, so
      that a residual budget (``Norms.residual``) bounds the contraction c on the skip path by
      scaling F alone (at layer 0, whose skip is the embedding, the decoder caps the rows' RMS
      at 1: ``layers.cap_rms``). Not DeepNorm (alpha X alone has c <= 1/alpha), B2T (its FFN's
      skip, X + h, is two normalised rows) or Mix-LN (its Pre layers have no such norm).
    stateful_mix: lambda is training state (checkpointed, moved by a controller), not a
      constant of the spec: the steps pass it to the model.
    profiled: parameters set at init by a profiling pass on a batch (Admin's omega:
      ``postnorm.model.admin``), which a fresh run makes on its first training batch.
    """

    sublayers: tuple[Sublayer, Sublayer]
    final_norm: bool
    gram_maps: Callable[[ModelSpec], list[LayerMaps]]
    embedding_norm: bool = False
    init_gains: Callable[[ModelSpec], dict[str, float]] = _no_gains
    post_mix: Callable[[ModelSpec], np.ndarray | None] = lambda spec: None
    branch_output_norm: bool = False
    budgetable: bool = False
    stateful_mix: bool = False
    profiled: bool = False


PLACEMENTS: dict[str, Arrangement] = {
    "post": Arrangement((post_sublayer,) * 2, final_norm=False,
                        gram_maps=_uniform_gram(POST_GRAM), budgetable=True),
    "pre": Arrangement((pre_sublayer,) * 2, final_norm=True, gram_maps=_uniform_gram(PRE_GRAM)),
    "deepnorm": Arrangement((deepnorm_sublayer,) * 2, final_norm=False,
                            gram_maps=_deepnorm_gram, init_gains=_deepnorm_gains),
    "mixln": Arrangement((mixed_sublayer,) * 2, final_norm=True, gram_maps=_mixln_gram,
                         post_mix=_mixln_profile),
    "sandwich": Arrangement((sandwich_sublayer,) * 2, final_norm=True,
                            gram_maps=_uniform_gram(SANDWICH_GRAM), branch_output_norm=True),
    "periln": Arrangement((sandwich_sublayer,) * 2, final_norm=True, embedding_norm=True,
                          gram_maps=_uniform_gram(SANDWICH_GRAM), branch_output_norm=True),
    "b2t": Arrangement((b2t_attn_sublayer, b2t_ffn_sublayer), final_norm=False,
                       gram_maps=_b2t_gram, init_gains=_b2t_gains),
    "adaptive": Arrangement((mixed_sublayer,) * 2, final_norm=True, gram_maps=_adaptive_gram,
                            post_mix=_adaptive_profile, stateful_mix=True),
    "admin": Arrangement((admin_sublayer,) * 2, final_norm=False,
                         gram_maps=_uniform_gram(ADMIN_GRAM), profiled=True),
}


def init_gains(spec: ModelSpec) -> dict[str, float]:
    """Each layer matrix's init gain: the arrangement's, times ``spec.attn_out_gain`` on W_O
    (the similarity-aware init's solved value, 1 unless ``model.init_tsim_target`` is set)."""
    gains = dict(PLACEMENTS[spec.norm].init_gains(spec))
    if spec.attn_out_gain != 1.0:
        gains["w_o"] = gains.get("w_o", 1.0) * spec.attn_out_gain
    return gains
