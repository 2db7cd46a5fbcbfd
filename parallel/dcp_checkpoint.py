"""Sharded checkpoints of an FSDP model + FSDPOptimizer with torch.distributed.checkpoint (DCP).

Owns: the sharded checkpoint directory (DCP's `.metadata` + `__<rank>_<k>.distcp` files, per-rank
extras, JSON sidecars, `dcp_manifest.json`, `manifest.json`, `COMPLETE`), its atomic save protocol,
loading into a model/optimizer of ANY world size (DCP re-shards), a single-process reader of the
full model weights (for export). The restricted reader of DCP's pickled `.metadata` and the check
that every rank's shard is present live in utils/dcp_files.py (verification of any checkpoint uses them).

Layout (compatible with utils/checkpoint.py, so its find_latest_valid / verify_checkpoint /
prune_checkpoints(keep_last, keep_best) work on these directories unchanged):
  <ckpt_root>/step_XXXXXXXX/
    .metadata, __<r>_0.distcp   DCP: tensors only (model.<fqn>, optim.state.<fqn>.<exp_avg|exp_avg_sq|step>)
    extra_rank{r}.pt            optional per-rank tensors (RNG...), torch.load(weights_only=True)-loadable
    <name>.json                 optional JSON sidecars from the caller (trainer_state.json, model_config.json, ...)
    dcp_manifest.json           step, world size, engine, the file list with sizes, the optimizer's scalars
    manifest.json               {file: {"bytes", "sha256"}} of every file above (utils/checkpoint format)
    COMPLETE                    {"step": N}, written last

Protocol: rank 0 creates `<ckpt_root>/.tmp_step_XXXXXXXX/`; barrier; every rank writes its DCP
shard (fsynced); barrier; rank 0 writes the JSON files, the manifests and COMPLETE, fsyncs and
`os.replace`s the directory to `step_XXXXXXXX`; barrier. A crash at any instant leaves the older
checkpoints untouched and at most a `.tmp_step_*` directory that nothing loads (and the next save
of that step removes).

No pickle on load: only tensors go through DCP (so no `BytesStorageMetadata` item, which DCP would
read with `torch.load(weights_only=False)`); tensor files are read by DCP with
`torch.load(weights_only=True)`; scalars travel in JSON. DCP's `.metadata` file IS a pickle
(written by `pickle.dump`, read by `pickle.load` in torch's FileSystemReader): `SafeFileSystemReader`
reads it with an unpickler that can only construct an allow-list of DCP metadata classes,
`torch.Size`, dtypes/layouts and paths, and refuses any other global (so a crafted file cannot call
arbitrary code).

Must never: gather the full model on one rank to save, mark a checkpoint complete before every rank
has written, write into a live checkpoint directory, or read a checkpoint with plain `pickle.load`.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from utils.checkpoint import _fsync_dir, _sha256, publish_checkpoint_dir, read_json, write_json
from utils.dcp_files import (DCPCheckpointError, SafeFileSystemReader, dcp_dir_problem,  # noqa: F401 (re-exported)
                             dcp_layout_problem, read_dcp_metadata)

DCP_FORMAT = 1
COMPLETE_MARKER = "COMPLETE"
MANIFEST = "manifest.json"
DCP_MANIFEST = "dcp_manifest.json"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp_"
_MODEL, _OPTIM = "model.", "optim."




def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"  # the utils/checkpoint.py convention


# ---------------------------------------------------------------------------- small file helpers
# (the same fsync / JSON / hash conventions as utils/checkpoint.py, whose manifests these directories share)

def _fsync_path(path: str) -> None:
    _fsync_dir(path)  # tolerates filesystems that refuse fsync on directories


# ---------------------------------------------------------------------------- state <-> flat dict

def _mesh_group(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """The process group of the mesh the model was sharded over, as recorded when it was wrapped.

    Not read from the parameters: after a forward-only pass, units built with
    reshard_after_forward=False hold plain tensors, and a group inferred from them would be None,
    making every rank save as a world of one into the same directory."""
    from parallel.fsdp import fsdp_mesh
    mesh = fsdp_mesh(model)
    if mesh is not None:
        return mesh.get_group()
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.get_group()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise DCPCheckpointError("the model records no FSDP mesh and has no sharded parameter: cannot tell which "
                                 "ranks save it together (wrap it with parallel.fsdp.wrap_fsdp)")
    return None


def _group_rank_world(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _barrier(group: Optional[dist.ProcessGroup]) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def _unwrap(model: nn.Module) -> nn.Module:
    from parallel.fsdp import unwrap
    return unwrap(model)


def _split_optimizer_state(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """FSDPOptimizer.state_dict() -> (tensors for DCP, JSON-able rest)."""
    tensors = {k: v for k, v in sd["adamw"].items() if torch.is_tensor(v)}
    groups = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sd["adamw"].items()
              if not torch.is_tensor(v)}
    rest = {k: v for k, v in sd.items() if k != "adamw"}
    rest["param_groups"] = groups
    return tensors, rest


def _state_to_save(model: nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], Optional[dict]]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    flat = {_MODEL + k: v for k, v in get_model_state_dict(model).items()}
    scalars = None
    if optimizer is not None:
        tensors, scalars = _split_optimizer_state(optimizer.state_dict())
        flat.update({_OPTIM + k: v for k, v in tensors.items()})
    for k, v in flat.items():
        if not torch.is_tensor(v):
            raise DCPCheckpointError(f"state entry {k} is a {type(v).__name__}, not a tensor")
    return flat, scalars


# ---------------------------------------------------------------------------- save

def save_dcp_checkpoint(ckpt_root: str, step: int, model: nn.Module, optimizer=None, *,
                        json_files: Optional[dict[str, Any]] = None,
                        rank_state: Optional[dict[str, Any]] = None,
                        fault_hook: Optional[Callable[[], None]] = None) -> str:
    """Collective over the model's FSDP mesh: every rank of the mesh calls it. Returns the final dir.

    json_files: {file name: JSON-able object} written by rank 0 (pass the same on every rank or
      only on rank 0), e.g. {"trainer_state.json": {...}, "model_config.json": {...}}.
    rank_state: this rank's tensors (+ ints/floats/str), saved as extra_rank{r}.pt
      (torch.load(weights_only=True)-loadable), e.g. {"rng": ...}.
    fault_hook: called on rank 0 after every shard was written, before the manifest (tests: die
      in the middle of a save).
    """
    from parallel.fsdp import reshard
    model = _unwrap(model)
    group = _mesh_group(model)
    rank, world = _group_rank_world(group)
    reshard(model)  # gathered parameters (left by a forward-only pass) are freed before the state is read
    final = os.path.join(ckpt_root, step_dir_name(step))
    tmp = os.path.join(ckpt_root, _TMP_PREFIX + step_dir_name(step))
    if rank == 0:
        os.makedirs(ckpt_root, exist_ok=True)
        if os.path.exists(tmp):  # left by a crashed save: never complete, safe to drop
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier(group)

    flat, scalars = _state_to_save(model, optimizer)
    dcp.save(flat, storage_writer=FileSystemWriter(tmp, sync_files=True), process_group=group,
             no_dist=group is None)
    if rank_state is not None:
        path = os.path.join(tmp, f"extra_rank{rank}.pt")
        torch.save(rank_state, path)
        _fsync_path(path)
    _barrier(group)  # every shard and every extra file is on disk

    if rank == 0:
        if fault_hook is not None:
            fault_hook()
        for name, obj in (json_files or {}).items():
            if os.sep in name or name in (MANIFEST, DCP_MANIFEST, COMPLETE_MARKER) or not name.endswith(".json"):
                raise ValueError(f"json_files: {name!r} must be a plain *.json file name")
            write_json(os.path.join(tmp, name), obj)
        problem = dcp_layout_problem(tmp, world, with_extras=rank_state is not None)
        if problem is not None:  # never publish a checkpoint some rank did not write
            raise DCPCheckpointError(f"refusing to publish {final}: {problem}")
        files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
        write_json(os.path.join(tmp, DCP_MANIFEST), {
            "format": DCP_FORMAT, "engine": "fsdp", "step": int(step), "world_size": world,
            "saved_at": time.time(), "files": files, "optimizer": scalars,
            "model_keys": sum(1 for k in flat if k.startswith(_MODEL))})
        publish_checkpoint_dir(tmp, final, step)  # manifest, COMPLETE, fsync, atomic rename
    _barrier(group)
    return final


# ---------------------------------------------------------------------------- verify / find

def check_dcp_checkpoint(ckpt_dir: str, check_hashes: bool = False) -> Optional[str]:
    """None if the directory is a complete DCP checkpoint matching its manifest, else the reason.
    Sizes only by default (cheap, done on every rank at load); check_hashes=True also compares sha256
    (utils.checkpoint.verify_checkpoint does the same on these directories)."""
    if not os.path.isfile(os.path.join(ckpt_dir, COMPLETE_MARKER)):
        return "no COMPLETE marker (save was interrupted)"
    try:
        manifest = read_json(os.path.join(ckpt_dir, MANIFEST))
        meta = read_json(os.path.join(ckpt_dir, DCP_MANIFEST))
    except (OSError, ValueError) as e:
        return f"unreadable manifest ({e})"
    if meta.get("format") != DCP_FORMAT:
        return f"unknown DCP checkpoint format {meta.get('format')!r}"
    for name, info in manifest.items():
        fp = os.path.join(ckpt_dir, name)
        if not os.path.isfile(fp):
            return f"missing file {name}"
        if os.path.getsize(fp) != info["bytes"]:
            return f"{name} has {os.path.getsize(fp)} bytes, manifest says {info['bytes']} (truncated?)"
        if check_hashes and _sha256(fp) != info["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
    return dcp_dir_problem(ckpt_dir)


def is_dcp_checkpoint(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, DCP_MANIFEST))


def latest_dcp_checkpoint(ckpt_root: str, check_hashes: bool = False) -> Optional[str]:
    """Newest complete DCP checkpoint under ckpt_root (temporary and damaged directories skipped)."""
    if not os.path.isdir(ckpt_root):
        return None
    steps = sorted((int(n[len(_PREFIX):]), n) for n in os.listdir(ckpt_root)
                   if n.startswith(_PREFIX) and n[len(_PREFIX):].isdigit())
    for _, name in reversed(steps):
        path = os.path.join(ckpt_root, name)
        if is_dcp_checkpoint(path) and check_dcp_checkpoint(path, check_hashes) is None:
            return path
    return None


# ---------------------------------------------------------------------------- load

def load_dcp_checkpoint(ckpt_dir: str, model: nn.Module, optimizer=None) -> dict:
    """Collective over the model's FSDP mesh. Loads the model (and the optimizer, when given) from a
    checkpoint saved at any world size; DCP reads, on every rank, just the pieces of each saved
    shard that overlap this rank's new shard. Returns dcp_manifest.json (step, world_size, ...).

    Build model and optimizer exactly as for a fresh run (wrap_fsdp + FSDPOptimizer), then call this.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    problem = check_dcp_checkpoint(ckpt_dir)
    if problem is not None:
        raise DCPCheckpointError(f"checkpoint {ckpt_dir} is not usable: {problem}")
    meta = read_json(os.path.join(ckpt_dir, DCP_MANIFEST))
    model = _unwrap(model)
    group = _mesh_group(model)
    md = read_dcp_metadata(ckpt_dir)
    saved = set(md.state_dict_metadata)

    model_sd = get_model_state_dict(model)
    want = {_MODEL + k: v for k, v in model_sd.items()}
    missing = sorted(k for k in want if k not in saved)
    unexpected = sorted(k for k in saved if k.startswith(_MODEL) and k not in want)
    if missing or unexpected:
        raise DCPCheckpointError(f"{ckpt_dir}: model does not match the checkpoint (missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]})")
    opt_sd = opt_tensors = None
    if optimizer is not None:
        if meta.get("optimizer") is None:
            raise DCPCheckpointError(f"{ckpt_dir} holds no optimizer state")
        opt_sd = optimizer.state_dict()  # template: zero moments created for a fresh optimizer
        opt_tensors, _ = _split_optimizer_state(opt_sd)
        absent = sorted(k for k in opt_tensors if _OPTIM + k not in saved)
        if absent:
            raise DCPCheckpointError(f"{ckpt_dir}: no saved optimizer state for {absent[:5]} (a parameter that "
                                     "had no gradient before the save, or a different set of trainable parameters)")
        want.update({_OPTIM + k: v for k, v in opt_tensors.items()})
    for k, v in want.items():
        tm = md.state_dict_metadata[k]
        if not isinstance(tm, TensorStorageMetadata) or list(tm.size) != list(v.shape):
            raise DCPCheckpointError(f"{ckpt_dir}: {k} has shape {list(getattr(tm, 'size', []))} in the checkpoint, "
                                     f"{list(v.shape)} here")

    dcp.load(want, storage_reader=SafeFileSystemReader(ckpt_dir), process_group=group, no_dist=group is None)

    set_model_state_dict(model, {k[len(_MODEL):]: v for k, v in want.items() if k.startswith(_MODEL)})
    if optimizer is not None:
        saved_scalars = meta["optimizer"]
        adamw = dict(opt_sd["adamw"])
        adamw.update({k[len(_OPTIM):]: v for k, v in want.items() if k.startswith(_OPTIM)})
        optimizer.load_state_dict({"format": saved_scalars["format"], "lr": saved_scalars["lr"],
                                   "scaler": saved_scalars["scaler"],
                                   "prev_grad_norm": saved_scalars["prev_grad_norm"], "adamw": adamw})
    _barrier(group)
    return meta


