"""Build the engine a run's flags describe: the parallel section (parallel/config.py), the run's one device mesh,
the transforms in their ORDER (parallel/transforms/), among them the data-parallel wrap of the engine class
(parallel/engine_ddp.py, engine_fsdp.py, engine_pipeline.py); plus the one start-up line of the layout.

    engine = build_engine(model, train_cfg, device=device)   # any object with the flag names
    log(describe_layout(train_cfg, engine, world_size))
    engine = build_parallel_engine(model, ParallelConfig(...), OptimizerConfig(...))   # typed sections

The steps, each once: the typed section (`ParallelConfig`, kept as `engine.parallel`); the mesh (`build_mesh`,
the only caller of parallel/mesh.py's build_device_mesh); the part of the model this rank runs (a pipeline
stage, or the whole model) moved to the device; the first rank's weights on every rank that shards them (before
tensor parallelism splits them); then ORDER: tensor parallel, activation checkpointing, context parallel, FP8,
the engine's data-parallel wrap with its optimizer, compile. A pipeline's stages take the same DDP / FSDP2 wraps
as the one-stage engines (parallel/engine_pipeline.py composes them).

Owns: which engine class a layout gets (`ENGINE_WRAPS`), the order of the transforms, the mesh, the precision
policy (fsdp keeps fp32 sharded parameters and computes in --dtype through its mixed-precision policy;
our DDP and its pipeline stages run the model in --dtype with fp32 masters in the optimizer).
Must never: run a step, or be asked by the trainer which engine it built.
"""
from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from optimizer import OptimizerConfig
from parallel.config import ParallelConfig
from parallel.engine import TrainingEngine
from parallel.engine_ddp import wrap_ddp_engine
from parallel.engine_fsdp import wrap_fsdp_engine
from parallel.engine_pipeline import pipeline_stage_of, wrap_pipeline_engine
from parallel.fsdp import broadcast_from_first
from parallel.mesh import build_device_mesh
from parallel.transforms import ORDER, activation_checkpoint as checkpoint_transform, compile as compile_transform
from utils.device import parse_dtype

# the outermost engine of a layout (ParallelConfig.engine_kinds()[0]) -> its data-parallel wrap, the "data_parallel"
# step of ORDER: (the part this rank runs, transformed; the sections; mesh, group, device, param_dtype) -> the engine
ENGINE_WRAPS = {"ddp": wrap_ddp_engine, "fsdp": wrap_fsdp_engine, "pipeline": wrap_pipeline_engine}
# the transforms of the model (or stage) before the wrap, each parallel/transforms/<name>.py with
# apply(model, mesh, parallel_config): a new one is its module and its name in ORDER
MODEL_TRANSFORMS = {name: importlib.import_module(f"parallel.transforms.{name}")
                    for name in ORDER[:ORDER.index("data_parallel")]}


def optimizer_config(flags: Any) -> OptimizerConfig:
    """The optimizer section of the flags (AdamW, clipping, precision, ZeRO)."""
    return OptimizerConfig(
        lr=flags.learning_rate, betas=(flags.beta1, flags.beta2), eps=flags.eps, weight_decay=flags.weight_decay,
        grad_clip=flags.grad_clip, precision=flags.dtype, use_distributed_optimizer=flags.use_distributed_optimizer,
        zero_stage=flags.zero_stage, overlap_param_gather=flags.overlap_param_gather,
        overlap_optim_step=flags.overlap_optim_step, fused=flags.device != "cpu",
        optimizer=flags.optimizer, muon_lr=flags.muon_lr, muon_momentum=flags.muon_momentum,
        muon_weight_decay=flags.muon_weight_decay, muon_adjust_lr=flags.muon_adjust_lr,
        muon_experts=getattr(flags, "muon_experts", True),
        state_dtype=getattr(flags, "optimizer_state_dtype", "fp32"))


def build_mesh(pc: ParallelConfig, device_type: str) -> Any:
    """The run's DeviceMesh (parallel/mesh.py's five dimensions, sized by `pc` for the world), or None where the
    layout has no use for one: our DDP / ZeRO without context parallelism reduces over a process group (or runs
    without any). Collective over the world. The only place a run's mesh is built."""
    if not pc.needs_mesh() or not (dist.is_available() and dist.is_initialized()):
        return None
    return build_device_mesh(pc.layout(dist.get_world_size()), device_type)


