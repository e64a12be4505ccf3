"""The benchmarks' page-fault count, transparent huge page mode and CPU description."""

import mmap

from benchmarks.programs import cpu_description, minor_page_faults, transparent_hugepage_mode


def test_minor_page_faults_count_first_touches_of_fresh_memory():
    """A private anonymous map, like XLA's temporaries, faults once per page on first touch."""
    size = 8 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    before = minor_page_faults()
    for offset in range(0, size, mmap.PAGESIZE):
        region[offset] = 1
    faults = minor_page_faults() - before
    region.close()
    assert faults >= 1
    if transparent_hugepage_mode() != "always":  # 4 KiB pages
        assert faults >= 0.9 * size / mmap.PAGESIZE


def test_transparent_hugepage_mode_is_the_bracketed_setting(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr("benchmarks.programs.THP_SETTING", setting)
    assert transparent_hugepage_mode() == "madvise"
    monkeypatch.setattr("benchmarks.programs.THP_SETTING", tmp_path / "missing")
    assert transparent_hugepage_mode() is None


CPUINFO_TWO_CORES = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512dq avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512dq avx512_bf16 amx_bf16 amx_tile
"""


def test_cpu_description_names_the_model_and_the_isa_it_has(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO_TWO_CORES)
    monkeypatch.setattr("benchmarks.programs.CPUINFO", cpuinfo)
    cpu = cpu_description()
    assert cpu["model"] == "Intel(R) Xeon(R) Processor"
    assert cpu["isa"] == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert cpu["cores"] >= 1
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: sse2 avx avx2 fma\n")
    assert cpu_description()["isa"] == ["avx2", "fma"]  # no AVX-512 named, none reported
    monkeypatch.setattr("benchmarks.programs.CPUINFO", tmp_path / "missing")
    assert cpu_description()["model"] is None and cpu_description()["isa"] is None
