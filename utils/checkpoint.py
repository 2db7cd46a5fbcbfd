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
fsyncs, then `os.replace`s the directory into place (utils/publish.py's temp names, fsync and
publish_dir; a re-saved step swaps the old directory aside to `step_X.old` first). A crash at any
instant leaves either the previous checkpoints untouched or a `.tmp` directory that loading ignores.
Full disk (`save_guard`): a save starts only when the filesystem has as much free space as the last
checkpoint takes; a write that does not fit anyway (disk or quota full, RLIMIT_FSIZE) removes the
partial `.tmp` directory and raises DiskFullError (utils/disk_space.py, exit 7, not retried).

Verification (`verify_checkpoint`) also checks that manifest.json names only files of the directory
and that the JSON sidecars parse with the shape every reader relies on; the readers here
(`read_trainer_state`, `read_checkpoint_json`, `load_tensor_file`, ...; model/config.py's `read_model_config`) raise CheckpointError naming the
file for anything else that does not load. Every damaged case and what each command does with it:
docs/errors.md, "Damaged checkpoints".

Must never: unpickle arbitrary objects (tensors use safetensors or `torch.load(weights_only=True)`),
write into a live checkpoint directory, or mark a checkpoint complete before every rank wrote.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pickle
import random
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

# The layout (every directory and file name) is utils/checkpoint_layout.py's (torch-free, so the CLIs'
# pre-checks and the monitor read it too); re-exported here for the callers that import it from ckpt.
from utils.checkpoint_layout import (CKPT_SUBDIR, COMPLETE_MARKER, DCP_MANIFEST, MANIFEST, MODEL_CONFIG,  # noqa: E402,F401
                                     MODEL_FILE, PIPELINE_META, RUN_CONFIG, RUN_START, SIDECARS, STEP_PREFIX,
                                     TRAINER_STATE, checkpoint_root, extra_file, optimizer_file, parse_step,
                                     rank_file, step_dir_name)
from utils.run_dir import listed_checkpoints, misnamed_checkpoints  # noqa: E402,F401
from utils.errors import (CheckpointError, CheckpointMismatchError, DamagedCheckpointError,  # noqa: F401
                          one_line)  # re-exported: callers use ckpt.CheckpointError, ckpt.one_line
from utils.checkpoint_layout import plain_file_name  # noqa: F401 (re-exported)
from utils.constants import MAX_STEPS
from utils.model_bounds import bound_problems
from utils.disk_space import DiskFullError, free_bytes, human, is_disk_full, tree_bytes, writing
from utils.publish import atomic_write_json, fsync_file, make_temp_dir, publish_dir, temp_dir_for


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: str, obj: Any) -> None:
    """The checkpoint JSON files (indent 2, sorted keys, UTF-8, final newline), written atomically."""
    atomic_write_json(path, obj)


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


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


def _newest_complete(ckpt_root: str) -> Optional[str]:
    """The newest step_N directory under `ckpt_root` holding COMPLETE (unverified), or None."""
    try:
        names = os.listdir(ckpt_root)
    except OSError:
        return None
    steps = sorted((step, n) for n in names if (step := parse_step(n)) is not None)
    for _, name in reversed(steps):
        if os.path.isfile(os.path.join(ckpt_root, name, COMPLETE_MARKER)):
            return os.path.join(ckpt_root, name)
    return None


def check_space_for_save(ckpt_root: str, step: int) -> None:
    """Before a save writes anything: refuse (DiskFullError) when the filesystem holding `ckpt_root` has
    less free space than the newest complete checkpoint there takes, since the new one is about as large
    and is written beside the old ones (pruning follows the publish). No checkpoint yet: nothing to
    compare, the save goes ahead (a write that does not fit is still caught by `save_guard`)."""
    last = _newest_complete(ckpt_root)
    if last is None:
        return
    need, free = tree_bytes(last), free_bytes(ckpt_root)
    if free is not None and free < need:
        raise DiskFullError(
            f"not enough free space to save checkpoint {os.path.join(ckpt_root, step_dir_name(step))}: "
            f"{human(free)} free on {ckpt_root}, the last checkpoint ({os.path.basename(last)}) takes "
            f"{human(need)}; nothing was written and the checkpoints there are intact (free space or move "
            "--out_dir, then resume)")


