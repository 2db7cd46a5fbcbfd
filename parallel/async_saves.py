"""--async_checkpoint for the FSDP2 engine and the pipeline engine (the ddp engine's is utils/async_checkpoint.py's
save_checkpoint_async): what each snapshots on the training thread, and what its background writer writes.

FSDP2 (sharded DCP checkpoints): DCP's save, with its collectives (plans,
results), runs on the training thread into host memory (an in-memory file system under torch's FileSystemWriter,
no fsync); the background writer (utils/async_checkpoint.py) then writes those bytes into step_N.tmp/, fsyncs
them, and rank 0 publishes as save_dcp_checkpoint does (sidecars, every rank's shard checked, dcp_manifest.json,
manifest, COMPLETE, rename), once every rank's marker is there.

The host copy here is DCP's serialized shard (its own bytes per save, dropped once written), not the reused
buffers of the other engines: DCP serializes while the collectives run, so the bytes are what a snapshot is.

Pipeline: the stage's state gathered (collective under FSDP) and copied into the writer's reused host buffers;
the writer writes the stage files, the extra file and (rank 0) the sidecars, and publishes.

Owns: the in-memory storage writer and the FSDP and pipeline engines' background saves. Must never: issue a collective from
the background thread, or publish before every rank's shard is written.
"""
from __future__ import annotations

import io
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter

from parallel.dcp_checkpoint import _MODEL, _group_rank_world, _mesh_group, _state_to_save, publish_dcp_dir
from parallel.fsdp import reshard
from utils.async_checkpoint import AsyncCheckpointer, save_in_background
from utils import checkpoint as ckpt
from utils.checkpoint_layout import TRAINER_STATE, extra_file
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
    group = _mesh_group(model)
    rank, world = _group_rank_world(group)
    reshard(model)
    _, tmp = ckpt.step_dir_paths(ckpt_root, step)
    flat, scalars = _state_to_save(model, optimizer)
    memory = MemoryWriter(tmp)
    dcp.save(flat, storage_writer=memory, process_group=group, no_dist=group is None)  # collectives: here
    files = dict(memory.fs.files)
    model_keys = sum(1 for k in flat if k.startswith(_MODEL))
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


def save_pipeline_async(engine: Any, out_dir: str, step: int, rank: int, world_size: int, model_config: dict,
                        trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
                        barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]],
                        log: Callable[[str], None], writer: AsyncCheckpointer) -> str:
    """PipelineParallelEngine.save with the writing in the background: the stage's state gathered and copied to
    the writer's host buffers here (collective), its files written and published by the writer thread."""
    writer.wait()  # at most one save in flight
    sd, extra, model_config, run_config, trainer_state = writer.snapshot(
        {"stage": engine.state_dict(), "extra": extra_state}, model_config, run_config, trainer_state)
    global_rank = dist.get_rank()

    def write_files(tmp: str, guard: Any) -> None:
        guard.file = tmp
        engine.write_stage_state(tmp, sd, global_rank, copy=False)
        ckpt.write_extra_and_configs(tmp, rank, extra, model_config, run_config, fault_hook, guard)

    def publish(tmp: str, final: str, guard: Any) -> None:
        guard.file = os.path.join(tmp, TRAINER_STATE)
        ckpt.write_json(guard.file, dict(trainer_state, step=step, world_size=world_size, saved_at=time.time()))
        ckpt.publish_checkpoint_dir(tmp, final, step)
    return save_in_background(out_dir, step, rank, world_size, writer, write_files, publish, barrier=barrier,
                              keep_last=keep_last, log=log)
