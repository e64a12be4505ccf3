"""ModelSpec: the frozen description of the network, from ``config.model`` and the data."""

import dataclasses

import jax.numpy as jnp
import ml_collections

from postnorm.config.fields import DEFAULTS
from postnorm.model.repair import GradRepair

POSITION_SCHEMES = ("rope", "learned", "none")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything the network needs; built from ``config.model`` plus data-derived sizes: each
    field named as a ``model.*`` field takes its value (``from_config``).

    ``attention`` is a kernel name, never ``auto``, which a config's programs resolve first
    (``postnorm.train.programs.resolve_attention``).
    """

    vocab_size: int
    max_len: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    norm: str = "post"
    positions: str = "rope"
    init: str = "torch_default"
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    dtype: str = "float32"
    attention: str = "einsum"
    attention_block: int = 128
    remat: str = "none"
    scan_unroll: int = 1
    # the methods' model.* options (postnorm.config.fields.METHODS), their defaults declared there
    qk_norm: bool = DEFAULTS["model.qk_norm"]
    mixln_post_fraction: float = DEFAULTS["model.mixln_post_fraction"]
    adaptive_initial_mix: float = DEFAULTS["model.adaptive_initial_mix"]
    adaptive_profile: str = DEFAULTS["model.adaptive_profile"]  # placements.profile_values
    b2t_rescaled_init: bool = DEFAULTS["model.b2t_rescaled_init"]
    residual_budget: str = DEFAULTS["model.residual_budget"]
    residual_budget_c: float = DEFAULTS["model.residual_budget_c"]
    # W_O's init gain, solved by the similarity-aware init (postnorm.model.similarity_init)
    # when model.init_tsim_target is set; not a config field
    attn_out_gain: float = 1.0
    # gradient repair's rule at every residual norm (train.grad_repair; postnorm.model.repair),
    # None when off; not a model.* field
    grad_repair: GradRepair | None = None

    @classmethod
    def from_config(cls, model_cfg: ml_collections.ConfigDict | dict, *, vocab_size: int,
                    max_len: int, grad_repair: GradRepair | None = None) -> "ModelSpec":
        fields = {f.name for f in dataclasses.fields(cls)} - {"vocab_size", "max_len",
                                                               "attn_out_gain", "grad_repair"}
        values = {k: model_cfg[k] for k in fields if k in model_cfg}
        if values.get("attention") == "auto":
            raise ValueError("model.attention='auto' names no kernel: resolve it first "
                             "(postnorm.train.programs.resolve_attention)")
        return cls(vocab_size=vocab_size, max_len=max_len, grad_repair=grad_repair, **values)