class _SaveGuard:
    """What `save_guard` yields: the writer sets `file` before each write, for the message."""
    file: Optional[str] = None



def step_dir_paths(ckpt_root: str, step: int) -> tuple[str, str]:
    """(final, tmp) of step `step`'s checkpoint under `ckpt_root`: where it is published, and the temporary
    directory its files are written into first (utils/publish.py's convention)."""
    final = os.path.join(ckpt_root, step_dir_name(step))
    return final, temp_dir_for(final)


@contextlib.contextmanager
def save_guard(ckpt_root: str, step: int, check_space: bool = True) -> Iterator[_SaveGuard]:
    """Wrap one rank's part of a checkpoint save. Before: `check_space_for_save` (check_space=True, the
    rank that creates step_N.tmp). During: a write that does not fit (disk or quota full, RLIMIT_FSIZE;
    `is_disk_full`) removes the partial step_N.tmp, which can then never be published, and becomes one
    DiskFullError naming the file and the free space (exit 7); the published checkpoints are untouched."""
    final, tmp = step_dir_paths(ckpt_root, step)
    if check_space:
        check_space_for_save(ckpt_root, step)
    guard = _SaveGuard()
    try:
        yield guard
    except DiskFullError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # noqa: BLE001 - only a disk-full write is translated; anything else re-raises
        if not is_disk_full(e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        free = free_bytes(ckpt_root)
        raise DiskFullError(
            f"saving checkpoint {final} failed: writing {guard.file or tmp} did not fit (disk full or a file-size "
            f"limit: {one_line(e)[:160]}); {human(free)} free on {ckpt_root}; the partial {os.path.basename(tmp)} "
            "was removed and the earlier checkpoints are intact") from e


def publish_checkpoint_dir(tmp: str, final: str, step: int) -> None:
    """Rank 0, after every rank wrote into `tmp`: manifest (size + sha256 of every file), COMPLETE,
    fsync, then an atomic rename to `final` (an older directory of the same step is moved aside first).
    Shared by our checkpoints and the sharded DCP ones (parallel/dcp_checkpoint.py)."""
    manifest = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)), "sha256": _sha256(os.path.join(tmp, name))}
                for name in sorted(os.listdir(tmp))}
    write_json(os.path.join(tmp, MANIFEST), manifest)
    write_json(os.path.join(tmp, COMPLETE_MARKER), {"step": int(step)})
    # fsync, rename; re-saving a step (e.g. after resume) swaps the old directory aside first
    publish_dir(tmp, final, replace=True)


def write_rank_files(tmp: str, req: SaveRequest, guard: _SaveGuard,
                     fault_hook: Optional[Callable[[], None]] = None, copy_weights: bool = True) -> None:
    """This rank's files of a checkpoint into `tmp` (written and fsynced): rank 0 the weights and the JSON
    sidecars, every rank holding optimizer state its optimizer file, every rank its extra (RNG) file.
    Shared by the synchronous save and the background writer (utils/async_checkpoint.py), whose weights are
    already host copies of their own (copy_weights=False)."""
    if req.rank == 0:
        assert req.model_state is not None
        # safetensors refuses shared/non-contiguous storage (our params are views of one buffer)
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in req.model_state.items()} \
            if copy_weights else req.model_state
        path = guard.file = os.path.join(tmp, MODEL_FILE)
        save_file(tensors, path, metadata={"format": "pt", "step": str(req.step)})
        fsync_file(path)
        guard.file = os.path.join(tmp, MODEL_CONFIG)
        write_json(guard.file, req.model_config)
        guard.file = os.path.join(tmp, RUN_CONFIG)
        write_json(guard.file, req.run_config)
        if fault_hook is not None:
            fault_hook()  # test hook: die with a half-written checkpoint
    if req.optimizer_state is not None:
        path = guard.file = os.path.join(tmp, optimizer_file(req.rank))
        torch.save(req.optimizer_state, path)
        fsync_file(path)
    path = guard.file = os.path.join(tmp, extra_file(req.rank))
    torch.save(req.extra_state, path)
    fsync_file(path)


