"""Regenerated results against committed ones, with a stated tolerance.

numpy and XLA pick SIMD kernels by CPU family (AVX2, AVX-512), and their transcendental
functions and reductions differ there in the last bits: ``np.exp(np.mean(np.log(v)))`` gives
0.958682161050505 on one and 0.9586821610505051 on the other. A result recomputed here is
therefore compared with the committed one within ``REL_TOL`` (floats) or one unit of the last
printed digit (numbers in text), never to the last bit.
"""

import math
import re

REL_TOL = 1e-9  # far above the few ulps that kernels differ by, far below any printed digit
ABS_TOL = 1e-12  # for values that are zero on one machine and a rounding error on the other
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def differences(actual: object, expected: object, path: str = "") -> list[str]:
    """Where two JSON values differ: floats beyond ``REL_TOL``/``ABS_TOL``, anything else at
    all (keys, lengths, strings, ints, booleans, None)."""
    if isinstance(expected, float) or isinstance(actual, float):
        if (isinstance(actual, (int, float)) and isinstance(expected, (int, float))
                and not isinstance(actual, bool) and not isinstance(expected, bool)
                and (math.isclose(actual, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL)
                     or (math.isnan(actual) and math.isnan(expected)))):
            return []
        return [f"{path or '.'}: {actual!r} != {expected!r}"]
    if isinstance(expected, dict) and isinstance(actual, dict):
        if actual.keys() != expected.keys():
            return [f"{path or '.'}: keys {sorted(actual)} != {sorted(expected)}"]
        return [d for k in expected for d in differences(actual[k], expected[k], f"{path}.{k}")]
    if isinstance(expected, list) and isinstance(actual, list):
        if len(actual) != len(expected):
            return [f"{path or '.'}: length {len(actual)} != {len(expected)}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected, strict=True))
                for d in differences(a, e, f"{path}[{i}]")]
    return [] if actual == expected and type(actual) is type(expected) else [
        f"{path or '.'}: {actual!r} != {expected!r}"]


def assert_json_matches(actual: object, expected: object) -> None:
    """``actual`` (recomputed) equals ``expected`` (committed) up to float tolerance."""
    diffs = differences(actual, expected)
    assert not diffs, f"{len(diffs)} differences, e.g. " + "; ".join(diffs[:5])


def _is_decimal(text: str) -> bool:
    """A printed float (counts and other integers must be equal)."""
    return "." in text or "e" in text.lower()


def _last_digit_unit(text: str) -> float:
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (-decimals + (int(exponent) if exponent else 0))


def text_differences(actual: str, expected: str) -> list[str]:
    """Lines of two texts (e.g. markdown tables) that differ other than in a printed float's
    last digit by one unit (a value within a few ulps of a rounding boundary). The JSON the
    text is printed from is compared within ``REL_TOL`` beside it."""
    a_lines, e_lines = actual.splitlines(), expected.splitlines()
    if len(a_lines) != len(e_lines):
        return [f"{len(a_lines)} lines != {len(e_lines)} lines"]
    diffs = []
    for number, (a, e) in enumerate(zip(a_lines, e_lines, strict=True), 1):
        if a == e:
            continue
        a_nums, e_nums = _NUMBER.findall(a), _NUMBER.findall(e)
        same_words = _NUMBER.sub("#", a) == _NUMBER.sub("#", e) and len(a_nums) == len(e_nums)
        if not same_words or any(
                x != y and (not _is_decimal(x) or _last_digit_unit(x) != _last_digit_unit(y)
                            or abs(float(x) - float(y)) > 1.5 * _last_digit_unit(y))
                for x, y in zip(a_nums, e_nums, strict=True)):
            diffs.append(f"line {number}: {a!r} != {e!r}")
    return diffs


def assert_text_matches(actual: str, expected: str) -> None:
    """``actual`` (regenerated) is ``expected`` (committed) but for last-digit rounding."""
    diffs = text_differences(actual, expected)
    assert not diffs, f"{len(diffs)} lines differ, e.g. " + "; ".join(diffs[:3])
