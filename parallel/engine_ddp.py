"""Our DistributedDataParallel (buckets, comm hooks, PowerSGD) + MixedPrecisionOptimizer, or the ZeRO-1/2
DistributedOptimizer (--use_distributed_optimizer), as the trainer's engine: `DDPEngine` and its builder.

State (checkpoint/plain.py writes it): the whole model on every rank (rank 0's copy is saved; a LoRA run whose
base is a file holds only its trainable tensors), the optimizer's state whole or one ZeRO shard per rank, and the
comm hook's (PowerSGD) state per rank. With expert parallelism (--expert_parallel_size > 1) each rank holds E/ep
experts of every MoE block: our DDP reduces their gradients over the ranks holding the same ones (mesh["efsdp"]),
ZeRO shards their state there, every rank saves its optimizer state (ranges of the full tensors) and the weights
are saved whole (parallel/expert_state.py gathers the shards in prepare_state).

Owns: wrapping a model in our DDP with the configured comm hook, and saying how its state is laid out.
Must never: hold the micro-batch loop (parallel/engine.py's) or the optimizer's step (optimizer/).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from optimizer import OptimizerConfig, build_optimizer
from parallel.comm_hooks import allreduce_hook, bf16_compress_wrapper, fp16_compress_wrapper, reduce_scatter_hook
from parallel.config import CAPABILITIES, ParallelConfig
from parallel.distributed_data_parallel import DDPConfig, DistributedDataParallel
from parallel.engine import Engine, StateSpec
from parallel.expert_state import ExpertShardedState
from parallel.mesh import expert_dp_mesh
from parallel.powersgd import PowerSGDState, powersgd_hook


@dataclass
class DDPEngine(Engine):
    """Our DistributedDataParallel + MixedPrecisionOptimizer, or ZeRO-1/2 (DistributedOptimizer): replicated
    weights, the optimizer's state whole or sharded per rank (checkpoint/plain.py's format)."""
    kind: ClassVar[str] = "ddp"
    capabilities: ClassVar[frozenset] = CAPABILITIES["ddp"]

    expert_state: Optional[ExpertShardedState] = None  # expert parallelism: the model's state with whole experts

    def state_spec(self) -> StateSpec:
        return StateSpec("replicated", self.expert_state or self.module, self.optimizer,
                         sharded_optimizer=self.sharded_optimizer, lora_base=self.lora_base)

    def prepare_state(self) -> None:
        self.optimizer.finish_param_sync()  # ZeRO + overlapped gather: parameters complete before reading them
        if self.expert_state is not None:
            self.expert_state.gather()  # collective: rank 0 saves every expert

    def rank_state(self) -> dict:
        hook_state = self.model.comm_hook_state_dict()  # PowerSGD's error feedback and step count
        return {"comm_hook": hook_state} if hook_state else {}

    def load_rank_state(self, state: dict) -> None:
        if state.get("comm_hook"):
            self.model.load_comm_hook_state_dict(state["comm_hook"])


def ddp_config(pc: ParallelConfig) -> DDPConfig:
    """Our DDP's buckets and reduction from the parallel section (also the pipeline stages' wrapper)."""
    return DDPConfig(bucket_size=pc.bucket_size, overlap_grad_reduce=pc.overlap_grad_reduce,
                     grad_reduce_in_fp32=pc.grad_reduce_in_fp32, use_distributed_optimizer=pc.use_distributed_optimizer)


def wrap_ddp(model: nn.Module, pc: ParallelConfig, group: Any = None, **expert_groups: Any) -> DistributedDataParallel:
    """`model` in our DDP over `group` (None: the world), dp rank 0's weights broadcast, the configured comm
    hook registered. "reduce_scatter" is what the distributed optimizer registers itself. `expert_groups`:
    DistributedDataParallel's expert_group and expert_parallel_group (expert parallelism)."""
    ddp = DistributedDataParallel(model, ddp_config(pc), process_group=group, **expert_groups)
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
                       norm_groups: Sequence = (), **expert_groups: Any) -> tuple[DistributedDataParallel, Any]:
    """`part` in our DDP over `group` (None: the world) and its optimizer (ZeRO-1/2 with
    --use_distributed_optimizer): the data-parallel wrap of --parallel=ddp, and of a pipeline stage
    (parallel/engine_pipeline.py), whose `norm_groups` (the other stages) the gradient norm spans too."""
    if pc.use_distributed_optimizer != opt_cfg.use_distributed_optimizer:
        raise ValueError("ParallelConfig.use_distributed_optimizer must equal OptimizerConfig's")
    ddp = wrap_ddp(part, pc, group, **expert_groups)
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
    experts: dict[str, Any] = {}
    if pc.ep > 1:  # (parallel/mesh.py: dp_shard = efsdp x ep; no replicas, tp or stages under our DDP)
        if group is not None or mesh is None:
            raise ValueError("--expert_parallel_size > 1 lays out the whole world on the mesh: build it without a "
                             "process group")
        experts = dict(expert_group=expert_dp_mesh(mesh).get_group(), expert_parallel_group=mesh["ep"].get_group())
    ddp, optimizer = ddp_with_optimizer(model, pc, opt_cfg, group=group, **experts)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_available() and dist.is_initialized() \
        else (0, 1)
    if world == 1 and pc.gradient_accumulation_steps == 1:
        # one process, one micro-batch a step: nothing to reduce or accumulate, so no gradient buffer (where the
        # optimizer can read the gradients from the parameters: optimizer/mixed_precision_optimizer.py)
        optimizer.keep_grads_on_params()
    return DDPEngine(ddp, optimizer, model, sharded_optimizer=pc.use_distributed_optimizer or pc.ep > 1,
                     dp_rank=rank // cp, dp_size=world // cp, grad_ranks=world, counts_in_sums=rank % cp == 0,
                     fixed_batch_shape=cp > 1,
                     mesh=mesh, expert_state=ExpertShardedState(model, experts["expert_parallel_group"])
                     if experts else None)
