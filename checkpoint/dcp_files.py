"""The files of a torch.distributed.checkpoint (DCP) directory, read without a process group.

Owns: the restricted reader of DCP's pickled `.metadata` (an allow-list of DCP metadata classes,
`torch.Size`, dtypes/layouts and paths; any other global is refused, so a crafted file cannot call
code), the confinement of every data file it names to the checkpoint directory, the naming of a data
file that does not load, and the layout check that a directory holds what every rank of a save wrote
(`.metadata`, each data file it names inside the directory and long enough, a shard of every rank).
Checkpoint verification (checkpoint/verify.py) applies it to any directory, importing it only when a directory
is sharded; the sharded save and load live in checkpoint/dcp.py.

Must never: unpickle with plain `pickle.load`, or open a path that .metadata names outside the
checkpoint directory (the reader itself refuses such a .metadata, whoever calls it, verified or not).
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from utils.checkpoint_layout import plain_file_name
from utils.errors import CheckpointError, one_line
from utils.checkpoint_layout import DCP_MANIFEST, DCP_METADATA, dcp_shard_prefix, extra_file, is_extra_file


class DCPCheckpointError(CheckpointError):
    """A DCP checkpoint that cannot be loaded (damaged, incomplete, unsafe); the message names the file."""


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


def storage_path_problem(md: Metadata) -> Optional[str]:
    """None when every data file `md` points at is a plain file name (inside the directory), else why."""
    storage = getattr(md, "storage_data", None)
    if storage is None:
        return None
    if not isinstance(storage, dict):
        return f"its storage_data is a {type(storage).__name__}, not a mapping"
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not plain_file_name(rel):
            return f"it points at {str(rel)!r}, outside the checkpoint directory"
    return None


def _first_line(e: BaseException) -> str:
    """The informative line of torch.load's long messages (the unsupported opcode or global, or the first)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if "Unsupported" in line or "failed reading" in line:
            return line[:200]
    return (lines[0] if lines else type(e).__name__)[:200]


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader, except that `.metadata` is unpickled with an allow-list and may name
    only data files inside the directory and tensors (no pickled item), and that a data file which
    does not load as .metadata describes raises DCPCheckpointError naming that file."""

    _reading: Optional[str] = None  # the data file being read (named when loading it fails)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
        if not isinstance(md, Metadata):
            raise DCPCheckpointError(f"{path} does not hold DCP metadata")
        problem = storage_path_problem(md)
        if problem is not None:
            raise DCPCheckpointError(f"{path}: {problem}: refusing to read it")
        items = md.state_dict_metadata if isinstance(md.state_dict_metadata, dict) else {}
        pickled = sorted(str(k) for k, v in items.items() if isinstance(v, BytesStorageMetadata))
        if pickled:
            raise DCPCheckpointError(f"{path}: stores non-tensor items ({', '.join(pickled[:5])}) that DCP would "
                                     "unpickle; this loader accepts tensor-only checkpoints")
        from torch.distributed.checkpoint.metadata import StorageMeta
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _slice_file(self, file: Any, sinfo: Any) -> Any:  # torch calls it for each item before reading it
        self._reading = str(getattr(sinfo, "relative_path", "")) or None
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Any:
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError,
                AttributeError, AssertionError, OSError) as e:
            if isinstance(e, (torch.OutOfMemoryError, CheckpointError)):
                raise
            where = os.path.join(str(self.path), self._reading) if self._reading else \
                os.path.join(str(self.path), DCP_METADATA)
            raise DCPCheckpointError(f"{where}: does not load as the tensors .metadata describes (damaged?): "
                                     f"{type(e).__name__}: {_first_line(e)}") from e


def read_dcp_metadata(ckpt_dir: str) -> Metadata:
    """DCP metadata of a checkpoint through the restricted reader (data files confined to the
    directory, tensor items only); DCPCheckpointError naming `.metadata` when it cannot be read."""
    path = os.path.join(ckpt_dir, DCP_METADATA)
    try:
        return SafeFileSystemReader(ckpt_dir).read_metadata()
    except DCPCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RecursionError, ImportError, MemoryError) as e:
        raise DCPCheckpointError(f"{path}: unreadable ({type(e).__name__}: {one_line(e)[:200]})") from e


def dcp_layout_problem(ckpt_dir: str, world: int, with_extras: bool = False) -> Optional[str]:
    """None if `ckpt_dir` holds what `world` ranks saving together write, else the reason: DCP's
    `.metadata` (readable by the restricted reader), every data file it names present, inside the
    directory and long enough for the bytes it points at, a `__<r>_*.distcp` file of every rank r,
    and (with_extras) every rank's `extra_rank<r>.pt`."""
    if not os.path.isfile(os.path.join(ckpt_dir, DCP_METADATA)):
        return f"no {DCP_METADATA} (DCP's index of the shards)"
    try:
        md = read_dcp_metadata(ckpt_dir)
    except DCPCheckpointError as e:
        return one_line(e).replace(os.path.join(ckpt_dir, ""), "", 1)[:300]
    sizes: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if rel not in sizes:
            fp = os.path.join(ckpt_dir, rel)
            if not os.path.isfile(fp):
                return f"missing shard file {rel}"
            sizes[rel] = os.path.getsize(fp)
        offset, length = getattr(info, "offset", 0), getattr(info, "length", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            return f"{DCP_METADATA}: a piece of {rel} has offset {offset!r} and length {length!r}"
        if offset + length > sizes[rel]:
            return f"shard file {rel} has {sizes[rel]} bytes, {DCP_METADATA} needs {offset + length} (truncated?)"
    for r in range(world):
        if not any(n.startswith(dcp_shard_prefix(r)) for n in sizes):
            return f"no shard of rank {r} of {world}"
        if with_extras and not os.path.isfile(os.path.join(ckpt_dir, extra_file(r))):
            return f"missing {extra_file(r)}"
    return None


def dcp_dir_problem(ckpt_dir: str) -> Optional[str]:
    """dcp_layout_problem for the world size recorded in the directory's dcp_manifest.json; the
    per-rank extra files are required when the manifest lists any."""
    try:
        with open(os.path.join(ckpt_dir, DCP_MANIFEST), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return f"{DCP_MANIFEST} is unreadable ({type(e).__name__}: {one_line(e)[:160]})"
    if not isinstance(meta, dict):
        return f"{DCP_MANIFEST} holds a {type(meta).__name__}, not a JSON object"
    world, files, opt = meta.get("world_size"), meta.get("files") or {}, meta.get("optimizer")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return f"{DCP_MANIFEST}: world_size={world!r} is not an integer >= 1"
    if not isinstance(files, dict):
        return f"{DCP_MANIFEST}: files is a {type(files).__name__}, not a JSON object"
    if opt is not None and not isinstance(opt, dict):
        return f"{DCP_MANIFEST}: optimizer is a {type(opt).__name__}, not a JSON object (or null)"
    extras = any(is_extra_file(n) for n in files)
    return dcp_layout_problem(ckpt_dir, world, with_extras=extras)