def _same_weights_on_every_copy(part: nn.Module, mesh: Any) -> None:
    """The first rank's parameters and buffers on every rank of this stage's mesh (all but "pp"), so that the
    ranks need not have initialised identically; before tensor parallelism, which splits plain tensors. Our DDP
    broadcasts in its own wrap (over its group, as with no mesh at all)."""
    if mesh is not None and mesh.size() > 1:
        broadcast_from_first(list(part.parameters()) + list(part.buffers()),
                             mesh["dp_replicate", "dp_shard", "cp", "tp"])


def build_parallel_engine(model: nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, *,
                          device: Optional[torch.device] = None, group: Any = None,
                          param_dtype: Optional[torch.dtype] = None,
                          allow_uneven_split: bool = False) -> TrainingEngine:
    """`model` (the full model, in its precision) wrapped for the layout `pc` describes, with its optimizer.
    `device`: where to run (default: where the model is); only this rank's pipeline stage is moved there, so
    the full model may be built on the CPU. `group`: our DDP over this process group instead of the world
    (no mesh). Raises ValueError for a layout that cannot run."""
    device = torch.device(device if device is not None else next(model.parameters()).device)
    param_dtype = param_dtype if param_dtype is not None else next(model.parameters()).dtype
    kind = pc.engine_kinds()[0]
    mesh = build_mesh(pc, device.type) if group is None else None
    if kind != "ddp" and mesh is None:
        raise ValueError(f"--parallel={pc.parallel}"
                         + (f" with --pipeline_parallel_size={pc.pp}" if pc.pp > 1 else "")
                         + " runs on a device mesh: it needs an initialised process group and no `group`")
    part = pipeline_stage_of(model, pc, opt_cfg, mesh, allow_uneven_split) if kind == "pipeline" else model
    part.to(device)
    if pc.parallel == "fsdp":
        _same_weights_on_every_copy(part, mesh)
    engine = None
    for name in ORDER:
        if name == "data_parallel":
            engine = ENGINE_WRAPS[kind](part, pc, opt_cfg, mesh=mesh, group=group, device=device,
                                        param_dtype=param_dtype)
        elif name == "compile":
            compile_transform.apply(engine, mesh, pc)
        else:
            MODEL_TRANSFORMS[name].apply(part, mesh, pc)
    engine.parallel = pc
    return engine


def build_engine(model: nn.Module, flags: Any, group: Any = None, device: Optional[torch.device] = None) -> TrainingEngine:
    """The trainer's engine from its flags: `model` cast to the precision policy (fp32 masters under FSDP2, --dtype
    elsewhere), then build_parallel_engine with the parallel and optimizer sections of the flags."""
    pc = ParallelConfig.from_flags(flags)
    compute_dtype = parse_dtype(flags.dtype)
    model.to(dtype=torch.float32 if pc.parallel == "fsdp" else compute_dtype)
    return build_parallel_engine(model, pc, optimizer_config(flags), device=device, group=group,
                                 param_dtype=compute_dtype)


def describe_layout(flags: Any, engine: TrainingEngine, world_size: int) -> str:
    """One start-up line with the whole layout: engine, mesh sizes, communication, compile,
    activation checkpointing and the global batch (samples and tokens per optimizer step)."""
    pc = engine.parallel
    parts = [f"engine {pc.describe_engine()}",
             pc.layout(world_size).describe()]
    if "comm_hooks" in pc.capabilities():  # the engine's declared capabilities
        hook = pc.comm_hook
        if hook == "powersgd":
            hook = f"powersgd (rank {pc.powersgd_rank}, from step {pc.powersgd_start_iter})"
        overlap = [name for name, on in (("grad reduce", pc.overlap_grad_reduce),
                                         ("param gather", pc.overlap_param_gather),
                                         ("optimizer step", pc.overlap_optim_step)) if on]
        parts.append(f"gradients {hook}, buckets of {pc.bucket_size:,} elements, overlap "
                     f"{', '.join(overlap) if overlap else 'off'}")
    if pc.compile:
        where = "per block" if compile_transform.per_block(engine, pc) else "whole model"
        parts.append(f"compile on ({where}{'' if pc.compile_backend == 'inductor' else ', ' + pc.compile_backend})")
    else:
        parts.append("compile off")
    parts.append(f"activation checkpointing {checkpoint_transform.describe(pc)}")
    samples = flags.batch_size * flags.gradient_accumulation_steps * engine.dp_size
    parts.append(f"global batch {flags.batch_size} x {flags.gradient_accumulation_steps} x {engine.dp_size} = "
                 f"{samples:,} samples = {samples * flags.max_seq_len:,} tokens per step")
    return "[layout] " + "; ".join(parts)
