"""Our DistributedDataParallel (buckets, comm hooks, PowerSGD) + MixedPrecisionOptimizer, or the ZeRO-1/2
DistributedOptimizer (--use_distributed_optimizer), as the trainer's engine: `DDPEngine` and its builder.

Checkpoints: utils/checkpoint.py (full weights in model.safetensors from rank 0, optimizer state per rank when
sharded; re-sharded at another world size). A --parallel=fsdp (DCP) checkpoint resumes here too: its weights and
AdamW state converted per parameter name (parallel/resume_across_engines.py). LoRA runs whose base is a file store only the trainable tensors
(parallel/checkpoint_io.py `trainable_state`).

Owns: wrapping a model in our DDP with the configured comm hook, and this engine's checkpoint format.
Must never: hold the micro-batch loop (parallel/engine.py's) or the optimizer's step (optimizer/).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from optimizer import OptimizerConfig, build_optimizer
from parallel.checkpoint_io import (agreed_reads, is_sharded_checkpoint, load_errors_named, load_extra_state,
                                    load_optimizer_state, load_weights, read_optimizer_state, trainable_state)
from parallel.comm_hooks import allreduce_hook, bf16_compress_wrapper, fp16_compress_wrapper, reduce_scatter_hook
from parallel.config import CAPABILITIES, ParallelConfig
from parallel.distributed_data_parallel import DDPConfig, DistributedDataParallel
from parallel.engine import Engine
from parallel.powersgd import PowerSGDState, powersgd_hook
from parallel.resume_across_engines import ddp_optimizer_state, load_full_training_state
from utils import checkpoint as ckpt
from utils.async_checkpoint import save_checkpoint_async
from utils.checkpoint_layout import extra_file


@dataclass
class DDPEngine(Engine):
    """Our DistributedDataParallel + MixedPrecisionOptimizer, or ZeRO-1/2 (DistributedOptimizer).
    Checkpoints: utils/checkpoint.py (full weights from rank 0, or only the trainable tensors of a LoRA
    run whose base is a file; optimizer state per rank when sharded, re-sharded at another world size)."""
    kind: ClassVar[str] = "ddp"
    capabilities: ClassVar[frozenset] = CAPABILITIES["ddp"]

    def save(self, out_dir: str, step: int, *, rank: int, world_size: int, model_config: dict,
             trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
             barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]] = None,
             log: Callable[[str], None] = print, writer: Any = None) -> str:
        if writer is not None:
            writer.wait()  # at most one save in flight: the previous one is published (or its error raised)
        self.optimizer.finish_param_sync()  # ZeRO + overlapped gather: parameters complete before reading them
        hook_state = self.model.comm_hook_state_dict()
        if hook_state:
            extra_state = dict(extra_state, comm_hook=hook_state)
        if self.lora_base is not None:
            trainer_state = dict(trainer_state, lora_base=self.lora_base)
        model_state = None
        if rank == 0:
            model_state = trainable_state(self.module) if self.lora_base is not None else self.module.state_dict()
        # async: the live state's views, copied once into the writer's reused (pinned) buffers just below
        optimizer_state = self.optimizer.state_dict(to_host=writer is None) \
            if self.sharded_optimizer or rank == 0 else None
        if writer is not None:  # --async_checkpoint: host copies now, the files in the background
            model_state, optimizer_state, extra_state, trainer_state, run_config, model_config = writer.snapshot(
                {"model": model_state, "optimizer": optimizer_state, "extra": extra_state},
                trainer_state, run_config, model_config)
        req = ckpt.SaveRequest(step=step, rank=rank, world_size=world_size, model_state=model_state,
                               model_config=model_config, optimizer_state=optimizer_state,
                               extra_state=extra_state, trainer_state=trainer_state, run_config=run_config)
        if writer is not None:
            return save_checkpoint_async(out_dir, req, writer, barrier=barrier, keep_last=keep_last,
                                         fault_hook=fault_hook, log=log)
        return ckpt.save_checkpoint(out_dir, req, barrier=barrier, keep_last=keep_last, fault_hook=fault_hook, log=log)

    def load(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
             log: Callable[[str], None] = print) -> Optional[dict]:
        problem = self.resume_problem(ckpt_dir, saved_world, world_size)
        if problem:
            raise ckpt.CheckpointError(problem)
        if is_sharded_checkpoint(ckpt_dir):
            return self._load_fsdp_checkpoint(ckpt_dir, saved_world, rank, world_size, log)
        # every file this rank reads, read and checked before any collective; then one collective of every
        # rank's verdict, so that a file damaged at one rank is the same line at all of them
        with agreed_reads(self.module):
            weights = ckpt.load_model_state(ckpt_dir)
            opt_state = read_optimizer_state(ckpt_dir, self.sharded_optimizer, rank, world_size, saved_world)
            extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log, same_world_only=False)
        load_weights(self.module, weights, partial=self.lora_base is not None, source=ckpt_dir,
                     mismatch=ckpt.CheckpointMismatchError)
        load_optimizer_state(self.optimizer, ckpt_dir, self.sharded_optimizer, rank, world_size, saved_world,
                             read=opt_state)
        if extra is not None and extra.get("comm_hook"):
            with load_errors_named(f"{os.path.join(ckpt_dir, extra_file(rank))}: its comm-hook (PowerSGD) state "
                                   "does not load"):
                self.model.load_comm_hook_state_dict(extra["comm_hook"])
        return extra if saved_world == world_size else None

    def _load_fsdp_checkpoint(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
                              log: Callable[[str], None]) -> Optional[dict]:
        """A --parallel=fsdp (DCP) checkpoint resumed under our DDP: every rank reads the full weights and
        AdamW state in one process (parallel/resume_across_engines.py), converted per
        parameter name into this optimizer's format (one complete rank; ZeRO re-shards it)."""
        if self.lora_base is not None:
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir} was written by --parallel=fsdp, which saves whole "
                                       "models; a LoRA run whose base is a file resumes only its own light "
                                       "checkpoints: resume it with --parallel=fsdp")
        with agreed_reads(self.module):
            weights, state, scalars = load_full_training_state(ckpt_dir)
            extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log, same_world_only=False)
        load_weights(self.module, weights, partial=False, source=ckpt_dir, mismatch=ckpt.CheckpointMismatchError)
        if scalars is None:
            log(f"[resume] warning: {ckpt_dir} (--parallel=fsdp) records no optimizer state: resuming its weights "
                "under --parallel=ddp with FRESH AdamW moments (the next steps differ from the uninterrupted run's)")
        else:
            with load_errors_named(f"checkpoint {ckpt_dir}: its (--parallel=fsdp) optimizer state does not convert to "
                                   "this --parallel=ddp optimizer", ckpt.CheckpointMismatchError, width=300):
                self.optimizer.load_state_dict(ddp_optimizer_state(weights, state, scalars))
            log(f"[resume] {ckpt_dir} was written by --parallel=fsdp: its weights and optimizer state (AdamW's "
                "exp_avg, exp_avg_sq and step, Muon's momentum, per parameter) converted to --parallel=ddp")
        return extra if saved_world == world_size else None



