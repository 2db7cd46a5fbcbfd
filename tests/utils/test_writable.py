"""utils/writable.py: the one up-front check of an output directory. Deterministic as root too: a path under a
regular file cannot be created by anyone, and a read-only place is simulated by making the probe fail."""
from __future__ import annotations

import errno
import os

import pytest

from utils import writable
from utils.constants import EXIT_BAD_CONFIG, EXIT_DISK_FULL
from utils.disk_space import DiskFullError
from utils.errors import exit_code_for


def read_only(monkeypatch, *dirs) -> None:
    """The probe fails in `dirs` as on a read-only directory or filesystem (root ignores permission bits)."""
    real = writable._probe
    places = {os.path.abspath(str(d)) for d in dirs}

    def probe(directory):
        if os.path.abspath(directory) in places:
            raise PermissionError(errno.EACCES, "Permission denied", directory)
        real(directory)
    monkeypatch.setattr(writable, "_probe", probe)


def test_a_writable_place_passes_and_nothing_is_left_or_created(tmp_path):
    writable.check_writable_dir(str(tmp_path))
    writable.check_writable_dir(str(tmp_path / "a" / "b"), staged=True)
    assert os.listdir(tmp_path) == []  # neither the directory nor a probe


@pytest.mark.parametrize("kind, why", [
    ("under_file", "cannot create {out}: {blocker} is a file, not a directory"),
    ("file", "{out} is a file, not a directory"),
])
def test_a_path_a_file_is_in_the_way_of_is_exit_2(tmp_path, kind, why):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker / "run" if kind == "under_file" else blocker
    with pytest.raises(writable.UnwritableDirError) as e:
        writable.check_writable_dir(str(out), "--out_dir")
    code, line = exit_code_for(e.value)
    assert code == EXIT_BAD_CONFIG
    assert line == f"bad configuration: --out_dir={out}: " + why.format(out=out, blocker=blocker)


def test_a_read_only_place_is_exit_2_naming_it(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    with pytest.raises(writable.UnwritableDirError, match=rf"--out_dir={ro}/new: cannot write in {ro} \(to create "
                                                           rf"{ro}/new\): Permission denied"):
        writable.check_writable_dir(str(ro / "new"))
    with pytest.raises(writable.UnwritableDirError, match=rf"^{ro}: cannot write in {ro}: Permission denied$"):
        writable.check_writable_dir(str(ro), "")


def test_staged_also_needs_the_parent(tmp_path, monkeypatch):
    """A directory published by renaming `<path>.tmp/` into place: the parent must take the temp directory."""
    (tmp_path / "out").mkdir()
    read_only(monkeypatch, tmp_path)
    writable.check_writable_dir(str(tmp_path / "out"))
    with pytest.raises(writable.UnwritableDirError, match=f"cannot write in {tmp_path}: Permission denied"):
        writable.check_writable_dir(str(tmp_path / "out"), staged=True)


def test_a_probe_that_does_not_fit_is_a_full_disk(tmp_path, monkeypatch):
    def full(directory):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(writable, "_probe", full)
    with pytest.raises(DiskFullError) as e:
        writable.check_writable_dir(str(tmp_path))
    assert exit_code_for(e.value)[0] == EXIT_DISK_FULL
