"""postnorm.files: make_output_dir creates an output directory and proves it writable before any
work; replace_file never leaves a file half written."""

import errno
import tempfile

import pytest

from postnorm import files
from postnorm.errors import UserError
from postnorm.files import OutputDirError, make_output_dir


def test_a_directory_is_created_with_its_parents_and_left_empty(tmp_path):
    path = tmp_path / "a" / "b"
    assert make_output_dir(str(path), "--out_dir") == str(path)
    assert path.is_dir() and list(path.iterdir()) == []  # the probe file is gone
    make_output_dir(str(path), "--out_dir")  # an existing directory is fine


def test_a_path_through_or_at_a_file_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "f").write_text("kept")
    for path, why in ((tmp_path / "f", "File exists"), (tmp_path / "f" / "x", "Not a directory")):
        with pytest.raises(OutputDirError, match=rf"^--out_dir='{path}' cannot be created or "
                                                 rf"written \({why}\); give a directory"):
            make_output_dir(str(path), "--out_dir")
    assert (tmp_path / "f").read_text() == "kept"
    assert issubclass(OutputDirError, UserError)  # entry points print it in one line, exit 2


def test_a_directory_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    """As root, permission bits do not stop writes; the probe's own failure stands in."""
    def refuse(**kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(OutputDirError, match=r"workdir='.*' cannot be created or written "
                                             r"\(Permission denied\)"):
        make_output_dir(str(tmp_path), "workdir")


def test_a_failed_replacement_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """Figures and the report are written by ``replace_file``: a write that fails part way
    (a full disk, here the final rename) leaves the previous file as it was."""
    target = tmp_path / "report.html"
    target.write_bytes(b"the previous report")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        files.replace_file(target, b"a new report that is never seen half written")
    assert target.read_bytes() == b"the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
