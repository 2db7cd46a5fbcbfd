"""The contiguous parameter and gradient buffers of one dtype, and their buckets.

Owns: one flat parameter tensor and one flat gradient tensor per (param dtype, grad dtype);
re-pointing every parameter's `.data` at its slice of the parameter buffer and `param.main_grad`
at its slice of the gradient buffer; the split into buckets (reverse backward order, padded so
every bucket divides evenly across ranks); freeing/re-allocating gradient storage for ZeRO-2
(per bucket, after `split_grad_storage()` gave every bucket its own storage).
It must never launch communication or know which optimizer runs (DDP and the hooks do that).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass
class ParamSlot:
    """Where one parameter lives inside its bucket (bucket-local element offsets)."""
    name: str
    param: torch.nn.Parameter
    start: int
    end: int

    @property
    def shape(self) -> torch.Size:
        return self.param.shape


@dataclass
class Bucket:
    """A contiguous range [start, end) of one buffer whose gradients are communicated together."""
    index: int  # global index across buffers, in launch (reverse-registration) order
    buffer: "ParamAndGradBuffer"
    start: int
    end: int
    slots: list[ParamSlot] = field(default_factory=list)
    # The bucket's own gradient storage once the buffer was split (ZeRO-2), else None (a slice
    # of the buffer's flat gradient tensor).
    own_grad: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def grad_data(self) -> torch.Tensor:
        if self.own_grad is not None:
            return self.own_grad
        return self.buffer.grad_data[self.start:self.end]

    # ---- gradient storage of this bucket (freeable on its own only after split_grad_storage) ----
    def grad_storage_allocated(self) -> bool:
        return self.grad_data.untyped_storage().nbytes() > 0

    def release_grad_storage(self) -> None:
        """Free this bucket's gradient memory; its main_grad views stay valid (empty storage)."""
        if self.own_grad is None:
            raise RuntimeError("release_grad_storage() on a bucket without its own storage: "
                               "call buffer.split_grad_storage() first")
        self.own_grad.untyped_storage().resize_(0)

    def ensure_grad_storage(self) -> None:
        """Re-allocate (zeroed) a released gradient storage; no-op when allocated."""
        if self.own_grad is None:
            self.buffer.ensure_grad_storage()
        elif not self.grad_storage_allocated():
            self.own_grad.untyped_storage().resize_(self.numel * self.own_grad.element_size())
            self.own_grad.zero_()

    def grad_bytes_allocated(self) -> int:
        return self.grad_data.untyped_storage().nbytes()

    @property
    def param_data(self) -> torch.Tensor:
        return self.buffer.param_data[self.start:self.end]

    def shard_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """Bucket-local [lo, hi) owned by `rank` (equal shards: the bucket is padded for this)."""
        size = self.numel // world_size
        return rank * size, (rank + 1) * size


class GradBucket:
    """What a comm hook sees: a flat gradient tensor, its params, its shard and its group.

    `buffer()` is the bucket's slice of the gradient buffer (already divided by world size).
    When the hook returns handle.wait() must have left the rank's reduced result in `buffer()`:
    the whole tensor for all-reduce-like hooks, at least `shard()` for reduce-scatter.
    """

    def __init__(self, bucket: Bucket, group: Optional[dist.ProcessGroup], rank: int, world_size: int,
                 buffer: Optional[torch.Tensor] = None):
        self.bucket = bucket
        self.index = bucket.index
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._buffer = bucket.grad_data if buffer is None else buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    @property
    def slots(self) -> list[ParamSlot]:
        return self.bucket.slots

    def shard_range(self) -> tuple[int, int]:
        return self.bucket.shard_range(self.rank, self.world_size)

    def shard(self) -> torch.Tensor:
        lo, hi = self.shard_range()
        return self._buffer[lo:hi]

    def with_buffer(self, buffer: torch.Tensor) -> "GradBucket":
        """The same bucket over another flat tensor (compression wrappers use this)."""
        return GradBucket(self.bucket, self.group, self.rank, self.world_size, buffer)


