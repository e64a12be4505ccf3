"""The tables of docs/PERFORMANCE.md: results/perf/tables/*.md, written by
``python -m benchmarks.perf_tables`` from the committed benchmark JSON."""

import fnmatch
import json
import re

import pytest

from benchmarks.perf_tables import TABLES, write_tables
from tests.committed import assert_text_matches
from tests.reliability_helpers import REPO

PERF = REPO / "results" / "perf"
COMMITTED = PERF / "tables"
DOC = REPO / "docs" / "PERFORMANCE.md"


def committed_rows(name: str) -> dict[str, list[str]]:
    """A committed table's cells by row label."""
    lines = (COMMITTED / f"{name}.md").read_text().splitlines()[2:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return {row[0]: row[1:] for row in rows}


def load(name: str) -> dict:
    return json.loads((PERF / name).read_text())


def assert_printed(text: str, value: float) -> None:
    """``text`` is ``value`` rounded to the digits it shows."""
    unit = 10.0 ** -len(text.partition(".")[2])
    assert abs(float(text) - value) <= unit / 2 * (1 + 1e-6), (text, value)


def test_the_committed_tables_are_the_json_rendered_again(tmp_path):
    texts = write_tables(str(tmp_path))
    assert sorted(p.stem for p in COMMITTED.glob("*.md")) == sorted(texts)
    for name, text in texts.items():
        assert (tmp_path / f"{name}.md").read_text() == text
        assert_text_matches(text, (COMMITTED / f"{name}.md").read_text())


def test_the_page_includes_every_table_verbatim_and_names_its_json():
    doc = DOC.read_text()
    for path in COMMITTED.glob("*.md"):
        assert path.read_text() in doc, path.name
    cited = re.findall(r"perf/([\w*.]+\.json)", doc)
    for table in TABLES:
        for file in table.files:
            assert (PERF / file).is_file(), file
            assert any(fnmatch.fnmatch(file, pattern) for pattern in cited), (table.name, file)


@pytest.mark.parametrize("cores,file", [
    ("one core", "intel_cpu_kernel_default_variants_1core.json"),
    ("both cores", "intel_cpu_kernel_default_variants.json")])
def test_intel_default_ratios_and_mfu_from_the_raw_records(cores, file):
    """`blocked`'s time over `cpu`'s per program, and MFU = model FLOPs / time / peak, from the
    bench record's medians."""
    rows = committed_rows("intel_default")
    bench = load(file)
    programs = {kernel: bench["variants"][f"model.attention={kernel}"]["programs"]
                for kernel in ("cpu", "blocked")}
    for column, program in ((0, "train"), (2, "diag"), (3, "forward")):
        ratio = programs["blocked"][program]["median_s"] / programs["cpu"][program]["median_s"]
        seconds, shown = re.fullmatch(r"([\d.]+) s \(([\d.]+)×\)",
                                      rows[f"{cores}, `blocked`"][column]).groups()
        assert_printed(shown, ratio)
        assert_printed(seconds, programs["blocked"][program]["median_s"])
    peak_gflop_s = bench["peak"]["gflop_s"]
    for kernel in ("cpu", "blocked"):
        train = programs[kernel]["train"]
        mfu, peak = re.fullmatch(r"([\d.]+)% of ([\d.]+)", rows[f"{cores}, `{kernel}`"][1]).groups()
        assert_printed(peak, peak_gflop_s)
        assert_printed(mfu, 100 * train["model_gflop"] / train["median_s"] / peak_gflop_s)


def test_intel_settings_ratios_are_medians_over_the_first_variants():
    rows = committed_rows("intel_settings")
    for column, file in enumerate(("intel_default_variants_1core.json",
                                   "intel_default_variants.json")):
        variants = load(file)["variants"]
        first = variants["model.attention_block=32"]["programs"]["train"]["median_s"]
        for label, name in (("64-row blocks", "model.attention_block=64"),
                            ("`xla`", "model.attention=xla"), ("remat `none`", "model.remat=none")):
            assert_printed(rows[label][column],
                           variants[name]["programs"]["train"]["median_s"] / first)


def test_amd_diagnostic_overhead_from_the_step_medians_and_memory():
    rows = committed_rows("amd_diag_overhead")
    unrolled = load("diag_overhead_unrolled.json")
    for label, record in (("region analysis", load("diag_overhead_region_analysis.json")),
                          ("XLA's defaults, remat `full`, scanned", unrolled["full_scanned"]),
                          ("XLA's defaults, remat `none`, unrolled", unrolled["none_unrolled"])):
        steps, memory = record["median_step_s"], record["memory"]
        assert_printed(rows[label][0], steps["diag"] / steps["train"])
        assert_printed(rows[label][1], memory["diag"]["peak_estimate_bytes"]
                       / memory["train"]["peak_estimate_bytes"])
        assert_printed(rows[label][2], steps["train_again"] / steps["train"])


def test_intel_torch_ratios_from_the_two_frameworks_medians():
    rows = committed_rows("intel_torch")
    for label, name in (("one core, eager", "eager_1core"), ("both cores, `torch.compile`",
                                                             "compiled")):
        for column, prefix in ((2, "intel_cpu_kernel_torch_"), (3, "intel_torch_reference_")):
            record = load(f"{prefix}{name}.json")
            assert_printed(rows[label][column],
                           record["torch"]["median_s"] / record["jax"]["median_s"])
