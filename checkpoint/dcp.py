"""Sharded checkpoints of an FSDP model + FSDPOptimizer with torch.distributed.checkpoint (DCP).

Owns: the sharded checkpoint directory (DCP's `.metadata` + `__<rank>_<k>.distcp` files, per-rank
extras, JSON sidecars, `dcp_manifest.json`, `manifest.json`, `COMPLETE`), its atomic save protocol,
loading into a model/optimizer of ANY world size (DCP re-shards), a single-process reader of the
full model weights (for export), and a "dtensor" engine's state saved and loaded (`save_dtensor`,
`load_dtensor`). The restricted reader of DCP's pickled `.metadata` and the check that every rank's shard
is present live in checkpoint/dcp_files.py (verification of any checkpoint uses them).

Layout (the common step_N/ layout, so checkpoint/verify.py's find_latest_valid / verify_checkpoint /
prune_checkpoints(keep_last, keep_best) work on these directories unchanged):
  <ckpt_root>/step_XXXXXXXX/
    .metadata, __<r>_0.distcp   DCP: tensors only (model.<fqn>, optim.state.<fqn>.<exp_avg|exp_avg_sq|step>)
    extra_rank{r}.pt            optional per-rank tensors (RNG...), torch.load(weights_only=True)-loadable
    <name>.json                 optional JSON sidecars from the caller (trainer_state.json, model_config.json, ...)
    dcp_manifest.json           step, world size, engine, the file list with sizes, the optimizer's scalars
    manifest.json               {file: {"bytes", "sha256"}} of every file above (checkpoint/protocol.py)
    COMPLETE                    {"step": N}, written last

Protocol: rank 0 creates `<ckpt_root>/step_XXXXXXXX.tmp/` (utils/publish.py's temp-dir name, the
one every format uses); barrier; every rank writes its DCP shard (fsynced); barrier; rank 0
writes the JSON files, the manifests and COMPLETE, fsyncs and `os.replace`s the directory to
`step_XXXXXXXX` (checkpoint/protocol.publish_checkpoint_dir); barrier. A crash at any instant leaves the
older checkpoints untouched and at most a `step_*.tmp` directory that nothing loads (and the next
save of that step removes). A write that does not fit (a full disk, RLIMIT_FSIZE) removes the
`.tmp` directory at once and raises DiskFullError (exit 7); a save starts only when the disk has as
much free space as the last checkpoint takes (checkpoint/protocol.save_guard).

No pickle on load: only tensors go through DCP (so no `BytesStorageMetadata` item, which DCP would
read with `torch.load(weights_only=False)`); tensor files are read by DCP with
`torch.load(weights_only=True)`; scalars travel in JSON. DCP's `.metadata` file IS a pickle
(written by `pickle.dump`, read by `pickle.load` in torch's FileSystemReader): `SafeFileSystemReader`
reads it with an unpickler that can only construct an allow-list of DCP metadata classes,
`torch.Size`, dtypes/layouts and paths, and refuses any other global (so a crafted file cannot call
arbitrary code).

Loading: every reader starts with `check_dcp_checkpoint` (the checks of checkpoint/verify.verify_checkpoint,
.metadata's paths confined to the directory) and reads through SafeFileSystemReader; a file that does
not load raises DCPCheckpointError (a CheckpointError: exit 5) naming it, never DCP's CheckpointException;
an intact checkpoint of another model raises CheckpointMismatchError.

Must never: gather the full model on one rank to save, mark a checkpoint complete before every rank
has written, write into a live checkpoint directory, or read a checkpoint with plain `pickle.load`.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from checkpoint.dcp_files import DCPCheckpointError, SafeFileSystemReader, dcp_layout_problem, read_dcp_metadata
from checkpoint.files import first_nonfinite
from checkpoint.protocol import (SaveJob, agreed_phase, agreement, prepare_step_dir, publish_checkpoint_dir,
                                 save_guard, step_dir_paths)
from checkpoint.reads import agreed_reads, load_extra_state, refuse_nonfinite_weights
from checkpoint.verify import prune_checkpoints, verify_checkpoint
from parallel.fsdp import fsdp_state_group, reshard
from utils.checkpoint_json import read_json, write_json
from utils.checkpoint_layout import (COMPLETE_MARKER, DCP_MANIFEST, DCP_METADATA, MANIFEST, MODEL_CONFIG, RUN_CONFIG,
                                     TRAINER_STATE, checkpoint_root, dcp_shard_file, extra_file, parse_step)
from utils.errors import CheckpointError, CheckpointMismatchError, one_line
from utils.publish import fsync_file
from utils.run_dir import misnamed_step

DCP_FORMAT = 1
MODEL_PREFIX, OPTIM_PREFIX = "model.", "optim."




# ---------------------------------------------------------------------------- state <-> flat dict

def mesh_group(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """The process group of the mesh the model was sharded over, as recorded when it was wrapped.

    Not read from the parameters: after a forward-only pass, units built with
    reshard_after_forward=False hold plain tensors, and a group inferred from them would be None,
    making every rank save as a world of one into the same directory."""
    group = fsdp_state_group(model)
    if group is not None:
        return group
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.get_group()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise DCPCheckpointError("the model records no FSDP mesh and has no sharded parameter: cannot tell which "
                                 "ranks save it together (wrap it with parallel.fsdp.wrap_fsdp)")
    return None


def group_rank_world(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def group_barrier(group: Optional[dist.ProcessGroup]) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def _split_optimizer_state(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """FSDPOptimizer.state_dict() -> (tensors for DCP, JSON-able rest)."""
    tensors = {k: v for k, v in sd["adamw"].items() if torch.is_tensor(v)}
    groups = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sd["adamw"].items()
              if not torch.is_tensor(v)}
    rest = {k: v for k, v in sd.items() if k != "adamw"}
    rest["param_groups"] = groups
    return tensors, rest


def state_to_save(model: nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], Optional[dict]]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    flat = {MODEL_PREFIX + k: v for k, v in get_model_state_dict(model).items()}
    scalars = None
    if optimizer is not None:
        tensors, scalars = _split_optimizer_state(optimizer.state_dict())
        flat.update({OPTIM_PREFIX + k: v for k, v in tensors.items()})
    for k, v in flat.items():
        if not torch.is_tensor(v):
            raise DCPCheckpointError(f"state entry {k} is a {type(v).__name__}, not a tensor")
    return flat, scalars


# ---------------------------------------------------------------------------- save

def _dcp_failures(e: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, its exception) of each rank a DCP CheckpointException reports, lowest rank first (an entry is the
    exception with its traceback summary, or the bare exception)."""
    return [(r, f[0] if isinstance(f, tuple) else f) for r, f in sorted(e.failures.items())]


