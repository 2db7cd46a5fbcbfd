"""The trainer's one interface to checkpoints: `CheckpointManager` saves and loads an engine's state (the weights
and the optimizer's, through the objects its `state_spec()` names), each rank's RNG and engine state, and the
trainer's state (step, data cursor = the loader's state_dict(), schedule position, ...) in the format the
engine's state layout calls for; the engine never sees a file.

    manager = CheckpointManager(engine, out_dir, rank=r, world_size=n, device=device, keep_last=3,
                                async_writes=cfg.async_checkpoint, log=log)
    manager.save(step, trainer_state={...}, model_config=..., run_config=...)   # collective
    problem = manager.resume_problem(ckpt_dir, saved_world)                    # before loading
    extra = manager.load(ckpt_dir, saved_world)                                # collective; {"rng": ...} or None
    manager.wait()                                                             # --async_checkpoint: the write in flight
    manager.close()

Formats by state layout (parallel/engine.py StateSpec): "replicated" (our DDP / ZeRO) -> checkpoint/plain.py;
"dtensor" (FSDP2) -> checkpoint/dcp.py (sharded, any world size); "stages" (pipeline) -> checkpoint/pipeline.py.
"replicated" and "dtensor" resume each other's checkpoints, converted per parameter name (checkpoint/convert.py);
a pipeline checkpoint resumes only under its own stages.

Owns: choosing the format, the RNG and engine state each rank saves beside its files, the background writer of
--async_checkpoint. Must never: decide what the trainer's state holds, or write a file itself (the formats do).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from checkpoint.async_writer import AsyncCheckpointer
from checkpoint.convert import load_dcp_into_replicated, load_plain_into_dtensor
from checkpoint.dcp import load_dtensor, save_dtensor
from checkpoint.dcp_async import save_dtensor_async
from checkpoint.pipeline import (load_pipeline_into_replicated, load_stages, other_layout_problem, save_stages,
                                 stages_resume_problem)
from checkpoint.plain import load_replicated, save_replicated
from checkpoint.protocol import SaveJob
from checkpoint.reads import is_pipeline_checkpoint, is_sharded_checkpoint
from checkpoint.rng import capture_rng_state
from utils.errors import CheckpointError


class CheckpointManager:
    """Saves and loads one engine's state and the trainer's, under `<out_dir>/checkpoints`."""

    def __init__(self, engine: Any, out_dir: str, *, rank: int = 0, world_size: int = 1,
                 device: Optional[torch.device] = None, keep_last: int = 3, async_writes: bool = False,
                 log: Callable[[str], None] = print, barrier: Optional[Callable[[], None]] = None) -> None:
        self.engine, self.out_dir, self.rank, self.world_size = engine, out_dir, rank, world_size
        self.device = device if device is not None else torch.device("cpu")
        self.keep_last, self.log, self.barrier = keep_last, log, barrier or (lambda: None)
        # --async_checkpoint: the background writer and its reused host buffers (checkpoint/async_writer.py)
        self.writer = AsyncCheckpointer(log, rank=rank, world_size=world_size, device=self.device) \
            if async_writes else None

    @property
    def layout(self) -> str:
        return self.engine.state_spec().layout

    # ------------------------------------------------------------------ saving
    def save(self, step: int, *, trainer_state: dict, model_config: dict, run_config: dict,
             rank_state: Optional[dict] = None, fault_hook: Optional[Callable[[], None]] = None) -> str:
        """Collective: this step's checkpoint (the engine's state, every rank's RNG and `rank_state`, `trainer_state`
        recorded with the step and the world size), published atomically, pruned to keep_last (+ the best by
        val_loss). Returns its path; with --async_checkpoint, where it will appear once the background write
        publishes it. load() returns this rank's {"rng": ..., **rank_state}."""
        job = SaveJob(self.out_dir, step, trainer_state, model_config, run_config,
                      extra_state=dict(rank_state or {}, rng=capture_rng_state(self.device)), rank=self.rank,
                      world_size=self.world_size, keep_last=self.keep_last, barrier=self.barrier,
                      fault_hook=fault_hook, log=self.log)
        layout = self.layout
        if layout == "replicated":
            return save_replicated(self.engine, job, self.writer)
        if layout == "stages":
            return save_stages(self.engine, job, self.writer)
        if layout == "dtensor":
            return save_dtensor(self.engine, job) if self.writer is None else \
                save_dtensor_async(self.engine, job, self.writer)
        raise ValueError(f"an engine state layout this package has no format for: {layout!r}")

    @property
    def last_wait_s(self) -> float:
        """How long the last save waited for the previous background write (0 without --async_checkpoint)."""
        return self.writer.last_wait_s if self.writer is not None else 0.0

    def wait(self, failing: bool = False) -> None:
        """--async_checkpoint: wait for the write in flight (end of the run, SIGTERM); a failed write raises here
        (DiskFullError exit 7, else a crash). failing: the run is already ending on another error, so the write
        is waited for (a newer checkpoint for the restart) and its error only logged."""
        if self.writer is not None:
            self.writer.wait(agree=not failing, raise_errors=not failing)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()  # waited for already (wait); frees the host buffers

    # ------------------------------------------------------------------ loading
    def resume_problem(self, ckpt_dir: str, saved_world: int) -> Optional[str]:
        """Why this engine cannot resume `ckpt_dir` (saved by `saved_world` processes), or None."""
        spec = self.engine.state_spec()
        if spec.layout == "stages":
            return stages_resume_problem(spec.stages, ckpt_dir)
        if is_pipeline_checkpoint(ckpt_dir):  # our DDP resumes a pipeline of our DDP's stages
            return other_layout_problem(ckpt_dir, "this run (no pipeline)" if spec.layout == "replicated" else None)
        return None

    def load(self, ckpt_dir: str, saved_world: int, log: Optional[Callable[[str], None]] = None) -> Optional[dict]:
        """Collective: the weights, optimizer and engine state of `ckpt_dir` into the engine; returns this rank's
        extra state ({"rng": ...}) or None. The model must already hold the LoRA base when the checkpoint is
        light. CheckpointError naming the file when a file is damaged, CheckpointMismatchError when an intact
        checkpoint holds other tensor names or shapes than this model. A missing extra_rank{r}.pt at the same
        world size is logged (through `log`, on every rank) and returns None."""
        log = log or self.log
        problem = self.resume_problem(ckpt_dir, saved_world)
        if problem:
            raise CheckpointError(problem)
        args = (self.engine, ckpt_dir, saved_world, self.rank, self.world_size, log)
        layout = self.layout
        if layout == "stages":
            return load_stages(*args)
        sharded = is_sharded_checkpoint(ckpt_dir)
        if layout == "replicated" and is_pipeline_checkpoint(ckpt_dir):
            return load_pipeline_into_replicated(*args)
        if layout == "replicated":
            return load_dcp_into_replicated(*args) if sharded else load_replicated(*args)
        if layout == "dtensor":
            return load_dtensor(*args) if sharded else load_plain_into_dtensor(*args)
        raise ValueError(f"an engine state layout this package has no format for: {layout!r}")
