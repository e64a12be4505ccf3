"""Default: a deep, narrow model on the embedded corpus, sized for a laptop CPU.

48 layers, d=64, 4 heads, d_ff=192, n=128: the defaults of ``postnorm/config/fields.py``.
Variants: ``post`` (the default placement) and ``pre``. Example:
``--config configs/default.py:pre,lr=3e-3``.
"""

import ml_collections

from postnorm.config import apply_arg, base_config


def _post(c: ml_collections.ConfigDict) -> None:
    c.model.norm = "post"


def _pre(c: ml_collections.ConfigDict) -> None:
    c.model.norm = "pre"


VARIANTS = {"post": _post, "pre": _pre}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return apply_arg(base_config(), arg, VARIANTS)
