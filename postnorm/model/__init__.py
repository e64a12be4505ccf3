"""The network: spec, layers, initialisers, the arrangement registry, the decoder and its FLOPs."""

from postnorm.model.decoder import REMAT_POLICIES, Block, Decoder, abstract_params, param_counts
from postnorm.model.placements import PLACEMENTS
from postnorm.model.spec import DTYPES, POSITION_SCHEMES, ModelSpec

__all__ = ["DTYPES", "PLACEMENTS", "POSITION_SCHEMES", "REMAT_POLICIES", "Block", "Decoder",
           "ModelSpec", "abstract_params", "param_counts"]