def write_extra_and_configs(tmp: str, rank: int, extra_state: Any, model_config: dict, run_config: dict,
                            fault_hook: Optional[Callable[[], None]] = None, guard: Any = None) -> None:
    """A stage checkpoint's per-rank extra (RNG) file, fsynced, and on rank 0 the model and run configs (the
    pipeline engine's synchronous save and its background writer alike); `guard.file` names the file being
    written where a guard is given."""
    path = os.path.join(tmp, extra_file(rank))
    if guard is not None:
        guard.file = path
    torch.save(extra_state, path)
    fsync_file(path)
    if rank == 0:
        write_json(os.path.join(tmp, MODEL_CONFIG), model_config)
        write_json(os.path.join(tmp, RUN_CONFIG), run_config)
        if fault_hook is not None:
            fault_hook()  # test hook: die with a half-written checkpoint


def publish_rank0(out_dir: str, tmp: str, final: str, req: SaveRequest, guard: _SaveGuard) -> None:
    """Rank 0, once every rank's files are in `tmp`: trainer_state.json, then the manifest, COMPLETE, fsync
    and the atomic rename (publish_checkpoint_dir); the directory is remembered as verified."""
    trainer_state = dict(req.trainer_state, step=req.step, world_size=req.world_size, saved_at=time.time())
    guard.file = os.path.join(tmp, TRAINER_STATE)
    write_json(guard.file, trainer_state)
    guard.file = os.path.join(tmp, MANIFEST)
    publish_checkpoint_dir(tmp, final, req.step)


def remember_verified(final: str) -> None:
    """The manifest's hashes were computed from exactly these files: pruning need not hash them again."""
    sig = _signature(final)
    if sig is not None:
        _verified[final] = sig


def save_checkpoint(out_dir: str, req: SaveRequest, barrier: Optional[Callable[[], None]] = None,
                    keep_last: int = 3, keep_best: bool = True,
                    fault_hook: Optional[Callable[[], None]] = None,
                    log: Callable[[str], None] = print) -> str:
    """Collective: every rank calls this with its own SaveRequest. Returns the final directory."""
    root = checkpoint_root(out_dir)
    final, tmp = step_dir_paths(root, req.step)
    with save_guard(root, req.step, check_space=req.rank == 0) as guard:
        if req.rank == 0:
            make_temp_dir(final)  # one left by a crash was never complete: dropped
        _barrier(barrier)
        write_rank_files(tmp, req, guard, fault_hook)
        _barrier(barrier)  # every rank has written and fsynced its files
        if req.rank == 0:
            publish_rank0(out_dir, tmp, final, req, guard)
    if req.rank == 0:
        remember_verified(final)
        prune_checkpoints(out_dir, keep_last=keep_last, keep_best=keep_best, log=log)
    _barrier(barrier)
    return final


