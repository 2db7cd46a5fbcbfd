"""Build the engine a run's flags describe: the parallel section (parallel/config.py), the precision
policy, the transforms in their order (parallel/transforms/), and the engine class that wraps the model
(parallel/engine_ddp.py, engine_fsdp.py, engine_pipeline.py); plus the one start-up line of the layout.

    engine = build_engine(model, train_cfg, device=device)   # any object with the flag names
    log(describe_layout(train_cfg, engine, world_size))

Owns: which engine class a layout gets (`ENGINE_BUILDERS`), the order of the transforms, the precision
policy (fsdp keeps fp32 sharded parameters and computes in --dtype through its mixed-precision policy;
our DDP and its pipeline stages run the model in --dtype with fp32 masters in the optimizer).
Must never: run a step, or be asked by the trainer which engine it built.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from optimizer import OptimizerConfig
from parallel.config import ParallelConfig
from parallel.engine import TrainingEngine
from parallel.engine_ddp import build_ddp_engine
from parallel.engine_fsdp import build_fsdp_engine_on_mesh
from parallel.engine_pipeline import build_pipeline_parallel_engine
from parallel.mesh import MeshLayout, build_device_mesh
from parallel.transforms import activation_checkpoint, compile as compile_transform, context_parallel, float8
from utils.device import parse_dtype

# the outermost engine of a layout (ParallelConfig.engine_kinds()[0]) -> its builder
ENGINE_BUILDERS = {"ddp": build_ddp_engine, "fsdp": build_fsdp_engine_on_mesh, "pipeline": build_pipeline_parallel_engine}


def optimizer_config(flags: Any) -> OptimizerConfig:
    """The optimizer section of the flags (AdamW, clipping, precision, ZeRO)."""
    return OptimizerConfig(
        lr=flags.learning_rate, betas=(flags.beta1, flags.beta2), eps=flags.eps, weight_decay=flags.weight_decay,
        grad_clip=flags.grad_clip, precision=flags.dtype, use_distributed_optimizer=flags.use_distributed_optimizer,
        zero_stage=flags.zero_stage, overlap_param_gather=flags.overlap_param_gather,
        overlap_optim_step=flags.overlap_optim_step, fused=flags.device != "cpu",
        optimizer=flags.optimizer, muon_lr=flags.muon_lr, muon_momentum=flags.muon_momentum,
        muon_weight_decay=flags.muon_weight_decay, muon_adjust_lr=flags.muon_adjust_lr,
        state_dtype=getattr(flags, "optimizer_state_dtype", "fp32"))


def build_engine(model: nn.Module, flags: Any, group: Any = None, device: Optional[torch.device] = None) -> TrainingEngine:
    """Wrap `model` for the layout the flags describe and build its optimizer: the same objects for world
    size 1 and N. `device`: where to run (default: where the model is); only this rank's pipeline stage
    is moved there, so the full model may be built on the CPU. Raises ValueError for a layout that cannot
    run. The transforms run in parallel/transforms ORDER: tensor parallel (inside the mesh engines'
    builders, before FSDP2), activation checkpointing, context parallel, FP8, the engine's wrap, compile."""
    pc = ParallelConfig.from_flags(flags)
    device = torch.device(device if device is not None else next(model.parameters()).device)
    compute_dtype = parse_dtype(flags.dtype)
    kind = pc.engine_kinds()[0]
    model.to(dtype=torch.float32 if pc.parallel == "fsdp" else compute_dtype)
    activation_checkpoint.apply(model, None, pc)
    cp_mesh = None
    if pc.cp > 1:  # our DDP has no mesh of its own: the cp groups come from the run's one mesh
        import torch.distributed as dist
        cp_mesh = build_device_mesh(pc.layout(dist.get_world_size()), device.type)
    context_parallel.apply(model, cp_mesh, pc)
    float8.apply(model, None, pc, device=device)  # before the wrap (FSDP shards the Float8Linear weights) and compile
    engine = ENGINE_BUILDERS[kind](model, pc, optimizer_config(flags), device=device, group=group,
                                   param_dtype=compute_dtype)
    if engine.mesh is None:
        engine.mesh = cp_mesh
    compile_transform.apply(engine, engine.mesh, pc)
    return engine


def describe_layout(flags: Any, engine: TrainingEngine, world_size: int) -> str:
    """One start-up line with the whole layout: engine, mesh sizes, communication, compile,
    activation checkpointing and the global batch (samples and tokens per optimizer step)."""
    pc = ParallelConfig.from_flags(flags)
    parts = [f"engine {pc.describe_engine()}",
             MeshLayout.from_sizes(world_size, pp=pc.pp, dp_replicate=pc.dp_replicate_size, tp=pc.tp,
                                   cp=pc.cp).describe()]
    if "comm_hooks" in pc.capabilities():  # the engine's declared capabilities
        hook = pc.comm_hook
        if hook == "powersgd":
            hook = f"powersgd (rank {pc.powersgd_rank}, from step {pc.powersgd_start_iter})"
        overlap = [name for name, on in (("grad reduce", pc.overlap_grad_reduce),
                                         ("param gather", pc.overlap_param_gather),
                                         ("optimizer step", pc.overlap_optim_step)) if on]
        parts.append(f"gradients {hook}, buckets of {pc.bucket_size:,} elements, overlap "
                     f"{', '.join(overlap) if overlap else 'off'}")
    parts.append(f"compile {'on' if pc.compile else 'off'}")
    parts.append(f"activation checkpointing {'on' if pc.gradient_checkpointing else 'off'}")
    samples = flags.batch_size * flags.gradient_accumulation_steps * engine.dp_size
    parts.append(f"global batch {flags.batch_size} x {flags.gradient_accumulation_steps} x {engine.dp_size} = "
                 f"{samples:,} samples = {samples * flags.max_seq_len:,} tokens per step")
    return "[layout] " + "; ".join(parts)
