"""utils/publish.py: the one atomic-publish protocol (temp names, fsync, os.replace, the aside swap)."""
from __future__ import annotations

import ast
import errno
import json
import os
import sys

import numpy as np
import pytest

import utils.publish as pub
from utils.publish import (atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text, fsync_dir,
                           fsync_file, is_temp_name, make_temp_dir, publish_dir, staged_dir, temp_dir_for,
                           temp_path_for)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _replace_failing_for(monkeypatch, src_pred):
    """os.replace raises (a crash at the rename) when src_pred(src) is true; other renames go through."""
    real = os.replace
    calls = []

    def fake(src, dst, *a, **k):
        calls.append((str(src), str(dst)))
        if src_pred(str(src)):
            raise OSError(errno.EIO, "injected crash at the rename")
        return real(src, dst, *a, **k)
    monkeypatch.setattr(os, "replace", fake)
    return calls


def _tree(d) -> dict:
    return {n: open(os.path.join(d, n), encoding="utf-8").read() for n in sorted(os.listdir(d))}


# ---------------------------------------------------------------------------- names

def test_temp_names_follow_the_one_convention(tmp_path):
    p = str(tmp_path / "a.json")
    assert temp_path_for(p) == p + ".tmp"
    assert temp_path_for(str(tmp_path / "s_00000.idx.npy")) == str(tmp_path / "s_00000.idx.tmp.npy")
    assert temp_path_for(p, unique=True) == f"{p}.{os.getpid()}.tmp"
    assert temp_path_for(str(tmp_path / "x.npy"), unique=True) == str(tmp_path / f"x.{os.getpid()}.tmp.npy")
    for name in ("a.json.tmp", "s.idx.tmp.npy", f"a.json.{os.getpid()}.tmp"):
        assert is_temp_name(name)
    for name in ("a.json", "s.idx.npy", "tmp", "a.tmp.json", "step_00000001"):
        assert not is_temp_name(name)
    d = str(tmp_path / "step_00000005")
    assert temp_dir_for(d) == d + ".tmp" == temp_dir_for(d + "/")
    # the writers that name their temp dir use this one
    from checkpoint import protocol
    assert protocol.temp_dir_for is temp_dir_for


