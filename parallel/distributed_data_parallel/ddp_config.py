"""Configuration of the data-parallel wrapper. Plain values only, so utils/configurator.py can fill it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DDPConfig:
    # Elements (not bytes) per gradient bucket; None puts every parameter of a dtype in one bucket.
    # Megatron's default is 40M elements; smaller buckets start communication earlier in backward.
    bucket_size: Optional[int] = 40_000_000
    # Launch a bucket's communication from the grad hooks as soon as the bucket is complete.
    # False: everything is launched by finish_grad_sync() after backward.
    overlap_grad_reduce: bool = True
    # Keep (and reduce) gradients in fp32 even when the parameters are bf16/fp16.
    grad_reduce_in_fp32: bool = False
    # Reduce-scatter instead of all-reduce by default: each rank only needs its shard of every
    # bucket because the distributed optimizer (ZeRO) updates only that shard.
    use_distributed_optimizer: bool = False
    # Every bucket (and so the whole buffer) is padded to a multiple of world_size * pad_alignment
    # elements, so it splits into equal, aligned shards for reduce-scatter / all-gather.
    pad_alignment: int = 64
    # Each parameter starts at a multiple of this many elements inside the buffer (aligned views).
    param_alignment: int = 16

    def __post_init__(self) -> None:
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"bucket_size must be positive or None, got {self.bucket_size}")
        if self.pad_alignment < 1 or self.param_alignment < 1:
            raise ValueError("pad_alignment and param_alignment must be >= 1")
