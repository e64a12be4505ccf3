"""The benchmarks' page-fault count and transparent huge page mode."""

import mmap

from benchmarks.programs import minor_page_faults, transparent_hugepage_mode


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
