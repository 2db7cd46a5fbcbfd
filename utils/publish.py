"""Atomic publishing of files and directories: the one temp-name convention, fsync, os.replace.

Owns: how every writer of the project makes a file or a directory appear whole or not at all, and
the names of what an interrupted write leaves behind:
  a file      `<path>.tmp` (`<stem>.tmp.npy` for `<stem>.npy`: np.save appends ".npy" to other names;
              `<path>.<pid>.tmp` with unique=True, for a file several processes may write at once),
              written and fsynced, then `os.replace`d onto `<path>`, then the parent directory fsynced;
  a directory `<final>.tmp/` (`temp_dir_for`), filled by the writer, every file and the directory
              fsynced, then `os.replace`d onto `<final>`; replacing an existing `<final>` moves it aside
              to `<final>.old` first, renames, then deletes the old one.
`is_temp_name` tells a leftover temp file by its name (data_preprocess/shard_format.remove_temp_files).

API:
  fsync_file(path), fsync_dir(path)            fsync_dir tolerates filesystems that refuse it
  atomic_path(path, unique=False)              context manager yielding the temp name, for writers
                                               that need a path (safetensors save_file, torch.save,
                                               np.save); publishes when the block ends without error
  atomic_write_bytes / atomic_write_text / atomic_write_json(path, ...)
  temp_path_for(path), is_temp_name(name)      the file convention
  temp_dir_for(final), make_temp_dir(final)    the directory convention (name / fresh empty dir)
  publish_dir(tmp, final, replace=False)       fsync + rename a filled temp dir into place
  staged_dir(final, replace=False)             context manager: make_temp_dir, yield, publish_dir;
                                               the temp dir is removed when the block raises

Crash guarantees: a crash (or an exception) at any instant before the rename leaves the previous
file or directory untouched and readable, and nothing at the final name that is half written; an
exception in the rename itself removes the temp file (files) or puts the old directory back
(replace=True). Replacing a directory takes two renames (POSIX cannot rename onto a non-empty
directory): a kill between them leaves the previous version complete at `<final>.old` and no
`<final>`; the next publish_dir(replace=True) of the same final deletes that leftover.

Must never: import anything but the standard library (every layer, the torch-free supervisor and
CLI pre-checks included, imports this module), write at a final name in place, delete the previous
version of a directory before the new one is in place, or choose a file format (callers pass bytes,
text, or JSON options).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any, Iterator

TMP_SUFFIX = ".tmp"   # files and directories being written
OLD_SUFFIX = ".old"   # a directory moved aside while its replacement is renamed in
_NPY = ".npy"


# ---------------------------------------------------------------------------- fsync

def fsync_file(path: str) -> None:
    """Flush a file's data to disk (open read-only, fsync, close). Raises OSError as os.fsync does."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename into it) to disk. Some filesystems refuse fsync (or open)
    on a directory; the rename is still atomic there, so that is not an error."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


# ---------------------------------------------------------------------------- files

def temp_path_for(path: str, *, unique: bool = False) -> str:
    """The temp name `path` is written under: `<path>.tmp`, or `<stem>.tmp.npy` for `<stem>.npy`;
    unique=True puts this process id before `.tmp` (several processes writing one file)."""
    tag = f".{os.getpid()}{TMP_SUFFIX}" if unique else TMP_SUFFIX
    if path.endswith(_NPY):
        return path[:-len(_NPY)] + tag + _NPY
    return path + tag


def is_temp_name(name: str) -> bool:
    """A file name `temp_path_for` produces (the leftover of an interrupted write)."""
    return name.endswith(TMP_SUFFIX) or name.endswith(TMP_SUFFIX + _NPY)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


@contextlib.contextmanager
def atomic_path(path: str, *, unique: bool = False) -> Iterator[str]:
    """Yield the temp name to write `path` under; when the block ends without error, fsync it,
    os.replace it onto `path` and fsync the directory. On an exception (in the block or the rename)
    the temp file is removed and `path` keeps what it held before.

        with atomic_path(os.path.join(d, "model.safetensors")) as tmp:
            save_file(tensors, tmp)
    """
    tmp = temp_path_for(path, unique=unique)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_dir(_parent(path))