def list_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every finished-looking directory, newest first (not yet verified)."""
    return listed_checkpoints(out_dir)


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
                v = read_json(os.path.join(p, TRAINER_STATE)).get("val_loss")
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _json_problem(path: str) -> tuple[Any, Optional[str]]:
    """(the parsed JSON of `path`, None) or (None, why it cannot be read), naming the file."""
    name = os.path.basename(path)
    try:
        return read_json(path), None
    except UnicodeDecodeError:
        return None, f"{name} is not UTF-8 text"
    except ValueError as e:
        return None, f"{name} is not valid JSON ({one_line(e)[:160]})"
    except OSError as e:
        return None, f"{name} cannot be read ({one_line(e)[:160]})"


def _manifest_problem(path: str, check_hashes: bool) -> Optional[str]:
    """None when manifest.json is a JSON object {file: {"bytes": int, "sha256": str}} naming only files
    of this directory, each present with that size (and hash), else the reason."""
    manifest, problem = _json_problem(os.path.join(path, MANIFEST))
    if problem:
        return problem
    if not isinstance(manifest, dict):
        return (f"{MANIFEST} holds a {type(manifest).__name__}, not a JSON object of "
                "file -> {bytes, sha256}")
    if not manifest:
        return f"{MANIFEST} lists no file"
    for name, info in manifest.items():
        if not plain_file_name(name):
            return f"{MANIFEST} names {name!r}, which is not a file of the checkpoint directory"
        if not isinstance(info, dict) or not _is_int(info.get("bytes")) or not isinstance(info.get("sha256"), str):
            return f"{MANIFEST}: the entry of {name} is not {{\"bytes\": int, \"sha256\": str}}"
    for name, info in manifest.items():
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            return f"missing file {name}"
        size = os.path.getsize(fp)
        if size != info["bytes"]:
            return f"{name} has {size} bytes, manifest says {info['bytes']} (truncated?)"
        if check_hashes and _sha256(fp) != info["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
    return None


# JSON sidecars every reader parses (SIDECARS): each must be a JSON object; trainer_state.json also records the
# step and the world size of the save (the checkpoint protocol; the rest is checked where it is read).
MAX_WORLD = 10 ** 6  # ranks a checkpoint may record having been saved by


def trainer_state_problem(state: Any, required: tuple[str, ...] = ()) -> Optional[str]:
    """None when a parsed trainer_state.json has the shape every reader relies on, else the reason.
    The step and world size are checked when present (a library caller of save_dcp_checkpoint may
    write its own sidecar), and must be there when named in `required` (the trainer's resume)."""
    if not isinstance(state, dict):
        return f"{TRAINER_STATE} holds a {type(state).__name__}, not a JSON object"
    # bounded: "step": 10**30 would end the run at once as "done"; no run takes more than MAX_STEPS steps,
    # and no world has more than MAX_WORLD ranks
    for key, low, high in (("step", 0, MAX_STEPS), ("world_size", 1, MAX_WORLD), ("data_step", 0, 2 * MAX_STEPS)):
        v = state.get(key)
        if (key in state or key in required) and (not _is_int(v) or not low <= v <= high):
            return f"{TRAINER_STATE}: {key}={v!r} is not an integer in [{low}, {high}]"
    v = state.get("tokens_seen")
    if v is not None and not isinstance(v, bool) and isinstance(v, (int, float)) and not 0 <= v < 1e30:
        return f"{TRAINER_STATE}: tokens_seen={v!r} is not a count of tokens (0 <= n < 1e30)"
    for key in ("val_loss", "best_val_loss"):
        v = state.get(key)
        if isinstance(v, float) and not math.isfinite(v):
            return f"{TRAINER_STATE}: {key}={v!r} is not a finite number"
    for key, types_ in (("init_info", dict), ("lora_base", dict), ("data_cursor", dict),
                        ("val_loss", (int, float)), ("best_val_loss", (int, float)), ("tokens_seen", (int, float))):
        v = state.get(key)
        if v is not None and (not isinstance(v, types_) or isinstance(v, bool)):
            return f"{TRAINER_STATE}: {key}={v!r} is not a {getattr(types_, '__name__', 'number')}"
    for key in ("init_info", "lora_base"):
        sub = state.get(key)
        if isinstance(sub, dict) and not isinstance(sub.get("source"), str):
            return f"{TRAINER_STATE}: {key} records no source path"
    if isinstance(state.get("lora_base"), dict) and not isinstance(state["lora_base"].get("fingerprint"), str):
        return f"{TRAINER_STATE}: lora_base records no fingerprint"
    return None


PIPELINE_DP_ENGINES = ("ddp", "fsdp")  # the values pipeline.json's dp_engine field may hold


def pipeline_meta_problem(meta: Any) -> Optional[str]:
    """None when a parsed pipeline.json (parallel/pipeline.py's META_FILE) has the fields a resume and a merge
    read: pp_size, dp_size, n_layers integers >= 1, layer_ranges [start, end) pairs, dp_engine ddp or fsdp."""
    if not isinstance(meta, dict):
        return f"{PIPELINE_META} holds a {type(meta).__name__}, not a JSON object"
    for key in ("pp_size", "dp_size", "n_layers"):
        v = meta.get(key)
        if not _is_int(v) or not 1 <= v <= MAX_WORLD:
            return f"{PIPELINE_META}: {key}={v!r} is not an integer >= 1"
    if "tp_size" in meta and (not _is_int(meta["tp_size"]) or not 1 <= meta["tp_size"] <= MAX_WORLD):
        return f"{PIPELINE_META}: tp_size={meta['tp_size']!r} is not an integer >= 1"
    ranges = meta.get("layer_ranges")
    if not isinstance(ranges, list) or len(ranges) != meta["pp_size"] or not all(
            isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) and 0 <= r[0] <= r[1] for r in ranges):
        return f"{PIPELINE_META}: layer_ranges={ranges!r} is not one [start, end) pair of layers per stage"
    if meta.get("dp_engine", "ddp") not in PIPELINE_DP_ENGINES:
        return f"{PIPELINE_META}: dp_engine={meta.get('dp_engine')!r} is not ddp or fsdp"
    return None