def _write_shards(flat: dict, tmp: str, group: Optional[dist.ProcessGroup]) -> None:
    """DCP's save of every rank's shard into `tmp` (collective). A write that failed at any rank reaches every rank
    as DCP's CheckpointException, a BaseException that no `except Exception` sees: it is raised again as a
    RuntimeError with its one line (naming the failing rank's error), so that save_guard turns a shard that did not
    fit into DiskFullError (exit 7) with step_N.tmp removed, instead of a traceback (exit 1, retried on the same
    full disk) that left the partial directory behind."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        dcp.save(flat, storage_writer=FileSystemWriter(tmp, sync_files=True), process_group=group,
                 no_dist=group is None)
    except CheckpointException as e:
        failures = "; ".join(f"rank {r}: {type(x).__name__}: {one_line(x)}" for r, x in _dcp_failures(e))
        raise RuntimeError(f"DCP's save failed at {failures or one_line(e)}"[:400]) from e


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
    group = mesh_group(model)
    rank, world = group_rank_world(group)
    reshard(model)  # gathered parameters (left by a forward-only pass) are freed before the state is read
    final, tmp = step_dir_paths(ckpt_root, step)
    agree = agreement(group is not None, group)
    # a full disk at any rank: exit 7 at every rank, no step_N.tmp left (each phase ends in one verdict of every
    # rank: checkpoint/protocol.agreed_phase)
    with save_guard(ckpt_root, step) as guard:
        prepare_step_dir(guard, rank, agree)
        flat, scalars = state_to_save(model, optimizer)
        guard.file = os.path.join(tmp, dcp_shard_file(rank))
        _write_shards(flat, tmp, group)  # DCP's own collective: a shard that did not fit fails every rank
        with agreed_phase(guard, agree):  # every shard and every extra file is on disk
            if rank_state is not None:
                path = guard.file = os.path.join(tmp, extra_file(rank))
                torch.save(rank_state, path)
                fsync_file(path)

        with agreed_phase(guard, agree):
            if rank == 0:
                if fault_hook is not None:
                    fault_hook()
                publish_dcp_dir(tmp, final, step, world, json_files, scalars,
                                sum(1 for k in flat if k.startswith(MODEL_PREFIX)),
                                rank_state is not None, guard)
    group_barrier(group)
    return final


def publish_dcp_dir(tmp: str, final: str, step: int, world: int, json_files: Optional[dict[str, Any]],
                    scalars: Optional[dict], model_keys: int, with_extras: bool, guard: Any) -> None:
    """Rank 0, once every rank's shard (and extra file) is in `tmp`: the JSON sidecars, the check that every rank
    wrote, dcp_manifest.json, then manifest, COMPLETE, fsync, atomic rename (also --async_checkpoint's writer)."""
    for name, obj in (json_files or {}).items():
        if os.sep in name or name in (MANIFEST, DCP_MANIFEST, COMPLETE_MARKER) or not name.endswith(".json"):
            raise ValueError(f"json_files: {name!r} must be a plain *.json file name")
        guard.file = os.path.join(tmp, name)
        write_json(guard.file, obj)
    problem = dcp_layout_problem(tmp, world, with_extras=with_extras)
    if problem is not None:  # never publish a checkpoint some rank did not write
        raise DCPCheckpointError(f"refusing to publish {final}: {problem}")
    files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
    guard.file = os.path.join(tmp, DCP_MANIFEST)
    write_json(guard.file, {
        "format": DCP_FORMAT, "engine": "fsdp", "step": int(step), "world_size": world,
        "saved_at": time.time(), "files": files, "optimizer": scalars, "model_keys": model_keys})
    publish_checkpoint_dir(tmp, final, step)  # manifest, COMPLETE, fsync, atomic rename


# ---------------------------------------------------------------------------- verify / find

def _read_dcp_manifest(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, DCP_MANIFEST)
    try:
        meta = read_json(path)
    except (OSError, ValueError) as e:
        raise DCPCheckpointError(f"{path}: unreadable ({one_line(e)[:200]})") from e
    if not isinstance(meta, dict):
        raise DCPCheckpointError(f"{path}: holds a {type(meta).__name__}, not a JSON object")
    return meta


def check_dcp_checkpoint(ckpt_dir: str, check_hashes: bool = False) -> Optional[str]:
    """None if the directory is a complete DCP checkpoint matching its manifest, else the reason.
    Sizes only by default (cheap, done on every rank at load); check_hashes=True also compares sha256.
    The same checks as checkpoint/verify.verify_checkpoint (manifest shape, JSON sidecars, .metadata
    readable and confined to the directory, every rank's shard) plus the DCP format."""
    problem = verify_checkpoint(ckpt_dir, check_hashes=check_hashes)
    if problem is not None:
        return problem
    try:
        meta = _read_dcp_manifest(ckpt_dir)
    except DCPCheckpointError as e:
        return one_line(e)
    if meta.get("format") != DCP_FORMAT:
        return f"unknown DCP checkpoint format {meta.get('format')!r}"
    return None


def is_dcp_checkpoint(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, DCP_MANIFEST))


