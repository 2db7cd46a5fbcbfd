"""--async_checkpoint for the sharded (DCP) format: DCP's save, with its collectives (plans, results), runs on the
training thread into host memory (an in-memory file system under torch's FileSystemWriter, no fsync); the
background writer (checkpoint/async_writer.py) then writes those bytes into step_N.tmp/, fsyncs
them, and rank 0 publishes as save_dcp_checkpoint does (sidecars, every rank's shard checked, dcp_manifest.json,
manifest, COMPLETE, rename), once every rank's marker is there.

The host copy here is DCP's serialized shard (its own bytes per save, dropped once written), not the reused
buffers of the other engines: DCP serializes while the collectives run, so the bytes are what a snapshot is.

Owns: the in-memory storage writer and the sharded format's background saves. Must never: issue a collective
from the background thread, or publish before every rank's shard is written.
"""
from __future__ import annotations

import io
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter

from checkpoint.async_writer import AsyncCheckpointer, save_in_background
from checkpoint.dcp import (MODEL_PREFIX, dtensor_json_files, group_rank_world, mesh_group, publish_dcp_dir,
                            state_to_save)
from checkpoint.protocol import SaveJob, step_dir_paths
from parallel.fsdp import reshard
from utils.checkpoint_layout import checkpoint_root, extra_file
from utils.publish import fsync_file


class _Stream(io.BytesIO):
    """A file of the in-memory file system: its bytes are kept when the writer closes it."""

    def __init__(self, files: dict, path: str) -> None:
        super().__init__()
        self._files, self._path = files, path

    def close(self) -> None:
        if not self.closed:
            self._files[self._path] = self.getvalue()
        super().close()


class MemoryFileSystem(FileSystemBase):
    """What torch's FileSystemWriter needs of a file system, in a dict {path: bytes}."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    @contextmanager
    def create_stream(self, path: "str | os.PathLike", mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            raise ValueError(f"MemoryFileSystem is write-only (mode {mode!r})")
        stream = _Stream(self.files, str(path))
        try:
            yield stream
        finally:
            stream.close()

    def concat_path(self, path: "str | os.PathLike", suffix: str) -> "str | os.PathLike":
        return Path(path) / suffix

    def init_path(self, path: "str | os.PathLike") -> "str | os.PathLike":
        return Path(path)

    def rename(self, path: "str | os.PathLike", new_path: "str | os.PathLike") -> None:
        self.files[str(new_path)] = self.files.pop(str(path))

    def mkdir(self, path: "str | os.PathLike") -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike") -> bool:
        return True

    def exists(self, path: "str | os.PathLike") -> bool:
        return str(path) in self.files

    def rm_file(self, path: "str | os.PathLike") -> None:
        del self.files[str(path)]

    def ls(self, path: "str | os.PathLike") -> list[str]:
        return [p for p in self.files if os.path.dirname(p) == str(path)]


class MemoryWriter(FileSystemWriter):
    """torch's FileSystemWriter (the same files, names and bytes) into a MemoryFileSystem."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=False)
        self.fs = MemoryFileSystem()
        self.path = self.fs.init_path(path)


def save_dcp_checkpoint_async(out_dir: str, ckpt_root: str, step: int, model: nn.Module, optimizer: Any, *,
                              json_files: dict[str, Any], rank_state: dict, writer: AsyncCheckpointer,
                              keep_last: int, fault_hook: Optional[Callable[[], None]] = None,
                              log: Callable[[str], None] = print) -> str:
    """save_dcp_checkpoint with the writing in the background; collective on the training thread (every rank of
    the model's mesh). Returns where the checkpoint will appear."""
    writer.wait()  # at most one save in flight
    group = mesh_group(model)
    rank, world = group_rank_world(group)
    reshard(model)
    _, tmp = step_dir_paths(ckpt_root, step)
    flat, scalars = state_to_save(model, optimizer)
    memory = MemoryWriter(tmp)
    dcp.save(flat, storage_writer=memory, process_group=group, no_dist=group is None)  # collectives: here
    files = dict(memory.fs.files)
    model_keys = sum(1 for k in flat if k.startswith(MODEL_PREFIX))
    del flat, memory
    extra, json_files, scalars = writer.snapshot({"extra": rank_state}, json_files, scalars)

    def write_files(tmp_dir: str, guard: Any) -> None:
        for path, data in files.items():
            guard.file = os.path.join(tmp_dir, os.path.relpath(path, tmp))
            with open(guard.file, "wb") as f:
                f.write(data)
            fsync_file(guard.file)
        files.clear()  # the serialized shard is on disk: its host memory goes
        path = guard.file = os.path.join(tmp_dir, extra_file(rank))
        torch.save(extra, path)
        fsync_file(path)
        if rank == 0 and fault_hook is not None:
            fault_hook()

    def publish(tmp_dir: str, final: str, guard: Any) -> None:
        publish_dcp_dir(tmp_dir, final, step, world, json_files, scalars, model_keys, True, guard)
    barrier = (lambda: dist.barrier(group=group)) if group is not None else None
    return save_in_background(out_dir, step, rank, world, writer, write_files, publish, barrier=barrier,
                              keep_last=keep_last, log=log)


def save_dtensor_async(engine: Any, job: SaveJob, writer: AsyncCheckpointer) -> str:
    """checkpoint/dcp.py's save_dtensor with the files written in the background."""
    spec = engine.state_spec()
    return save_dcp_checkpoint_async(job.out_dir, checkpoint_root(job.out_dir), job.step, spec.model, spec.optimizer,
                                     json_files=dtensor_json_files(job), rank_state=job.extra_state, writer=writer,
                                     keep_last=job.keep_last, fault_hook=job.fault_hook, log=job.log)