def ddp_config(pc: ParallelConfig) -> DDPConfig:
    """Our DDP's buckets and reduction from the parallel section (also the pipeline stages' wrapper)."""
    return DDPConfig(bucket_size=pc.bucket_size, overlap_grad_reduce=pc.overlap_grad_reduce,
                     grad_reduce_in_fp32=pc.grad_reduce_in_fp32, use_distributed_optimizer=pc.use_distributed_optimizer)


def wrap_ddp(model: nn.Module, pc: ParallelConfig, group: Any = None) -> DistributedDataParallel:
    """`model` in our DDP over `group` (None: the world), dp rank 0's weights broadcast, the configured comm
    hook registered. "reduce_scatter" is what the distributed optimizer registers itself."""
    ddp = DistributedDataParallel(model, ddp_config(pc), process_group=group)
    ddp.broadcast_params()
    if pc.comm_hook == "powersgd":
        ddp.register_comm_hook(PowerSGDState(matrix_approximation_rank=pc.powersgd_rank,
                                             start_powerSGD_iter=pc.powersgd_start_iter,
                                             min_compression_rate=pc.powersgd_min_compression_rate,
                                             warm_start=pc.powersgd_warm_start, seed=pc.seed), powersgd_hook)
    elif pc.comm_hook in ("fp16", "bf16"):
        wrap = fp16_compress_wrapper if pc.comm_hook == "fp16" else bf16_compress_wrapper
        ddp.register_comm_hook(None, wrap(reduce_scatter_hook if pc.use_distributed_optimizer else allreduce_hook))
    return ddp


def ddp_with_optimizer(part: nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, *, group: Any = None,
                       norm_groups: Sequence = ()) -> tuple[DistributedDataParallel, Any]:
    """`part` in our DDP over `group` (None: the world) and its optimizer (ZeRO-1/2 with
    --use_distributed_optimizer): the data-parallel wrap of --parallel=ddp, and of a pipeline stage
    (parallel/engine_pipeline.py), whose `norm_groups` (the other stages) the gradient norm spans too."""
    if pc.use_distributed_optimizer != opt_cfg.use_distributed_optimizer:
        raise ValueError("ParallelConfig.use_distributed_optimizer must equal OptimizerConfig's")
    ddp = wrap_ddp(part, pc, group)
    return ddp, build_optimizer(ddp, opt_cfg, norm_groups=norm_groups)


def wrap_ddp_engine(model: nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, *, mesh: Any = None,
                    group: Any = None, device: Optional[torch.device] = None,
                    param_dtype: Optional[torch.dtype] = None) -> DDPEngine:
    """The --parallel=ddp engine around `model` (on its device, transforms applied: parallel/build.py), over
    the world or `group`. `mesh`: the run's mesh when the layout has one (context parallel)."""
    # context parallel (rank = dp x C + c on the mesh, pp = tp = 1 here): the C ranks of one replica read one
    # batch, and the gradients are averaged over all of them (dp x C), the world this DDP reduces over
    cp = pc.cp
    if cp > 1 and group is not None:
        raise ValueError("--context_parallel_size > 1 lays out the whole world: build it without a process group")
    ddp, optimizer = ddp_with_optimizer(model, pc, opt_cfg, group=group)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_available() and dist.is_initialized() \
        else (0, 1)
    if world == 1 and pc.gradient_accumulation_steps == 1:
        # one process, one micro-batch a step: nothing to reduce or accumulate, so no gradient buffer (where the
        # optimizer can read the gradients from the parameters: optimizer/mixed_precision_optimizer.py)
        optimizer.keep_grads_on_params()
    return DDPEngine(ddp, optimizer, model, sharded_optimizer=pc.use_distributed_optimizer,
                     dp_rank=rank // cp, dp_size=world // cp, grad_ranks=world, counts_in_sums=rank % cp == 0,
                     mesh=mesh)
