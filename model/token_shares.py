"""Rows split over the ranks of a group and gathered back, differentiably: tensor parallelism's MoE layers run on
each tensor rank's share of the tokens (model/moe.py MoEFeedForward.token_split_group,
parallel/transforms/tensor_parallel.py). A share is torch.tensor_split's: the first N mod W ranks hold one row more.

Imported only where a group is set (a module-level torch.compiler.disable imports torch._dynamo, ~2 s, which the
commands that only load a checkpoint never need).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _gather_rows(part: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """Every rank's share of n rows (torch.tensor_split's shares, in rank order), concatenated: [n, ...]."""
    size = dist.get_world_size(group)
    most = -(-n // size)
    padded = part if part.shape[0] == most else torch.cat([part, part.new_zeros(most - part.shape[0],
                                                                               *part.shape[1:])])
    shares = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(shares, padded.contiguous(), group=group)
    sizes = [n // size + (i < n % size) for i in range(size)]
    return torch.cat([s[:k] for s, k in zip(shares, sizes)])


def share_of(rows: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's share of rows every rank of the group holds alike (no gradient: e.g. each row's sequence)."""
    return rows.tensor_split(dist.get_world_size(group))[dist.get_rank(group)]


class _TakeShare(torch.autograd.Function):
    """This rank's share of rows every rank of the group holds alike; the backward all-gathers every rank's share of
    the gradient (the rows' gradient is the sum of what each rank's tokens sent back: each share is one rank's)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.n = group, rows.shape[0]
        return share_of(rows, group).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_rows(grad, ctx.group, ctx.n), None


class _GatherShares(torch.autograd.Function):
    """Every rank's share of the rows, all-gathered; the backward keeps this rank's share of the gradient (every rank
    backpropagates the same replicated loss through the gathered rows)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group: Any, n: int) -> torch.Tensor:
        ctx.group = group
        return _gather_rows(part, group, n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.tensor_split(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)].contiguous(), None, None


@torch.compiler.disable
def take_share(rows: torch.Tensor, group: Any) -> torch.Tensor:
    """[N, D] rows alike on every rank of `group` -> this rank's share (torch.tensor_split over the group)."""
    return _TakeShare.apply(rows, group)


@torch.compiler.disable
def gather_shares(part: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """This rank's share of N rows -> all N rows, on every rank of `group` (the inverse of take_share)."""
    return _GatherShares.apply(part, group, n)