def _sidecar_problem(path: str) -> Optional[str]:
    if os.path.lexists(os.path.join(path, PIPELINE_META)):  # a pipeline checkpoint's layout
        data, problem = _json_problem(os.path.join(path, PIPELINE_META))
        problem = problem or pipeline_meta_problem(data)
        if problem:
            return problem
    for name in SIDECARS:
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            continue
        data, problem = _json_problem(fp)
        if problem:
            return problem
        if name == TRAINER_STATE:
            problem = trainer_state_problem(data)
            if problem:
                return problem
        elif not isinstance(data, dict):
            return f"{name} holds a {type(data).__name__}, not a JSON object"
    return None


def _link_problem(path: str) -> Optional[str]:
    """A checkpoint is its own directory's files: a symbolic link that leaves it (a model.safetensors, or the
    whole step_N, linked to another run's files) is refused, never followed without a word."""
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    if os.path.islink(path) and os.path.dirname(os.path.realpath(path)) != parent:
        return f"{os.path.basename(path)} is a symbolic link to {os.path.realpath(path)}, outside {parent}: refused"
    real = os.path.realpath(path)
    try:
        entries = list(os.scandir(path))
    except OSError:
        return None  # named by the checks that follow
    for e in entries:
        if e.is_symlink():
            target = os.path.realpath(e.path)
            if os.path.dirname(target) != real:
                return f"{e.name} is a symbolic link to {target}, outside the checkpoint directory: refused"
    return None


def verify_checkpoint(path: str, check_hashes: bool = True, trust_cache: bool = False) -> Optional[str]:
    """None when the directory is complete, matches its manifest and its JSON files have the shape
    every reader relies on (and, for a sharded checkpoint, DCP's index and every rank's shard are
    there, confined to the directory), else the reason, naming the file.

    trust_cache: accept a directory this process already hashed (or wrote) whose files still have
    the same names, sizes and mtimes, without hashing it again (pruning does; loading never does).
    """
    sig = _signature(path)
    if trust_cache and sig is not None and _verified.get(path) == sig:
        return None
    _verified.pop(path, None)
    problem = _link_problem(path)
    if problem is not None:
        return problem
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        return "no COMPLETE marker (save was interrupted)"
    problem = _manifest_problem(path, check_hashes) or _sidecar_problem(path)
    if problem is not None:
        return problem
    if os.path.isfile(os.path.join(path, DCP_MANIFEST)):  # sharded (DCP): DCP's index and every rank's shard
        from utils.dcp_files import dcp_dir_problem  # here: torch.distributed.checkpoint takes ~2 s to import, which
        # commands that never meet a sharded checkpoint (sample.py, eval_lm.py) should not pay
        problem = dcp_dir_problem(path)
        if problem is not None:
            return problem
    if check_hashes and sig is not None and sig == _signature(path):
        _verified[path] = sig
    return None


def find_latest_valid(out_dir: str, log: Callable[[str], None] = print,
                      check_hashes: bool = True) -> Optional[str]:
    """Newest complete, undamaged checkpoint; damaged ones are reported and skipped, and so are directories
    whose name disagrees with the step their trainer_state.json records (utils/run_dir.misnamed_checkpoints)."""
    for path, recorded in misnamed_checkpoints(out_dir):
        log(f"[checkpoint] ignoring {path}: its trainer_state.json records step {recorded}, not the step its name "
            f"says (a copy under another name?); it is neither loaded nor pruned")
    for step, path in list_checkpoints(out_dir):
        problem = verify_checkpoint(path, check_hashes=check_hashes)
        if problem is None:
            return path
        log(f"[checkpoint] skipping {path}: {problem}")
    return None