def atomic_write_bytes(path: str, data: bytes | bytearray | memoryview, *, unique: bool = False) -> None:
    """Write `data` to `path` atomically (see atomic_path)."""
    with atomic_path(path, unique=unique) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def atomic_write_text(path: str, text: str, *, unique: bool = False) -> None:
    """Write `text` (UTF-8) to `path` atomically (see atomic_path)."""
    atomic_write_bytes(path, text.encode("utf-8"), unique=unique)


def atomic_write_json(path: str, obj: Any, *, unique: bool = False, newline: bool = True,
                      **dumps_kwargs: Any) -> None:
    """Write `obj` as JSON to `path` atomically. Defaults: indent=2, sort_keys=True,
    ensure_ascii=False and a final newline; any json.dumps keyword overrides them."""
    opts: dict[str, Any] = {"indent": 2, "sort_keys": True, "ensure_ascii": False}
    opts.update(dumps_kwargs)
    atomic_write_text(path, json.dumps(obj, **opts) + ("\n" if newline else ""), unique=unique)


# ---------------------------------------------------------------------------- directories

def temp_dir_for(final_dir: str) -> str:
    """The one temp-directory name for `final_dir`: `<final_dir>.tmp`, beside it (same filesystem)."""
    return final_dir.rstrip("/" + os.sep) + TMP_SUFFIX


def make_temp_dir(final_dir: str) -> str:
    """Create `temp_dir_for(final_dir)` empty (dropping one left by a crash, which was never published;
    parents are created) and return it."""
    tmp = temp_dir_for(final_dir)
    _remove_any(tmp, strict=True)
    os.makedirs(tmp)
    return tmp


def _remove_any(path: str, *, strict: bool = False) -> None:
    """Remove a directory tree, a file or a link at `path` if there is one (errors raise when strict)."""
    if not os.path.lexists(path):
        return
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except OSError:
        if strict:
            raise


def _fsync_tree(root: str) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(dirpath)


def publish_dir(tmp_dir: str, final_dir: str, *, replace: bool = False) -> None:
    """Move a filled temp directory to `final_dir`: fsync every file in it and the directory, then
    os.replace, then fsync the parent. replace=False: `final_dir` must not exist (FileExistsError).
    replace=True: an existing `final_dir` is renamed to `<final_dir>.old`, `tmp_dir` renamed in, then
    the old one deleted; if the second rename fails the old directory is put back."""
    final_dir = final_dir.rstrip("/" + os.sep)
    _fsync_tree(tmp_dir)
    parent = _parent(final_dir)
    if not replace:
        if os.path.lexists(final_dir):
            raise FileExistsError(f"{final_dir} exists (publish_dir(..., replace=True) replaces it)")
        os.replace(tmp_dir, final_dir)
        fsync_dir(parent)
        return
    aside = final_dir + OLD_SUFFIX
    if os.path.lexists(final_dir):
        _remove_any(aside, strict=True)  # left by a crash after an earlier swap: superseded
        os.replace(final_dir, aside)
        try:
            os.replace(tmp_dir, final_dir)
        except BaseException:
            os.replace(aside, final_dir)  # the old version stays in place
            raise
    else:
        os.replace(tmp_dir, final_dir)
    fsync_dir(parent)
    _remove_any(aside)  # the previous version (or one a crash mid-swap left), now superseded


@contextlib.contextmanager
def staged_dir(final_dir: str, *, replace: bool = False) -> Iterator[str]:
    """Yield a fresh `<final_dir>.tmp/` to fill; publish it to `final_dir` (publish_dir) when the block
    ends without error. On any exception the temp directory is removed and `final_dir` is untouched."""
    tmp = make_temp_dir(final_dir)
    try:
        yield tmp
        publish_dir(tmp, final_dir, replace=replace)
    finally:
        _remove_any(tmp)