def load_full_model_state_dict(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights of a DCP checkpoint in ONE process, without a process group
    (export, inspection). It materialises the whole model in this process's memory: not streamed."""
    problem = check_dcp_checkpoint(ckpt_dir)
    if problem is not None:
        raise DCPCheckpointError(f"checkpoint {ckpt_dir} is not usable: {problem}")
    md = read_dcp_metadata(ckpt_dir)
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
           for k, v in md.state_dict_metadata.items() if k.startswith(_MODEL)}
    dcp.load(out, storage_reader=SafeFileSystemReader(ckpt_dir), no_dist=True)
    return {k[len(_MODEL):]: v for k, v in out.items()}


def model_tensor_specs(ckpt_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the model weights in a DCP checkpoint, from its metadata only."""
    problem = check_dcp_checkpoint(ckpt_dir)
    if problem is not None:
        raise DCPCheckpointError(f"checkpoint {ckpt_dir} is not usable: {problem}")
    md = read_dcp_metadata(ckpt_dir)
    return {k[len(_MODEL):]: (tuple(v.size), v.properties.dtype)
            for k, v in md.state_dict_metadata.items() if k.startswith(_MODEL)}


def load_model_tensors(ckpt_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Only the named model weights of a DCP checkpoint, whole, in this process (no process group):
    what a streaming export reads one group at a time, so memory holds one group, not the model."""
    specs = model_tensor_specs(ckpt_dir)
    missing = [n for n in names if n not in specs]
    if missing:
        raise DCPCheckpointError(f"checkpoint {ckpt_dir} has no model tensor(s) {missing[:3]}")
    out = {_MODEL + n: torch.empty(specs[n][0], dtype=specs[n][1]) for n in names}
    dcp.load(out, storage_reader=SafeFileSystemReader(ckpt_dir), no_dist=True)
    return {k[len(_MODEL):]: v for k, v in out.items()}
