"""The plain format: a "replicated" engine's state (our DDP / ZeRO: parallel/engine_ddp.py) as files.

  model.safetensors           full model weights (rank 0; expert-parallel shards gathered by the engine's
                              prepare_state, every rank), or only the trainable tensors of a LoRA run whose base is
                              a file (trainer_state.json's lora_base names the base and its fingerprint)
  model_config.json           the architecture, so a checkpoint is self-describing
  optimizer_rank{r}.pt        optimizer (+ loss scaler) state: rank 0's, or one per rank when ZeRO shards it or
                              experts are split over expert-parallel ranks (ranges of the full tensors)
  extra_rank{r}.pt            RNG states of rank r and its comm-hook (PowerSGD) state
  trainer_state.json          step, data cursor, schedule position, best val loss, world size...
  config.json                 the resolved run configuration (read as JSON, never executed)
  manifest.json, COMPLETE     checkpoint/protocol.py's

Loading re-shards ZeRO state at another world size; a sharded (DCP) checkpoint of --parallel=fsdp is converted per
parameter name (checkpoint/convert.py).

Owns: these files, written (synchronously, or by the background writer) and read into the engine.
Must never: unpickle arbitrary objects, or mark a checkpoint complete before every rank wrote.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from safetensors.torch import save_file

from checkpoint.async_writer import AsyncCheckpointer, save_in_background
from checkpoint.files import load_model_state
from checkpoint.protocol import (SaveGuard, SaveJob, agreed_phase, agreement, prepare_step_dir, publish_checkpoint_dir,
                                 save_guard, step_dir_paths)
from checkpoint.reads import (agreed_reads, check_optimizer_state, load_errors_named, load_extra_state,
                              load_optimizer_state, load_weights, read_optimizer_state)
from checkpoint.verify import prune_checkpoints, remember_verified
from parallel.engine import trainable_state
from utils.checkpoint_json import write_json
from utils.checkpoint_layout import (MANIFEST, MODEL_CONFIG, MODEL_FILE, RUN_CONFIG, TRAINER_STATE, checkpoint_root,
                                     extra_file, optimizer_file)
from utils.errors import CheckpointMismatchError
from utils.publish import fsync_file


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


def write_rank_files(tmp: str, req: SaveRequest, guard: SaveGuard,
                     fault_hook: Optional[Callable[[], None]] = None, copy_weights: bool = True) -> None:
    """This rank's files of a checkpoint into `tmp` (written and fsynced): rank 0 the weights and the JSON
    sidecars, every rank holding optimizer state its optimizer file, every rank its extra (RNG) file.
    Shared by the synchronous save and the background writer (checkpoint/async_writer.py), whose weights are
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


def publish_rank0(out_dir: str, tmp: str, final: str, req: SaveRequest, guard: SaveGuard) -> None:
    """Rank 0, once every rank's files are in `tmp`: trainer_state.json, then the manifest, COMPLETE, fsync
    and the atomic rename (publish_checkpoint_dir); the directory is remembered as verified."""
    trainer_state = dict(req.trainer_state, step=req.step, world_size=req.world_size, saved_at=time.time())
    guard.file = os.path.join(tmp, TRAINER_STATE)
    write_json(guard.file, trainer_state)
    guard.file = os.path.join(tmp, MANIFEST)
    publish_checkpoint_dir(tmp, final, req.step)


def save_checkpoint(out_dir: str, req: SaveRequest, barrier: Optional[Callable[[], None]] = None,
                    keep_last: int = 3, keep_best: bool = True,
                    fault_hook: Optional[Callable[[], None]] = None,
                    log: Callable[[str], None] = print) -> str:
    """Collective (`barrier` given: every rank calls this with its own SaveRequest), or one process alone (no
    barrier). Each phase ends in one verdict of every rank (checkpoint/protocol.agreed_phase): a write that does
    not fit at any rank is exit 7 at every rank. Returns the final directory."""
    root = checkpoint_root(out_dir)
    final, tmp = step_dir_paths(root, req.step)
    agree = agreement(barrier is not None)
    with save_guard(root, req.step) as guard:
        prepare_step_dir(guard, req.rank, agree)
        with agreed_phase(guard, agree):  # every rank has written and fsynced its files
            write_rank_files(tmp, req, guard, fault_hook)
        with agreed_phase(guard, agree):
            if req.rank == 0:
                publish_rank0(out_dir, tmp, final, req, guard)
    if req.rank == 0:
        remember_verified(final)
        prune_checkpoints(out_dir, keep_last=keep_last, keep_best=keep_best, log=log)
    _barrier(barrier)
    return final