def test_the_module_imports_only_the_standard_library():
    with open(os.path.join(ROOT, "utils", "publish.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module
            mods.add(node.module.split(".")[0])
    assert mods and mods <= set(sys.stdlib_module_names), mods - set(sys.stdlib_module_names)


# ---------------------------------------------------------------------------- files

def test_atomic_write_json_round_trip_and_format(tmp_path):
    p = tmp_path / "state.json"
    obj = {"b": [1, 2.5, None], "a": {"é": "ü"}, "step": 7}
    atomic_write_json(str(p), obj)
    assert json.loads(p.read_text(encoding="utf-8")) == obj
    text = p.read_text(encoding="utf-8")
    assert text == json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    atomic_write_json(str(p), {"z": 1, "a": "é"}, indent=1, ensure_ascii=True, newline=False)
    assert p.read_text() == '{\n "a": "\\u00e9",\n "z": 1\n}'
    assert os.listdir(tmp_path) == ["state.json"]  # no temp file left


def test_text_and_bytes_replace_the_old_content(tmp_path):
    p = str(tmp_path / "f.bin")
    atomic_write_bytes(p, b"old")
    atomic_write_bytes(p, memoryview(np.arange(4, dtype="<u2")).cast("B"))
    assert np.fromfile(p, dtype="<u2").tolist() == [0, 1, 2, 3]
    atomic_write_text(p, "naïve\n")
    assert open(p, "rb").read() == "naïve\n".encode("utf-8")
    assert os.listdir(tmp_path) == ["f.bin"]


@pytest.mark.parametrize("writer", ["bytes", "text", "json", "path"])
def test_a_crash_at_the_rename_leaves_the_old_file_and_no_half_file(tmp_path, monkeypatch, writer):
    p = str(tmp_path / "summary.json")
    atomic_write_json(p, {"version": "old"})
    before = open(p, "rb").read()
    calls = _replace_failing_for(monkeypatch, lambda src: src.endswith(".tmp"))
    with pytest.raises(OSError, match="injected crash"):
        if writer == "bytes":
            atomic_write_bytes(p, b'{"version": "new"}')
        elif writer == "text":
            atomic_write_text(p, '{"version": "new"}')
        elif writer == "json":
            atomic_write_json(p, {"version": "new"})
        else:
            with atomic_path(p) as tmp:
                with open(tmp, "w") as f:
                    f.write('{"version": "new"}')
    assert calls == [(p + ".tmp", p)]  # the new content was complete under the temp name only
    assert open(p, "rb").read() == before
    assert json.load(open(p)) == {"version": "old"}
    assert os.listdir(tmp_path) == ["summary.json"]  # the temp file is cleaned up


def test_an_exception_while_writing_leaves_the_old_file(tmp_path):
    p = str(tmp_path / "adapter_model.safetensors")
    atomic_write_bytes(p, b"old weights")
    with pytest.raises(RuntimeError, match="writer died"):
        with atomic_path(p) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise RuntimeError("writer died")
    assert open(p, "rb").read() == b"old weights"
    assert os.listdir(tmp_path) == ["adapter_model.safetensors"]


def test_atomic_path_for_np_save_keeps_the_npy_suffix(tmp_path):
    p = str(tmp_path / "s_00000.idx.npy")
    arr = np.arange(10, dtype=np.int64)
    with atomic_path(p) as tmp:
        assert tmp.endswith(".tmp.npy")
        np.save(tmp, arr)  # np.save would append ".npy" to a name without it
    assert np.load(p).tolist() == arr.tolist()
    assert os.listdir(tmp_path) == ["s_00000.idx.npy"]


def test_leftovers_of_a_killed_write_are_what_shard_cleanup_removes(tmp_path):
    from data_preprocess.shard_format import atomic_save_npy, atomic_write_json as shard_json, remove_temp_files
    shard_json(str(tmp_path / "s_00000.json"), {"x": 1})
    atomic_save_npy(str(tmp_path / "s_00000.idx.npy"), np.zeros(3, dtype=np.int64))
    # a kill after the temp file was written, before the rename: the temp names stay behind
    for final in ("s_00001.bin", "s_00001.idx.npy", "s_00001.json"):
        open(temp_path_for(str(tmp_path / final)), "wb").write(b"junk")
    os.makedirs(tmp_path / "step_00000001.tmp")  # a directory is not a leftover file
    assert remove_temp_files(str(tmp_path)) == 3
    assert sorted(os.listdir(tmp_path)) == ["s_00000.idx.npy", "s_00000.json", "step_00000001.tmp"]
    # the sidecar format is unchanged: indent 1, sorted keys, ASCII, final newline
    assert (tmp_path / "s_00000.json").read_text() == '{\n "x": 1\n}\n'


def test_fsync_dir_tolerates_a_filesystem_that_refuses_it(tmp_path, monkeypatch):
    p = str(tmp_path / "f")
    open(p, "w").write("x")
    fsync_file(p)
    fsync_dir(str(tmp_path))
    fsync_dir(str(tmp_path / "missing"))  # cannot even be opened: still no error

    def refuse(fd):
        raise OSError(errno.EINVAL, "fsync refused")
    monkeypatch.setattr(os, "fsync", refuse)
    fsync_dir(str(tmp_path))
    with pytest.raises(OSError):
        fsync_file(p)  # a file that cannot be flushed is an error


# ---------------------------------------------------------------------------- directories

def _fill(d, **files):
    for name, text in files.items():
        with open(os.path.join(d, name), "w", encoding="utf-8") as f:
            f.write(text)


def test_publish_dir_new_and_refusing_to_overwrite(tmp_path):
    final = str(tmp_path / "out" / "tok")
    tmp = make_temp_dir(final)  # parents are created
    assert tmp == final + ".tmp" and os.listdir(tmp) == []
    _fill(tmp, a="1")
    publish_dir(tmp, final)
    assert _tree(final) == {"a": "1"} and not os.path.exists(tmp)
    tmp = make_temp_dir(final)
    _fill(tmp, a="2")
    with pytest.raises(FileExistsError, match="replace=True"):
        publish_dir(tmp, final)
    assert _tree(final) == {"a": "1"} and _tree(tmp) == {"a": "2"}


def test_make_temp_dir_drops_a_leftover(tmp_path):
    final = str(tmp_path / "step_00000003")
    os.makedirs(final + ".tmp")
    _fill(final + ".tmp", half="written by a crashed save")
    assert os.listdir(make_temp_dir(final)) == []


def test_publish_dir_replace_swaps_and_deletes_the_old(tmp_path):
    final = str(tmp_path / "hf")
    with staged_dir(final, replace=True) as tmp:
        _fill(tmp, config="v1", weights="w1")
    with staged_dir(final, replace=True) as tmp:
        _fill(tmp, config="v2")
    assert _tree(final) == {"config": "v2"}
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no .tmp, no .old


def test_replace_keeps_the_old_dir_when_the_swap_fails(tmp_path, monkeypatch):
    final = str(tmp_path / "tokenizer")
    with staged_dir(final) as tmp:
        _fill(tmp, **{"tokenizer.json": "old"})
    calls = _replace_failing_for(monkeypatch, lambda src: src == final + ".tmp")
    with pytest.raises(OSError, match="injected crash"):
        with staged_dir(final, replace=True) as tmp:
            _fill(tmp, **{"tokenizer.json": "new"})
    # moved aside, the rename in failed, put back
    assert calls == [(final, final + ".old"), (final + ".tmp", final), (final + ".old", final)]
    assert _tree(final) == {"tokenizer.json": "old"}
    assert sorted(os.listdir(tmp_path)) == ["tokenizer"]


def test_a_crash_before_the_rename_leaves_the_old_dir(tmp_path, monkeypatch):
    final = str(tmp_path / "export")
    with staged_dir(final) as tmp:
        _fill(tmp, a="old")
    with pytest.raises(RuntimeError, match="died"):
        with staged_dir(final, replace=True) as tmp:
            _fill(tmp, a="half")
            raise RuntimeError("writer died")
    assert _tree(final) == {"a": "old"} and sorted(os.listdir(tmp_path)) == ["export"]
    # the first rename (moving the old one aside) failing: nothing moved at all
    calls = _replace_failing_for(monkeypatch, lambda src: src == final)
    with pytest.raises(OSError, match="injected crash"):
        with staged_dir(final, replace=True) as tmp:
            _fill(tmp, a="new")
    assert calls == [(final, final + ".old")]
    assert _tree(final) == {"a": "old"} and sorted(os.listdir(tmp_path)) == ["export"]


def test_a_kill_between_the_two_renames_leaves_the_old_dir_whole_aside(tmp_path):
    """The state a kill mid-swap leaves (old at <final>.old, no <final>): the old version is complete
    there, and the next replace publishes and removes it; a stale .old beside a final is dropped too."""
    final = str(tmp_path / "step_00000004")
    os.makedirs(final + ".old")
    _fill(final + ".old", a="previous")
    assert _tree(final + ".old") == {"a": "previous"}
    with staged_dir(final, replace=True) as tmp:
        _fill(tmp, a="next")
    assert _tree(final) == {"a": "next"} and sorted(os.listdir(tmp_path)) == ["step_00000004"]
    os.makedirs(final + ".old")
    _fill(final + ".old", a="stale")
    with staged_dir(final, replace=True) as tmp:
        _fill(tmp, a="third")
    assert _tree(final) == {"a": "third"} and sorted(os.listdir(tmp_path)) == ["step_00000004"]


def test_publish_dir_fsyncs_every_file_and_the_dirs(tmp_path, monkeypatch):
    final = str(tmp_path / "d")
    tmp = make_temp_dir(final)
    os.makedirs(os.path.join(tmp, "sub"))
    _fill(tmp, a="1")
    _fill(os.path.join(tmp, "sub"), b="2")
    seen = []
    real_file, real_dir = pub.fsync_file, pub.fsync_dir
    monkeypatch.setattr(pub, "fsync_file", lambda p: (seen.append(("f", os.path.relpath(p, tmp))), real_file(p)))
    monkeypatch.setattr(pub, "fsync_dir", lambda p: (seen.append(("d", p)), real_dir(p)))
    publish_dir(tmp, final)
    assert {("f", "a"), ("f", os.path.join("sub", "b")), ("d", tmp), ("d", os.path.join(tmp, "sub")),
            ("d", str(tmp_path))} <= set(seen)
    # the parent is synced after the rename, the temp dir before it
    assert seen.index(("d", str(tmp_path))) > seen.index(("d", tmp))


# ---------------------------------------------------------------------------- a checkpoint on top of it

def test_publish_checkpoint_dir_resave_and_failed_swap(tmp_path, monkeypatch):
    from checkpoint.protocol import publish_checkpoint_dir
    from utils.checkpoint_layout import COMPLETE_MARKER, step_dir_name
    from utils.run_dir import listed_checkpoints
    root = tmp_path / "checkpoints"
    final = str(root / step_dir_name(3))

    def write(text):
        tmp = make_temp_dir(final)
        _fill(tmp, **{"trainer_state.json": json.dumps({"step": 3, "v": text})})
        publish_checkpoint_dir(tmp, final, 3)

    write("first")
    assert json.load(open(os.path.join(final, COMPLETE_MARKER))) == {"step": 3}
    manifest = json.load(open(os.path.join(final, "manifest.json")))
    assert set(manifest) == {"trainer_state.json"}
    write("second")  # re-saving a step swaps the old directory aside, then deletes it
    assert json.load(open(os.path.join(final, "trainer_state.json")))["v"] == "second"
    assert sorted(os.listdir(root)) == ["step_00000003"]
    _replace_failing_for(monkeypatch, lambda src: src == final + ".tmp")
    with pytest.raises(OSError, match="injected crash"):
        write("third")
    assert json.load(open(os.path.join(final, "trainer_state.json")))["v"] == "second"
    assert os.path.exists(os.path.join(final, COMPLETE_MARKER))
    assert sorted(os.listdir(root)) == ["step_00000003", "step_00000003.tmp"]  # the tmp is never loaded
    assert [p for _, p in listed_checkpoints(str(tmp_path))] == [final]
