"""How a config field is declared (``Field``, ``Method``) and the rules its value must meet."""

import dataclasses
import math
import re
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Check:
    """A rule for one field's value: ``ok(value)``; the field must be ``allowed`` (the text of
    the error that names it)."""

    ok: Callable[[object], bool]
    allowed: str

    def problem(self, path: str, value: object) -> str | None:
        """None when ``value`` passes, else the error naming ``path``, ``value`` and the rule."""
        if self.ok(value):
            return None
        finite = "finite and " if isinstance(value, float) and not math.isfinite(value) else ""
        return f"{path}={value!r} is invalid: must be {finite}{self.allowed}"


@dataclasses.dataclass(frozen=True)
class ChoiceInCode:
    """One of the names that the code implementing the field defines (the placements, the
    attention kernels, ...), in a room above config: ``postnorm.train.validate.CHOICES``
    supplies them by field."""

    def bind(self, choices: tuple[str, ...]) -> Check:
        return one_of(*choices)


one_of_code = ChoiceInCode()


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field: its dotted ``path``, ``default`` and ``help``; ``check``, the rule its
    value must meet (None: ``postnorm.data.check_data_config`` checks it); ``resumable``, whether
    a resume may change it; ``added``, the schema version (``fields.VERSIONS``) that added it,
    None for the first schema's fields."""

    path: str
    default: object
    help: str
    check: Check | ChoiceInCode | None
    resumable: bool = False
    added: str | None = None

    @property
    def section(self) -> str:
        """The section holding the field; '' for a top-level field (``seed``)."""
        return self.path.rpartition(".")[0]


@dataclasses.dataclass(frozen=True)
class Method:
    """A method's options, declared together; its code reads them from the sections ``reads``."""

    help: str
    reads: tuple[str, ...]
    options: tuple[Field, ...]


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    """A finite int or float (not a bool)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return isinstance(v, int) or math.isfinite(v)


def one_of(*choices: str) -> Check:
    return Check(lambda v: v in choices, f"one of {list(choices)}")


positive_int = Check(lambda v: is_int(v) and v >= 1, "an integer >= 1")
boolean = Check(lambda v: isinstance(v, bool), "true or false")


def text(allowed: str) -> Check:
    """Any string; ``allowed`` says what it holds."""
    return Check(lambda v: isinstance(v, str), allowed)


_INTERVAL = re.compile(r"(?:a number )?in ([\[(])(\S+), (\S+?)([\])])( \(.+\))?")
_BOUND = re.compile(r"(an integer|a number) (>=|>) (\S+)( \(.+\))?")


def number(allowed: str) -> Check:
    """A finite number in the range that ``allowed`` states, as the error says it: 'in [0, 1)',
    'a number in (0, 1)', 'a number > 0', 'a number >= 0 (0 disables it)'; 'an integer >= 0'
    for an int."""
    if m := _INTERVAL.fullmatch(allowed):
        lo_open, lo, hi, hi_open = m[1] == "(", float(m[2]), float(m[3]), m[4] == ")"
        return Check(lambda v: is_number(v) and (lo < v if lo_open else lo <= v)
                     and (v < hi if hi_open else v <= hi), allowed)
    if m := _BOUND.fullmatch(allowed):
        kind = is_int if m[1] == "an integer" else is_number
        strict, bound = m[2] == ">", float(m[3])
        return Check(lambda v: kind(v) and (v > bound if strict else v >= bound), allowed)
    raise ValueError(f"number({allowed!r}): state 'in [lo, hi)' or 'a number >= x'")
