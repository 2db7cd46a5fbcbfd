"""torch FSDP2 (`fully_shard` per block + root) + FSDPOptimizer as the trainer's engine: `FSDPEngine` and its
builder, on the run's one device mesh (parallel/mesh.py): HSDP over ("dp_replicate", "dp_shard") with
replicas, tensor (+ sequence) parallel inside over "tp" (applied as a transform first).

State: DTensor shards of the weights and the optimizer's state over the mesh (checkpoint/dcp.py saves them with
torch.distributed.checkpoint, no gather, loadable at any world size; checkpoint/convert.py converts a
--parallel=ddp checkpoint per parameter name).

Owns: this engine's wrapping, DPO reference layout, and saying how its state is laid out.
Must never: hold the micro-batch loop (parallel/engine.py's) or the optimizer's step (optimizer/).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from optimizer import OptimizerConfig
from optimizer.fsdp_optimizer import FSDPOptimizer
from parallel.config import CAPABILITIES, ParallelConfig
from parallel.engine import Engine, StateSpec
from parallel.fsdp import no_sync, reshard, shard_on_mesh, validate_fsdp_options, wrap_fsdp
from parallel.mesh import dp_mesh


@dataclass
class FSDPEngine(Engine):
    """torch FSDP2 (`fully_shard` per block + root) + FSDPOptimizer (parallel/fsdp.py): DTensor shards of the
    weights and the optimizer's state (checkpoint/dcp.py's format)."""
    kind: ClassVar[str] = "fsdp"
    capabilities: ClassVar[frozenset] = CAPABILITIES["fsdp"]

    def place_reference(self, ref: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """DPO's reference laid out on the same mesh (tensor-parallel like the policy, fp32 shards, each
        block gathered in `dtype` for its forward and freed after it), so it costs 1/world of its bytes."""
        return self._split_sequences(shard_on_mesh(ref.to(device=device, dtype=torch.float32), self.mesh,
                                                   param_dtype=dtype, reshard_after_forward=True))

    def reference_layout(self) -> str:
        tp = self.mesh["tp"].size() if self.mesh is not None else 1
        return "sharded by FSDP2" + (f" and split over {tp} tensor-parallel ranks" if tp > 1 else "")

    def _no_sync(self) -> contextlib.AbstractContextManager:
        return no_sync(self.model)  # the model is the fully_shard-ed module itself: no wrapper

    def _after_forward_only(self) -> None:
        reshard(self.model)  # no backward follows to free what the forward gathered: free it now

    def state_spec(self) -> StateSpec:
        return StateSpec("dtensor", self.model, self.optimizer, sharded_optimizer=True)

    def prepare_state(self) -> None:
        reshard(self.model)  # gathered parameters (left by a forward-only pass) are freed before the state is read


def fsdp_with_optimizer(part: nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, *, dp_mesh: Any,
                        param_dtype: torch.dtype, state_group: Any = None, gloo_collectives: bool = True,
                        norm_groups: Sequence = ()) -> tuple[nn.Module, FSDPOptimizer]:
    """`part` (its weights already the same on every rank: parallel/build.py broadcasts them before tensor
    parallelism) fully_shard-ed over `dp_mesh`, and its optimizer: the data-parallel wrap of --parallel=fsdp,
    and of a pipeline stage (parallel/engine_pipeline.py), whose `norm_groups` the gradient norm spans too."""
    validate_fsdp_options(use_distributed_optimizer=opt_cfg.use_distributed_optimizer,
                          overlap_optim_step=opt_cfg.overlap_optim_step,
                          overlap_param_gather=opt_cfg.overlap_param_gather, zero_stage=opt_cfg.zero_stage)
    if param_dtype == torch.float16 and opt_cfg.precision != "fp16":
        raise ValueError("param_dtype=float16 needs precision='fp16' (loss scaling)")
    wrapped = wrap_fsdp(part, mesh_or_group=dp_mesh, param_dtype=param_dtype,
                        reshard_after_forward=pc.reshard_after_forward, cpu_offload=pc.cpu_offload,
                        sync_module_states=False, state_group=state_group, gloo_collectives=gloo_collectives)
    return wrapped, FSDPOptimizer(wrapped, opt_cfg, norm_groups=norm_groups)


def wrap_fsdp_engine(model: nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, *, mesh: Any,
                     group: Any = None, device: Optional[torch.device] = None,
                     param_dtype: torch.dtype = torch.float32) -> FSDPEngine:
    """The --parallel=fsdp engine: FSDP2 over the run's mesh's data-parallel dims (HSDP with replicas;
    tensor parallel already applied over "tp" by its transform). `group` is unused: the mesh is the world's."""
    wrapped, opt = fsdp_with_optimizer(model, pc, opt_cfg, dp_mesh=dp_mesh(mesh), param_dtype=param_dtype,
                                       state_group=dist.group.WORLD)
    layout = pc.layout(dist.get_world_size())
    rank, world = layout.dp_coordinates(dist.get_rank())
    # context parallel: FSDP2 averages the gradients over dp x cp ranks (parallel/mesh.py dp_mesh), the batch is
    # split over dp only
    return FSDPEngine(wrapped, opt, wrapped, sharded_optimizer=True, dp_rank=rank, dp_size=world, mesh=mesh,
                      counts_in_sums=layout.counts_in_sums(dist.get_rank()), grad_ranks=world * layout.cp,
                      fixed_batch_shape=layout.cp > 1)
