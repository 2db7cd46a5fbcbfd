"""Atomic, verifiable, safely loadable training checkpoints.

Owns: the on-disk layout of `<out_dir>/checkpoints/step_XXXXXXXX/`, writing it atomically from
every rank, pruning to the last K (+ the best by validation loss), and finding the newest
*complete and undamaged* checkpoint on load.

Layout of one checkpoint directory:
  model.safetensors           full model weights (rank 0)
  model_config.json           the architecture, so a checkpoint is self-describing
  optimizer_rank{r}.pt        optimizer (+ loss scaler) state; one per rank when sharded (ZeRO)
  extra_rank{r}.pt            RNG states of rank r and its comm-hook (PowerSGD) state
  trainer_state.json          step, data cursor, schedule position, best val loss, world size...
  config.json                 the resolved run configuration (read as JSON, never executed)
  manifest.json               size and sha256 of every file above
  COMPLETE                    written last, after every rank has finished, inside the temp dir

Protocol: all ranks write into `step_X.tmp/`; barrier; rank 0 writes the manifest and COMPLETE,
fsyncs, then `os.replace`s the directory into place. A crash at any instant leaves either the
previous checkpoints untouched or a `.tmp` directory that loading ignores.

Must never: unpickle arbitrary objects (tensors use safetensors or `torch.load(weights_only=True)`),
write into a live checkpoint directory, or mark a checkpoint complete before every rank wrote.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CKPT_SUBDIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE"
RUN_START = "run_start.json"  # how the run started (written before its first step; read on resume)
_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint (or the record of a run) that cannot be used; the trainer exits 5 on it."""


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, CKPT_SUBDIR)


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


# ---------------------------------------------------------------- RNG state (tensors only)

def capture_rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """Every RNG a training step can touch, as tensors (weights_only-loadable)."""
    py_state = random.getstate()  # (version, tuple of 625 ints, gauss_next)
    np_state = np.random.get_state()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "python_version": torch.tensor([py_state[0]], dtype=torch.int64),
        "python_state": torch.tensor(py_state[1], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if py_state[2] is None else py_state[2]], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
    }
    if device.type != "cpu" and hasattr(torch, device.type):
        state["device"] = getattr(torch, device.type).get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch_cpu"])
    gauss = float(state["python_gauss"].item())
    random.setstate((int(state["python_version"].item()),
                     tuple(int(x) for x in state["python_state"].tolist()),
                     None if gauss != gauss else gauss))
    pos, has_gauss = (int(x) for x in state["numpy_pos"].tolist())
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state["numpy_gauss"].item())))
    if "device" in state and device.type != "cpu":
        getattr(torch, device.type).set_rng_state(state["device"], device)


# ---------------------------------------------------------------- saving

@dataclass
class SaveRequest:
    """What one rank contributes to a checkpoint."""
    step: int
    rank: int
    world_size: int
    model_state: Optional[dict[str, torch.Tensor]]  # rank 0 only (full weights)
    model_config: Optional[dict]
    optimizer_state: Optional[dict]                 # None on ranks that hold nothing to save
    extra_state: dict                               # rng + comm hook state, per rank
    trainer_state: dict                             # rank 0's view (JSON-serialisable)
    run_config: dict


def _barrier(barrier: Optional[Callable[[], None]]) -> None:
    if barrier is not None:
        barrier()


def publish_checkpoint_dir(tmp: str, final: str, step: int) -> None:
    """Rank 0, after every rank wrote into `tmp`: manifest (size + sha256 of every file), COMPLETE,
    fsync, then an atomic rename to `final` (an older directory of the same step is moved aside first).
    Shared by our checkpoints and the sharded DCP ones (parallel/dcp_checkpoint.py)."""
    manifest = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)), "sha256": _sha256(os.path.join(tmp, name))}
                for name in sorted(os.listdir(tmp))}
    write_json(os.path.join(tmp, "manifest.json"), manifest)
    write_json(os.path.join(tmp, COMPLETE_MARKER), {"step": int(step)})
    _fsync_dir(tmp)
    if os.path.exists(final):  # re-saving a step (e.g. after resume): move the old one aside
        trash = final + f".old.{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final))


def save_checkpoint(out_dir: str, req: SaveRequest, barrier: Optional[Callable[[], None]] = None,
                    keep_last: int = 3, keep_best: bool = True,
                    fault_hook: Optional[Callable[[], None]] = None,
                    log: Callable[[str], None] = print) -> str:
    """Collective: every rank calls this with its own SaveRequest. Returns the final directory."""
    root = checkpoint_root(out_dir)
    final = os.path.join(root, step_dir_name(req.step))
    tmp = final + ".tmp"
    if req.rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):  # left by a crash: never complete, safe to drop
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier(barrier)

    if req.rank == 0:
        assert req.model_state is not None
        # safetensors refuses shared/non-contiguous storage (our params are views of one buffer)
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in req.model_state.items()}
        path = os.path.join(tmp, "model.safetensors")
        save_file(tensors, path, metadata={"format": "pt", "step": str(req.step)})
        _fsync_file(path)
        write_json(os.path.join(tmp, "model_config.json"), req.model_config)
        write_json(os.path.join(tmp, "config.json"), req.run_config)
        if fault_hook is not None:
            fault_hook()  # test hook: die with a half-written checkpoint
    if req.optimizer_state is not None:
        path = os.path.join(tmp, f"optimizer_rank{req.rank}.pt")
        torch.save(req.optimizer_state, path)
        _fsync_file(path)
    path = os.path.join(tmp, f"extra_rank{req.rank}.pt")
    torch.save(req.extra_state, path)
    _fsync_file(path)
    _barrier(barrier)  # every rank has written and fsynced its files

    if req.rank == 0:
        trainer_state = dict(req.trainer_state, step=req.step, world_size=req.world_size,
                             saved_at=time.time())
        write_json(os.path.join(tmp, "trainer_state.json"), trainer_state)
        publish_checkpoint_dir(tmp, final, req.step)
        sig = _signature(final)
        if sig is not None:  # the manifest's hashes were computed from exactly these files
            _verified[final] = sig
        prune_checkpoints(out_dir, keep_last=keep_last, keep_best=keep_best, log=log)
    _barrier(barrier)
    return final


