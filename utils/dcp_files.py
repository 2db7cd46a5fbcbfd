"""The files of a torch.distributed.checkpoint (DCP) directory, read without a process group.

Owns: the restricted reader of DCP's pickled `.metadata` (an allow-list of DCP metadata classes,
`torch.Size`, dtypes/layouts and paths; any other global is refused, so a crafted file cannot call
code) and the layout check that a directory holds what every rank of a save wrote (`.metadata`,
each data file it names inside the directory and long enough, a shard of every rank). It sits in
utils so that checkpoint verification (utils/checkpoint.py) can apply it to any directory without
reaching up into parallel/; the sharded save and load live in parallel/dcp_checkpoint.py.

Must never: unpickle with plain `pickle.load`, or open a path that .metadata names outside the
checkpoint directory.
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata


class DCPCheckpointError(RuntimeError):
    pass


# ---------------------------------------------------------------------------- restricted metadata reader

_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"),
} | {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
    "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not on the allow-list of "
                                     "checkpoint metadata types: refusing to load it")


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader, except that `.metadata` is unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
        if not isinstance(md, Metadata):
            raise DCPCheckpointError(f"{path} does not hold DCP metadata")
        from torch.distributed.checkpoint.metadata import StorageMeta
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def read_dcp_metadata(ckpt_dir: str) -> Metadata:
    """DCP metadata of a checkpoint through the restricted unpickler; refuses non-tensor items."""
    md = SafeFileSystemReader(ckpt_dir).read_metadata()
    pickled = [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    if pickled:
        raise DCPCheckpointError(f"{ckpt_dir} stores non-tensor items ({', '.join(sorted(pickled)[:5])}) that DCP "
                                 "would unpickle; this loader accepts tensor-only checkpoints")
    return md


def dcp_layout_problem(ckpt_dir: str, world: int, with_extras: bool = False) -> Optional[str]:
    """None if `ckpt_dir` holds what `world` ranks saving together write, else the reason: DCP's
    `.metadata` (readable by the restricted reader), every data file it names present, inside the
    directory and long enough for the bytes it points at, a `__<r>_*.distcp` file of every rank r,
    and (with_extras) every rank's `extra_rank<r>.pt`."""
    if not os.path.isfile(os.path.join(ckpt_dir, ".metadata")):
        return "no .metadata (DCP's index of the shards)"
    try:
        md = read_dcp_metadata(ckpt_dir)
    except (DCPCheckpointError, pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError,
            AttributeError, IndexError, KeyError) as e:
        return f".metadata is unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    sizes: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.basename(rel) != rel or rel in (".", ".."):
            return f".metadata points at {rel!r}, outside the checkpoint directory"
        if rel not in sizes:
            fp = os.path.join(ckpt_dir, rel)
            if not os.path.isfile(fp):
                return f"missing shard file {rel}"
            sizes[rel] = os.path.getsize(fp)
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        if end > sizes[rel]:
            return f"shard file {rel} has {sizes[rel]} bytes, .metadata needs {end} (truncated?)"
    for r in range(world):
        if not any(n.startswith(f"__{r}_") for n in sizes):
            return f"no shard of rank {r} of {world}"
        if with_extras and not os.path.isfile(os.path.join(ckpt_dir, f"extra_rank{r}.pt")):
            return f"missing extra_rank{r}.pt"
    return None


def dcp_dir_problem(ckpt_dir: str) -> Optional[str]:
    """dcp_layout_problem for the world size recorded in the directory's dcp_manifest.json; the
    per-rank extra files are required when the manifest lists any."""
    try:
        with open(os.path.join(ckpt_dir, "dcp_manifest.json")) as f:
            meta = json.load(f)
        world = int(meta["world_size"])
        files = meta.get("files") or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"dcp_manifest.json is unreadable or records no world size ({type(e).__name__})"
    if world < 1:
        return f"dcp_manifest.json records world size {world}"
    extras = isinstance(files, dict) and any(str(n).startswith("extra_rank") for n in files)
    return dcp_layout_problem(ckpt_dir, world, with_extras=extras)