def resolve_checkpoint_dir(path: str, log: Callable[[str], None] = print) -> Optional[str]:
    """Accept a checkpoint directory itself or a run directory holding checkpoints/.
    A checkpoint directory that fails verification raises DamagedCheckpointError (exit 5)."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        problem = verify_checkpoint(path)
        if problem:
            raise DamagedCheckpointError(f"checkpoint {path} is not usable: {problem}")
        return path
    return find_latest_valid(path, log=log)


def selection_exit_code(e: CheckpointError, path: str, which: str = "latest") -> int:
    """Exit code of a failed choice of checkpoint (`--ckpt=path --checkpoint=which`): 5 when what was
    asked for exists but is damaged (a checkpoint directory failing verification; step_N, latest or
    best when every checkpoint there fails it), 2 when it names nothing (no such step, no run)."""
    from utils.constants import EXIT_BAD_CHECKPOINT, EXIT_BAD_CONFIG
    if isinstance(e, DamagedCheckpointError):
        return EXIT_BAD_CHECKPOINT
    which = (which or "latest").strip()
    found = list_checkpoints(path) if os.path.isdir(path) else []
    digits = which[len(STEP_PREFIX):] if which.startswith(STEP_PREFIX) else which.removeprefix("step")
    if digits.isdigit():
        found = [(s, p) for s, p in found if s == int(digits)]
    elif which not in ("latest", "best"):
        return EXIT_BAD_CONFIG
    damaged = bool(found) and all(verify_checkpoint(p) is not None for _, p in found)
    return EXIT_BAD_CHECKPOINT if damaged else EXIT_BAD_CONFIG


def read_checkpoint_json(ckpt_dir: str, name: str) -> dict:
    """A JSON object sidecar of a checkpoint (config.json, model_config.json, trainer_state.json);
    CheckpointError naming the file when it is missing, not JSON or not an object, or (model_config.json)
    a size field is out of utils/model_bounds.py's bounds."""
    data, problem = _json_problem(os.path.join(ckpt_dir, name))
    if problem is None and not isinstance(data, dict):
        problem = f"{name} holds a {type(data).__name__}, not a JSON object"
    if problem is None and name == TRAINER_STATE:
        problem = trainer_state_problem(data)
    if problem is None and name == MODEL_CONFIG:  # "n_layers": 1000000 would build layers until OOM
        bounds = bound_problems(data)
        problem = f"{MODEL_CONFIG}: {'; '.join(bounds)}" if bounds else None
    if problem:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {problem}")
    return data


def read_trainer_state(ckpt_dir: str, required: tuple[str, ...] = ()) -> dict:
    """trainer_state.json of a checkpoint, its shape checked; `required`: keys that must be there
    (the trainer's resume needs step and world_size). CheckpointError naming the file otherwise."""
    state = read_checkpoint_json(ckpt_dir, TRAINER_STATE)
    problem = trainer_state_problem(state, required)
    if problem:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {problem}")
    return state


def load_model_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """model.safetensors of a checkpoint; CheckpointError naming the file when it cannot be read or a
    tensor holds NaN or inf (a finite run never saves one: the file was damaged or tampered with)."""
    path = os.path.join(ckpt_dir, MODEL_FILE)
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


def rng_state_problem(state: Any) -> Optional[str]:
    """None when `state` (from capture_rng_state) can be restored, else why. Tried on this process's
    generators and put back, so that a damaged file is named at load, not when the loop starts."""
    if not isinstance(state, dict):
        return f"the RNG state is a {type(state).__name__}, not a dict of tensors"
    if "device" in state and not torch.is_tensor(state["device"]):
        return "the device RNG state is not a tensor"
    cpu = torch.device("cpu")
    before = capture_rng_state(cpu)
    try:
        restore_rng_state(state, cpu)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError, OverflowError) as e:
        return f"the RNG state does not restore ({type(e).__name__}: {one_line(e)[:160]})"
    finally:
        restore_rng_state(before, cpu)
    return None


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
