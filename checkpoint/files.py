"""Reading a checkpoint's tensor files, each checked where it is read: model.safetensors (no NaN or inf),
`.pt` files of plain tensors (torch.load weights_only=True, never an unpickled object), a rank's
optimizer_rank{r}.pt / extra_rank{r}.pt; and the run directory's record of how the run started.

Owns: the one-line CheckpointError naming a file that does not load. Must never: unpickle arbitrary objects,
or write into a checkpoint directory (the formats' writers and checkpoint/protocol.py do).
"""
from __future__ import annotations

import os
import pickle
from typing import Iterable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from utils.checkpoint_json import read_json, write_json
from utils.checkpoint_layout import MODEL_FILE, RUN_START, rank_file
from utils.disk_space import writing
from utils.errors import CheckpointError, one_line


def load_model_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """model.safetensors of a checkpoint, checked as `load_weights_file` does."""
    return load_weights_file(os.path.join(ckpt_dir, MODEL_FILE))


def load_weights_file(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file of weights; CheckpointError naming the file when it cannot be read or a
    tensor holds NaN or inf (a finite run never saves one: the file was damaged or tampered with)."""
    try:
        sd = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({one_line(e)})") from e
    bad = first_nonfinite(sd.items())
    if bad is not None:
        raise CheckpointError(f"{path}: {bad}")
    return sd


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> Optional[str]:
    """One pass over floating-point tensors: "tensor NAME holds N NaN/inf value(s) ..." for the first that
    has any, else None. A training run that saved them would have stopped at the non-finite loss."""
    for name, t in tensors:
        if torch.is_tensor(t) and t.is_floating_point() and t.numel():
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                n = int((~finite).sum())
                return (f"tensor {name} holds {n} NaN/inf value(s) of {t.numel()}: refused (a run that "
                        "reached them would have stopped at a non-finite loss; the file is damaged)")
    return None


def _unpickling_detail(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if "Unsupported global" in line or "Unsupported operand" in line:
            return line
    first = lines[0] if lines else type(e).__name__
    return first.split(". This is an internal miniz error")[0]  # torch's advice that follows is a paragraph


def load_tensor_file(path: str) -> dict:
    """A `.pt` file of plain tensors (torch.load weights_only=True) holding a dict; CheckpointError naming
    the file when it is truncated, corrupted, would need unpickling, or holds something else."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: not loadable as plain tensors (torch.load weights_only=True): "
                              f"{_unpickling_detail(e)}") from e
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, IndexError, TypeError,
            AttributeError, UnicodeDecodeError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise CheckpointError(f"{path}: cannot be read (truncated or corrupted?): "
                              f"{_unpickling_detail(e)[:200]}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not a dict of tensors")
    return data


def load_rank_file(ckpt_dir: str, kind: str, rank: int) -> Optional[dict]:
    """`{kind}_rank{rank}.pt` of a checkpoint, or None when the file is not there."""
    path = os.path.join(ckpt_dir, rank_file(kind, rank))
    if not os.path.isfile(path):
        return None
    return load_tensor_file(path)


# ---------------------------------------------------------------- the record of how a run started

def write_run_start(out_dir: str, record: dict) -> None:
    """Atomically write <out_dir>/run_start.json (temp file, fsync, os.replace); DiskFullError naming it when it
    does not fit."""
    path = os.path.join(out_dir, RUN_START)
    with writing(path):
        write_json(path, record)


def read_run_start(out_dir: str) -> Optional[dict]:
    """The record written by `write_run_start`, or None when the run never recorded its start."""
    path = os.path.join(out_dir, RUN_START)
    if not os.path.isfile(path):
        return None
    try:
        record = read_json(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    if not isinstance(record, dict) or not isinstance(record.get("init_from"), str):
        raise CheckpointError(f"{path}: no 'init_from' in it")
    return record
