"""The whole model's weights of our DDP with expert-parallel shards (--parallel=ddp --expert_parallel_size > 1:
parallel/transforms/expert_parallel.py leaves each rank E/ep experts as plain parameters marked with SHARD_OF_ATTR),
as checkpoint/plain.py saves and loads them: `StateSpec.model` of that engine.

    state = ExpertShardedState(module, ep_group)
    state.gather()                 # collective over every rank (the engine's prepare_state): the shards all-gathered
    state.state_dict()             # rank 0: the full model, every expert (once per gather())
    state.load_state_dict(full)    # every rank keeps its slice of each full expert tensor (no communication)

So a plain checkpoint holds all E experts whatever ep wrote it, and loads at any ep (and under FSDP2).
Owns: gathering and slicing the shards. Must never: communicate in state_dict() (rank 0 alone calls it), or hand
out gathered weights older than the shards (state_dict() takes what the last gather() made, once).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel.distributed_data_parallel import DistributedDataParallel


class ExpertShardedState:
    """The module's state with its expert-parallel shards whole (the names and shapes of the unsharded model)."""

    def __init__(self, module: nn.Module, ep_group: Any) -> None:
        self.module, self.group = module, ep_group
        self.shards = {n: p for n, p in module.named_parameters() if DistributedDataParallel.shard_of(p) is not None}
        self._gathered: Optional[dict[str, torch.Tensor]] = None

    # what checkpoint/reads.py reads of a model besides its state
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def gather(self) -> None:
        """Collective: every shard all-gathered over its expert-parallel group; global rank 0 keeps the result for
        its next state_dict()."""
        full = self.full_shards()
        self._gathered = full if dist.get_rank() == 0 else None

    def full_shards(self) -> dict[str, torch.Tensor]:
        """Collective over the expert-parallel group: {name: the whole tensor} of every shard, on every rank of it
        (a pipeline stage's writer need not be global rank 0)."""
        world = dist.get_world_size(self.group)
        full = {}
        for name, p in self.shards.items():
            out = p.new_empty((world * p.shape[0], *p.shape[1:]))
            dist.all_gather_into_tensor(out, p.detach().contiguous(), group=self.group)
            if tuple(out.shape) != tuple(DistributedDataParallel.shard_of(p)[0]):
                raise RuntimeError(f"{name}: the gathered shards make {tuple(out.shape)}, not the full "
                                   f"{DistributedDataParallel.shard_of(p)[0]}")
            full[name] = out
        return full

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        if self._gathered is None:
            raise RuntimeError("the expert-parallel shards were not gathered for this state_dict(): call the "
                               "engine's prepare_state() on every rank first (rank 0 keeps the full tensors)")
        sd = self.module.state_dict(*args, **kwargs)
        sd.update(self._gathered)
        self._gathered = None  # the next save gathers again: never weights older than the shards
        return sd

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Full tensors of the shards are cut to this rank's slice; anything else (another shape included) goes to
        the module's own load_state_dict, which names what does not fit."""
        state = dict(state)
        for name, p in self.shards.items():
            t = state.get(name)
            shape, first = DistributedDataParallel.shard_of(p)
            if t is not None and tuple(t.shape) == tuple(shape):
                state[name] = t.reshape(-1)[first:first + p.numel()].view(p.shape)
        return self.module.load_state_dict(state, strict=strict)
