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
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from optimizer import OptimizerConfig
from parallel.config import CAPABILITIES, ParallelConfig
from parallel.engine import Engine, StateSpec
from parallel.fsdp import build_fsdp_engine, no_sync, reshard, shard_on_mesh
from parallel.mesh import build_device_mesh


@dataclass
class FSDPEngine(Engine):
    """torch FSDP2 (`fully_shard` per block + root) + FSDPOptimizer (parallel/fsdp.py): DTensor shards of the
    weights and the optimizer's state (checkpoint/dcp.py's format)."""
    kind: ClassVar[str] = "fsdp"
    capabilities: ClassVar[frozenset] = CAPABILITIES["fsdp"]

    def place_reference(self, ref: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """DPO's reference laid out on the same mesh (tensor-parallel like the policy, fp32 shards, each
        block gathered in `dtype` for its forward and freed after it), so it costs 1/world of its bytes."""
        return shard_on_mesh(ref.to(device=device, dtype=torch.float32), self.mesh, param_dtype=dtype,
                             reshard_after_forward=True)

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


def build_fsdp_engine_on_mesh(model: nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, *, device: torch.device,
                              group: Any = None, param_dtype: torch.dtype = torch.float32) -> FSDPEngine:
    """FSDP2 over the one mesh's data-parallel dims (HSDP with replicas), tensor parallel inside (the
    transform runs in parallel/fsdp.py shard_on_mesh, before the wrap). `group` is unused: the mesh is
    the world's."""
    model.to(device)
    layout = pc.layout(dist.get_world_size())
    mesh = build_device_mesh(layout, device.type)
    wrapped, opt = build_fsdp_engine(model, opt_cfg, mesh_or_group=mesh, param_dtype=param_dtype,
                                     reshard_after_forward=pc.reshard_after_forward, cpu_offload=pc.cpu_offload,
                                     sequence_parallel=pc.sequence_parallel)
    rank, world = layout.dp_coordinates(dist.get_rank())
    # context parallel: FSDP2 averages the gradients over dp x cp ranks (parallel/mesh.py dp_mesh), the batch is
    # split over dp only
    return FSDPEngine(wrapped, opt, wrapped, sharded_optimizer=True, dp_rank=rank, dp_size=world, mesh=mesh,
                      counts_in_sums=layout.counts_in_sums(dist.get_rank()), grad_ranks=world * layout.cp)