def save_checkpoint_async(out_dir: str, req: SaveRequest, writer: AsyncCheckpointer,
                          barrier: Optional[Callable[[], None]] = None, keep_last: int = 3, keep_best: bool = True,
                          fault_hook: Optional[Callable[[], None]] = None,
                          log: Callable[[str], None] = print) -> str:
    """save_checkpoint in the background: `req` holds host snapshots (writer.buffers) that nothing changes
    afterwards; the files are write_rank_files'."""
    return save_in_background(
        out_dir, req.step, req.rank, req.world_size, writer,
        write_files=lambda tmp, guard: write_rank_files(tmp, req, guard, fault_hook, copy_weights=False),
        publish=lambda tmp, final, guard: publish_rank0(out_dir, tmp, final, req, guard),
        barrier=barrier, keep_last=keep_last, keep_best=keep_best, log=log)


# ---------------------------------------------------------------------------- the engine's state

def save_replicated(engine: Any, job: SaveJob, writer: Optional[AsyncCheckpointer] = None) -> str:
    """Collective: a "replicated" engine's state as this step's checkpoint. writer (--async_checkpoint): wait for
    the previous save, copy the state into the writer's host buffers here, and let its thread write and publish;
    the path returned is where the checkpoint will appear."""
    if writer is not None:
        writer.wait()  # at most one save in flight: the previous one is published (or its error raised)
    engine.prepare_state()
    spec = engine.state_spec()
    extra_state = dict(job.extra_state, **engine.rank_state())
    trainer_state, run_config, model_config = job.trainer_state, job.run_config, job.model_config
    if spec.lora_base is not None:
        trainer_state = dict(trainer_state, lora_base=spec.lora_base)
    model_state = None
    if job.rank == 0:
        model_state = trainable_state(spec.model) if spec.lora_base is not None else spec.model.state_dict()
    # async: the live state's views, copied once into the writer's reused (pinned) buffers just below
    optimizer_state = spec.optimizer.state_dict(to_host=writer is None) \
        if spec.sharded_optimizer or job.rank == 0 else None
    if writer is not None:  # host copies now, the files in the background
        model_state, optimizer_state, extra_state, trainer_state, run_config, model_config = writer.snapshot(
            {"model": model_state, "optimizer": optimizer_state, "extra": extra_state},
            trainer_state, run_config, model_config)
    req = SaveRequest(step=job.step, rank=job.rank, world_size=job.world_size, model_state=model_state,
                      model_config=model_config, optimizer_state=optimizer_state, extra_state=extra_state,
                      trainer_state=trainer_state, run_config=run_config)
    kw = dict(barrier=job.barrier, keep_last=job.keep_last, fault_hook=job.fault_hook, log=job.log)
    if writer is not None:
        return save_checkpoint_async(job.out_dir, req, writer, **kw)
    return save_checkpoint(job.out_dir, req, **kw)


def load_replicated(engine: Any, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
                    log: Callable[[str], None] = print) -> Optional[dict]:
    """Collective: a plain checkpoint's weights, optimizer and comm-hook state into a "replicated" engine (ZeRO
    re-shards at another world size); this rank's extra state when the world size is the saved one."""
    spec = engine.state_spec()
    # every file this rank reads, read and checked before any collective; then one collective of every
    # rank's verdict, so that a file damaged at one rank is the same line at all of them
    with agreed_reads(spec.model):
        weights = load_model_state(ckpt_dir)
        opt_state = read_optimizer_state(ckpt_dir, spec.sharded_optimizer, rank, world_size, saved_world,
                                         own_fits=getattr(spec.optimizer, "fits_own_state", None))
        extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log, same_world_only=False)
    # the weights (one file, the same at every rank: the same verdict everywhere); a configuration that builds
    # another model is CheckpointMismatchError (exit 2) here, before the optimizer could call it a damaged file
    load_weights(spec.model, weights, partial=spec.lora_base is not None, source=ckpt_dir,
                 mismatch=CheckpointMismatchError)
    with agreed_reads(spec.model):  # what this rank's optimizer file(s) would refuse, before ZeRO's re-gather
        check_optimizer_state(spec.optimizer, ckpt_dir, opt_state)
    load_optimizer_state(spec.optimizer, ckpt_dir, opt_state)
    if extra is not None and extra.get("comm_hook"):
        with load_errors_named(f"{os.path.join(ckpt_dir, extra_file(rank))}: its comm-hook (PowerSGD) state "
                               "does not load"):
            engine.load_rank_state(extra)
    return extra if saved_world == world_size else None
