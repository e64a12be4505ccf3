"""Non-finite floats in the project's JSON files (``metrics.jsonl``, ``result.json``, summaries).

JSON has no NaN or infinity, so they are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` and read back as floats.
"""

import json
import math
from typing import Any

_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def as_text(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by its text (lists, tuples, dicts walked)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {key: as_text(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [as_text(value) for value in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``as_text(obj)``: valid JSON whatever floats ``obj`` holds."""
    return json.dumps(as_text(obj), allow_nan=False, **kwargs)


def from_text(obj: Any) -> Any:
    """The inverse of ``as_text``: ``"nan"``, ``"inf"`` and ``"-inf"`` values become floats."""
    if isinstance(obj, str):
        return _TEXT.get(obj, obj)
    if isinstance(obj, dict):
        return {key: from_text(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [from_text(value) for value in obj]
    return obj
