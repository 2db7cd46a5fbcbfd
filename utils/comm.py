"""Thin collective layer shared by our DDP and its comm hooks (parallel/) and the optimizers (optimizer/).

Owns: the (rank, world size, group) view of a process group, world-size-1 short cuts so the
same code runs without `torch.distributed` initialised, and `CommHandle`, the Work/Future-like
object every comm hook returns (and the ZeRO optimizer's parameter all-gathers).
It must never pick a backend or a device (utils/device.py does that), never hold training state,
and never import a package above utils/ (it sits below both its users).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

# torch 2.13 renamed the in-place "tensor" collectives; keep working on older versions too.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(rank, world size) of `group`; (0, 1) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class CommHandle:
    """A finished-or-pending collective: `wait()` waits every Work, then runs `then` once.

    `then` lets a hook post-process after the data arrived (decompress, copy back) without
    the caller knowing which hook ran.
    """

    def __init__(self, works: Sequence = (), then: Optional[Callable[[], None]] = None):
        self._works = [w for w in works if w is not None]
        self._then = then
        self._done = False

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        if self._done:
            return
        for w in self._works:
            w.wait()
        self._works = []  # don't keep finished Work objects alive (they pin the process group)
        self._done = True
        if self._then is not None:
            then, self._then = self._then, None
            then()


def all_reduce(t: torch.Tensor, group, world_size: int, async_op: bool = True):
    """SUM all-reduce in place; None (nothing to do) when the world is one rank."""
    if world_size == 1:
        return None
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def _sharded_collective(collective: Callable, out: torch.Tensor, inp: torch.Tensor, group, world_size: int,
                        async_op: bool):
    """At world size 1 the whole tensor is the one shard: a copy (none when out and inp alias)."""
    if world_size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    return collective(out, inp, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, world_size: int, async_op: bool = True):
    """SUM reduce-scatter of `inp` into `out` (out may alias inp's own shard, as in Megatron)."""
    return _sharded_collective(_reduce_scatter, out, inp, group, world_size, async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, world_size: int, async_op: bool = True):
    """All-gather equal shards `inp` into `out` (inp may alias out's own shard)."""
    return _sharded_collective(_all_gather, out, inp, group, world_size, async_op)


def all_reduce_max_flag(flag: torch.Tensor, group, world_size: int) -> None:
    """Blocking MAX all-reduce of a small tensor (found-inf flags)."""
    if world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)


def all_reduce_sum_blocking(t: torch.Tensor, group, world_size: int) -> None:
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