def list_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every finished-looking directory, newest first (not yet verified)."""
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        if name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit():
            found.append((int(name[len(_PREFIX):]), os.path.join(root, name)))
    return sorted(found, reverse=True)


def prune_checkpoints(out_dir: str, keep_last: int, keep_best: bool,
                      log: Callable[[str], None] = print) -> None:
    """Keep the `keep_last` newest *valid* checkpoints and the valid one with the best val_loss.

    Only checkpoints that pass `verify_checkpoint` count: a damaged directory (torn, truncated,
    corrupted) can never be loaded, so it is removed and never takes the place of a good one. The
    newest valid checkpoint is therefore always kept, whatever keep_last says.
    """
    ckpts = list_checkpoints(out_dir)
    valid, damaged = [], []
    for _, p in ckpts:
        problem = verify_checkpoint(p, trust_cache=True)
        (valid if problem is None else damaged).append((p, problem))
    keep = {p for p, _ in valid[:max(1, keep_last)]}
    if keep_best:
        best, best_path = float("inf"), None
        for p, _ in valid:
            try:
                v = read_json(os.path.join(p, "trainer_state.json")).get("val_loss")
            except (OSError, ValueError):
                continue
            if v is not None and v < best:
                best, best_path = v, p
        if best_path:
            keep.add(best_path)
    for p, problem in damaged:
        log(f"[checkpoint] removing damaged {p}: {problem}")
        shutil.rmtree(p, ignore_errors=True)
    for p, _ in valid:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------- loading

# Checkpoints this process has verified (or written), by path, with the (name, size, mtime_ns) of
# their files at that moment: pruning verifies every checkpoint at every save, and re-hashing
# gigabytes of unchanged files each time would cost more than the save itself.
_verified: dict[str, tuple] = {}


def _signature(path: str) -> Optional[tuple]:
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path)))
    except OSError:
        return None


def verify_checkpoint(path: str, check_hashes: bool = True, trust_cache: bool = False) -> Optional[str]:
    """None when the directory is complete and matches its manifest, else the reason.

    trust_cache: accept a directory this process already hashed (or wrote) whose files still have
    the same names, sizes and mtimes, without hashing it again (pruning does; loading never does).
    """
    sig = _signature(path)
    if trust_cache and sig is not None and _verified.get(path) == sig:
        return None
    _verified.pop(path, None)
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        return "no COMPLETE marker (save was interrupted)"
    try:
        manifest = read_json(os.path.join(path, "manifest.json"))
    except (OSError, ValueError) as e:
        return f"unreadable manifest.json ({e})"
    for name, info in manifest.items():
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            return f"missing file {name}"
        size = os.path.getsize(fp)
        if size != info["bytes"]:
            return f"{name} has {size} bytes, manifest says {info['bytes']} (truncated?)"
        if check_hashes and _sha256(fp) != info["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
    if "dcp_manifest.json" in manifest:  # sharded (DCP): every rank's shard and DCP's index must be there
        from utils.dcp_files import dcp_dir_problem
        problem = dcp_dir_problem(path)
        if problem is not None:
            return problem
    if check_hashes and sig is not None and sig == _signature(path):
        _verified[path] = sig
    return None


def find_latest_valid(out_dir: str, log: Callable[[str], None] = print,
                      check_hashes: bool = True) -> Optional[str]:
    """Newest complete, undamaged checkpoint; damaged ones are reported and skipped."""
    for step, path in list_checkpoints(out_dir):
        problem = verify_checkpoint(path, check_hashes=check_hashes)
        if problem is None:
            return path
        log(f"[checkpoint] skipping {path}: {problem}")
    return None


def resolve_checkpoint_dir(path: str, log: Callable[[str], None] = print) -> Optional[str]:
    """Accept a checkpoint directory itself or a run directory holding checkpoints/."""
    if os.path.isfile(os.path.join(path, "manifest.json")) or os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        problem = verify_checkpoint(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is not usable: {problem}")
        return path
    return find_latest_valid(path, log=log)


def load_model_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    path = os.path.join(ckpt_dir, "model.safetensors")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot be read ({' '.join(str(e).split())})") from e


def _unpickling_detail(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if "Unsupported global" in line or "Unsupported operand" in line:
            return line
    return lines[0] if lines else type(e).__name__


def load_rank_file(ckpt_dir: str, kind: str, rank: int) -> Optional[dict]:
    path = os.path.join(ckpt_dir, f"{kind}_rank{rank}.pt")
    if not os.path.isfile(path):
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: not loadable as plain tensors (torch.load weights_only=True): "
                              f"{_unpickling_detail(e)}") from e


# ---------------------------------------------------------------- the record of how a run started

def write_run_start(out_dir: str, record: dict) -> None:
    """Atomically write <out_dir>/run_start.json (temp file, fsync, os.replace)."""
    path = os.path.join(out_dir, RUN_START)
    tmp = f"{path}.tmp.{os.getpid()}"
    write_json(tmp, record)
    os.replace(tmp, path)
    _fsync_dir(out_dir)


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
