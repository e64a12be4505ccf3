"""Heatmap geometry: every diagnostic step gets its own column, centred on that step."""

import json
import os
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pytest

from postnorm.analysis.figures import _heatmap, cell_edges, render_run_plots
from postnorm.workdir.metrics import layer_key, layer_series


@pytest.mark.parametrize("steps", [[1, 10, 20, 30], [5], [1, 2, 50]])
def test_each_step_is_inside_its_own_cell(steps):
    values_LxS = np.arange(3 * len(steps), dtype=float).reshape(3, len(steps))
    values_LxS[1, 0] = np.nan  # a layer missing at one step stays blank
    fig, ax = plt.subplots()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a single step used to warn about singular xlims
        _heatmap(ax, np.array(steps), values_LxS, "t")
    mesh = ax.collections[0]
    x_edges = mesh.get_coordinates()[0, :, 0]
    assert np.all(np.diff(x_edges) > 0)
    for column, step in enumerate(steps):
        assert x_edges[column] < step < x_edges[column + 1]
    np.testing.assert_array_equal(mesh.get_coordinates()[:, 0, 1], [-0.5, 0.5, 1.5, 2.5])
    shown = mesh.get_array().reshape(values_LxS.shape)
    assert shown.mask[1, 0] and shown.mask.sum() == 1
    np.testing.assert_array_equal(shown.filled(-1)[values_LxS == values_LxS],
                                  values_LxS[values_LxS == values_LxS])
    plt.close(fig)


def test_edges_are_midpoints_between_steps():
    np.testing.assert_allclose(cell_edges(np.array([1, 10, 20])), [-3.5, 5.5, 15, 25])
    np.testing.assert_allclose(cell_edges(np.array([7])), [6.5, 7.5])


def test_a_run_without_diagnostics_gets_the_loss_plot_and_a_warning(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "train/loss": 9.0 - s, "train/lfreq": 5.0}) + "\n"
        for s in (1, 2, 3)))
    paths = render_run_plots(str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["loss_vs_lfreq.png"]
    assert "has no per-layer diagnostics (diag.every): no heatmaps" in caplog.text


def test_layer_series_puts_each_layer_and_step_in_its_own_cell():
    """Row k is layer k and column j the j-th diagnostic step, whatever the records' order."""
    records = [{"step": s, layer_key("diag/tsim_attn", k, 12): 100 * k + s}
               for s in (30, 1, 10) for k in range(12)]
    steps, values_LxS = layer_series(records)["tsim_attn"]
    np.testing.assert_array_equal(steps, [1, 10, 30])
    np.testing.assert_array_equal(values_LxS, 100 * np.arange(12)[:, None] + steps[None, :])