class ParamAndGradBuffer:
    """Flat buffers for parameters of one dtype, cut into buckets of ~bucket_size elements, reduced (and ZeRO-
    sharded) over `group` (rank `rank` of `world_size`; None: the DDP's). `expert`: it holds expert-parallel
    shards, reduced over the ranks that hold the same experts (DistributedDataParallel's expert_group)."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], grad_dtype: torch.dtype,
                 bucket_size: Optional[int], world_size: int, pad_alignment: int, param_alignment: int,
                 first_bucket_index: int, group: Optional[dist.ProcessGroup] = None, rank: int = 0,
                 expert: bool = False):
        assert named_params, "a buffer needs at least one parameter"
        self.group, self.rank, self.world_size, self.expert = group, rank, world_size, expert
        self.param_dtype = named_params[0][1].dtype
        self.grad_dtype = grad_dtype
        self.device = named_params[0][1].device
        bucket_multiple = world_size * pad_alignment
        # Layout pass: params arrive already in reverse registration order (≈ backward order).
        self.buckets: list[Bucket] = []
        offset, bucket_start = 0, 0
        pending: list[tuple[str, torch.nn.Parameter, int, int]] = []

        def close_bucket(end: int) -> int:
            end = _round_up(end, bucket_multiple)
            b = Bucket(first_bucket_index + len(self.buckets), self, bucket_start, end)
            b.slots = [ParamSlot(n, p, s - bucket_start, e - bucket_start) for n, p, s, e in pending]
            self.buckets.append(b)
            pending.clear()
            return end

        for name, p in named_params:
            offset = _round_up(offset, param_alignment)
            pending.append((name, p, offset, offset + p.numel()))
            offset += p.numel()
            if bucket_size is not None and offset - bucket_start >= bucket_size:
                offset = bucket_start = close_bucket(offset)
        if pending:
            offset = close_bucket(offset)
        self.numel = offset
        self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=self.device)
        self._grad_nbytes = self.grad_data.untyped_storage().nbytes()
        # Re-point params into the buffer: from now on the buffer IS the parameter storage.
        for b in self.buckets:
            for s in b.slots:
                lo, hi = b.start + s.start, b.start + s.end
                view = self.param_data[lo:hi].view(s.param.shape)
                view.copy_(s.param.data)
                s.param.data = view
                s.param.main_grad = self.grad_data[lo:hi].view(s.param.shape)

    # ---- ZeRO-2 support: the storage can be dropped and brought back; the views stay valid ----
    @property
    def split(self) -> bool:
        return self.grad_data is None

    def split_grad_storage(self) -> None:
        """Give every bucket its own gradient storage (same values, main_grad re-pointed), so
        ZeRO-2 can free each bucket as soon as its reduce-scatter finished. Afterwards the
        buffer has no flat gradient tensor (`grad_data` is None); use the buckets'."""
        if self.split:
            return
        for b in self.buckets:
            b.own_grad = self.grad_data[b.start:b.end].clone()
            for s in b.slots:
                s.param.main_grad = b.own_grad[s.start:s.end].view(s.param.shape)
        self.grad_data = None

    def grad_storage_allocated(self) -> bool:
        if self.split:
            return all(b.grad_storage_allocated() for b in self.buckets)
        return self.grad_data.untyped_storage().nbytes() > 0

    def release_grad_storage(self) -> None:
        """Free the gradient memory (every main_grad view now points at an empty storage)."""
        if self.split:
            for b in self.buckets:
                b.release_grad_storage()
        else:
            self.grad_data.untyped_storage().resize_(0)

    def ensure_grad_storage(self) -> None:
        if self.split:
            for b in self.buckets:
                b.ensure_grad_storage()
        elif not self.grad_storage_allocated():
            self.grad_data.untyped_storage().resize_(self._grad_nbytes)
            self.grad_data.zero_()

    def zero_grad(self) -> None:
        """Zero the allocated gradient storage; released (ZeRO-2) buckets stay released and are
        re-allocated zeroed by the first gradient that reaches them."""
        if not self.split:
            if self.grad_storage_allocated():
                self.grad_data.zero_()
            else:
                self.ensure_grad_storage()
            return
        for b in self.buckets:
            if b.grad_storage_allocated():
                b.own_grad.zero_()

    def grad_bytes_allocated(self) -> int:
        if self.split:
            return sum(b.grad_bytes_allocated() for b in self.buckets)
        return self.grad_data.untyped_storage().nbytes()