def latest_dcp_checkpoint(ckpt_root: str, check_hashes: bool = False) -> Optional[str]:
    """Newest complete DCP checkpoint under ckpt_root (temporary and damaged directories skipped)."""
    if not os.path.isdir(ckpt_root):
        return None
    steps = sorted((step, n) for n in os.listdir(ckpt_root) if (step := parse_step(n)) is not None)
    for step, name in reversed(steps):
        path = os.path.join(ckpt_root, name)
        if misnamed_step(path, step) is None and is_dcp_checkpoint(path) and \
                check_dcp_checkpoint(path, check_hashes) is None:
            return path
    return None


# ---------------------------------------------------------------------------- load

def usable_checkpoint(ckpt_dir: str) -> tuple[dict, Any]:
    """(dcp_manifest.json, DCP metadata) of a checkpoint that passes check_dcp_checkpoint; every
    loading path starts here, so no file is opened before the paths .metadata names are confined."""
    problem = check_dcp_checkpoint(ckpt_dir)
    if problem is not None:
        raise DCPCheckpointError(f"checkpoint {ckpt_dir} is not usable: {problem}")
    return _read_dcp_manifest(ckpt_dir), read_dcp_metadata(ckpt_dir)


def dcp_load(state: dict, ckpt_dir: str, group: Optional[dist.ProcessGroup]) -> None:
    """dcp.load through SafeFileSystemReader; a data file that does not load (on any rank) becomes a
    DCPCheckpointError naming it, not DCP's CheckpointException (a BaseException holding tracebacks)."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with warnings.catch_warnings():  # no_dist is meant: one process reads the whole checkpoint
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeFileSystemReader(ckpt_dir), process_group=group,
                     no_dist=group is None)
    except CheckpointException as e:
        causes = [f for _, f in _dcp_failures(e)]
        named = next((c for c in causes if isinstance(c, CheckpointError)), None)
        if named is not None:
            raise DCPCheckpointError(one_line(named)) from None
        cause = causes[0] if causes else e
        if isinstance(cause, (torch.OutOfMemoryError, MemoryError)) or not isinstance(cause, Exception):
            raise
        raise DCPCheckpointError(f"checkpoint {ckpt_dir}: DCP cannot load it as .metadata describes (damaged?): "
                                 f"{type(cause).__name__}: {one_line(cause)[:200]}") from None


OPTIM_SCALARS = ("format", "lr", "scaler", "prev_grad_norm")


def load_dcp_checkpoint(ckpt_dir: str, model: nn.Module, optimizer=None) -> dict:
    """Collective over the model's FSDP mesh. Loads the model (and the optimizer, when given) from a
    checkpoint saved at any world size; DCP reads, on every rank, just the pieces of each saved
    shard that overlap this rank's new shard. Returns dcp_manifest.json (step, world_size, ...).

    Build model and optimizer exactly as for a fresh run (wrap_fsdp + FSDPOptimizer), then call this.
    Raises CheckpointMismatchError when the (intact) checkpoint holds other tensor names or shapes
    than this model and optimizer, DCPCheckpointError (naming the file) when a file is damaged.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    meta, md = usable_checkpoint(ckpt_dir)
    group = mesh_group(model)
    saved = set(md.state_dict_metadata)

    model_sd = get_model_state_dict(model)
    want = {MODEL_PREFIX + k: v for k, v in model_sd.items()}
    missing = sorted(k for k in want if k not in saved)
    unexpected = sorted(k for k in saved if k.startswith(MODEL_PREFIX) and k not in want)
    if missing or unexpected:
        raise CheckpointMismatchError(f"{os.path.join(ckpt_dir, DCP_METADATA)}: the model does not match the checkpoint "
                                      f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    opt_sd = opt_tensors = None
    if optimizer is not None:
        manifest_path = os.path.join(ckpt_dir, DCP_MANIFEST)
        scalars = meta.get("optimizer")
        if scalars is None:
            raise DCPCheckpointError(f"{manifest_path}: records no optimizer state (\"optimizer\": null), "
                                     "so this checkpoint cannot resume training")
        if not isinstance(scalars, dict) or any(k not in scalars for k in OPTIM_SCALARS):
            raise DCPCheckpointError(f"{manifest_path}: the optimizer's scalars lack "
                                     f"{[k for k in OPTIM_SCALARS if not isinstance(scalars, dict) or k not in scalars]}")
        opt_sd = optimizer.state_dict()  # template: zero moments created for a fresh optimizer
        opt_tensors, _ = _split_optimizer_state(opt_sd)
        absent = sorted(k for k in opt_tensors if OPTIM_PREFIX + k not in saved)
        if absent:
            raise CheckpointMismatchError(f"{os.path.join(ckpt_dir, DCP_METADATA)}: no saved optimizer state for "
                                          f"{absent[:5]} (a parameter that "
                                          "had no gradient before the save, or a different set of trainable "
                                          "parameters)")
        want.update({OPTIM_PREFIX + k: v for k, v in opt_tensors.items()})
    for k, v in want.items():
        tm = md.state_dict_metadata[k]
        if not isinstance(tm, TensorStorageMetadata) or list(tm.size) != list(v.shape):
            raise CheckpointMismatchError(f"{os.path.join(ckpt_dir, DCP_METADATA)}: {k} has shape "
                                          f"{list(getattr(tm, 'size', []))} in the checkpoint, {list(v.shape)} here")
        saved_dtype = getattr(getattr(tm, "properties", None), "dtype", None)
        if k.startswith(OPTIM_PREFIX) and torch.is_tensor(v) and saved_dtype != v.dtype:  # DCP would cast it silently
            raise DCPCheckpointError(f"{os.path.join(ckpt_dir, DCP_METADATA)}: optimizer state {k[len(OPTIM_PREFIX):]} is "
                                     f"saved as {saved_dtype}, this optimizer keeps {v.dtype}: refused rather than cast")

    dcp_load(want, ckpt_dir, group)

    set_model_state_dict(model, {k[len(MODEL_PREFIX):]: v for k, v in want.items() if k.startswith(MODEL_PREFIX)})
    if optimizer is not None:
        saved_scalars = meta["optimizer"]
        adamw = dict(opt_sd["adamw"])
        adamw.update({k[len(OPTIM_PREFIX):]: v for k, v in want.items() if k.startswith(OPTIM_PREFIX)})
        try:
            optimizer.load_state_dict({"format": saved_scalars["format"], "lr": saved_scalars["lr"],
                                       "scaler": saved_scalars["scaler"],
                                       "prev_grad_norm": saved_scalars["prev_grad_norm"], "adamw": adamw})
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise DCPCheckpointError(f"{os.path.join(ckpt_dir, DCP_MANIFEST)}: the optimizer's saved scalars do "
                                     f"not load ({type(e).__name__}: {one_line(e)[:200]})") from e
    group_barrier(group)
    return meta


def model_specs(ckpt_dir: str, md: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    specs = {}
    for k, v in md.state_dict_metadata.items():
        if not k.startswith(MODEL_PREFIX):
            continue
        dtype = getattr(getattr(v, "properties", None), "dtype", None)
        size = getattr(v, "size", None)
        if not isinstance(v, TensorStorageMetadata) or not isinstance(dtype, torch.dtype) or size is None or \
                not all(isinstance(n, int) and n >= 0 for n in size):
            raise DCPCheckpointError(f"{os.path.join(ckpt_dir, DCP_METADATA)}: {k} is not described as a tensor "
                                     "(size, dtype)")
        specs[k[len(MODEL_PREFIX):]] = (tuple(size), dtype)
    return specs


def load_full_model_state_dict(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights of a DCP checkpoint in ONE process, without a process group
    (export, inspection). It materialises the whole model in this process's memory: not streamed."""
    _, md = usable_checkpoint(ckpt_dir)
    out = {MODEL_PREFIX + k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in model_specs(ckpt_dir, md).items()}
    dcp_load(out, ckpt_dir, None)
    return {k[len(MODEL_PREFIX):]: v for k, v in out.items()}


def model_tensor_specs(ckpt_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the model weights in a DCP checkpoint, from its metadata only."""
    _, md = usable_checkpoint(ckpt_dir)
    return model_specs(ckpt_dir, md)


def load_model_tensors(ckpt_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Only the named model weights of a DCP checkpoint, whole, in this process (no process group):
    what a streaming export reads one group at a time, so memory holds one group, not the model."""
    specs = model_tensor_specs(ckpt_dir)
    missing = [n for n in names if n not in specs]
    if missing:
        raise DCPCheckpointError(f"checkpoint {ckpt_dir} has no model tensor(s) {missing[:3]}")
    out = {MODEL_PREFIX + n: torch.empty(specs[n][0], dtype=specs[n][1]) for n in names}
    dcp_load(out, ckpt_dir, None)
    out = {k[len(MODEL_PREFIX):]: v for k, v in out.items()}
    bad = first_nonfinite(out.items())
    if bad is not None:
        raise DCPCheckpointError(f"checkpoint {ckpt_dir}: {bad}")
    return out


# ---------------------------------------------------------------------------- a "dtensor" engine's state

def dtensor_json_files(job: SaveJob) -> dict:
    """The JSON sidecars of an engine's sharded checkpoint."""
    return {TRAINER_STATE: dict(job.trainer_state, step=job.step, world_size=job.world_size),
            MODEL_CONFIG: job.model_config, RUN_CONFIG: job.run_config}


def save_dtensor(engine: Any, job: SaveJob) -> str:
    """Collective: a "dtensor" engine's shards as this step's sharded checkpoint, pruned to keep_last (+ the
    best). In the background (--async_checkpoint): checkpoint/dcp_async.py's save_dtensor_async."""
    spec = engine.state_spec()
    path = save_dcp_checkpoint(checkpoint_root(job.out_dir), job.step, spec.model, spec.optimizer,
                               json_files=dtensor_json_files(job), rank_state=job.extra_state,
                               fault_hook=job.fault_hook)
    if job.rank == 0:
        prune_checkpoints(job.out_dir, keep_last=job.keep_last, keep_best=True, log=job.log)
    job.barrier()
    return path


def load_dtensor(engine: Any, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
                 log: Callable[[str], None] = print) -> Optional[dict]:
    """Collective: a sharded checkpoint of any world size into a "dtensor" engine; this rank's extra state."""
    spec = engine.state_spec()
    with agreed_reads(spec.model):  # this rank's own file, before DCP's collective read
        extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log)
    load_dcp_checkpoint(ckpt_dir, spec.model, spec.optimizer)
    refuse_nonfinite_weights(spec.model, ckpt_dir)
    return extra
