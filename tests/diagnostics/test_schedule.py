"""The diagnostic step's schedule (postnorm.diagnostics.schedule) against its definition."""

import pytest

from postnorm.diagnostics.schedule import diagnostic_steps, is_diagnostic_step


@pytest.mark.parametrize("every,dense_every,dense_until", [
    (10, 10, 0), (500, 50, 5000), (7, 3, 20), (4, 6, 30), (1, 1, 0)])
def test_the_steps_are_step_one_the_dense_phase_and_the_sparse_grid(every, dense_every,
                                                                     dense_until):
    diag = {"every": every, "dense_every": dense_every, "dense_until": dense_until}
    total = 6000
    want = sorted({1} | set(range(dense_every, dense_until + 1, dense_every))
                  | set(range(every, total + 1, every)))
    assert diagnostic_steps(total, diag) == want


def test_a_section_without_the_dense_fields_is_the_sparse_grid():
    """A run recorded before the dense phase existed keeps its diagnostic steps."""
    assert diagnostic_steps(35, {"every": 10}) == [1, 10, 20, 30]
    assert not is_diagnostic_step(5, {"every": 10})
