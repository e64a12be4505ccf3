"""ModelSpec: the frozen description of the network, from ``config.model`` and the data."""

import dataclasses

import jax.numpy as jnp
import ml_collections

from postnorm.model.repair import GradRepair

POSITION_SCHEMES = ("rope", "learned", "none")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything the network needs; built from ``config.model`` plus data-derived sizes.

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
    qk_norm: bool = False
    mixln_post_fraction: float = 0.25
    adaptive_initial_mix: float = 1.0
    adaptive_profile: str = ""  # lambda per sublayer at init (placements.profile_values)
    b2t_rescaled_init: bool = False
    residual_budget: str = "none"
    residual_budget_c: float = 0.9
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
