"""Gradient communication hooks: all-reduce, reduce-scatter, and low-precision wrappers.

Owns: the hook signature `hook(state, bucket: GradBucket) -> CommHandle` and the default hooks.
A hook receives gradients already divided by the world size, so it only ever SUMs; after
`handle.wait()` the reduced gradients are back in `bucket.buffer()` (all of it, or at least the
rank's shard for reduce-scatter). Hooks must never touch parameters or optimizer state, and must
issue the same collectives in the same order on every rank.
PowerSGD lives in parallel/powersgd.py and follows the same contract.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from utils import comm

if TYPE_CHECKING:  # runtime import would be circular (DDP imports this module)
    from parallel.distributed_data_parallel.param_and_grad_buffer import GradBucket

CommHook = Callable[[Any, "GradBucket"], comm.CommHandle]


class CommHookState:
    """Default hook state: counts the payload bytes this rank hands to collectives.

    `bytes_sent` is cumulative; DDP records the per-step delta in `ddp.last_step_comm_bytes`.
    Payload bytes = the tensor sizes given to collectives; wire volume depends on the algorithm
    (ring all-reduce moves 2(n-1)/n of the payload per rank; see docs/parallel.md).
    """

    def __init__(self) -> None:
        self.bytes_sent = 0

    def state_dict(self) -> dict:
        return {"bytes_sent": int(self.bytes_sent)}

    def load_state_dict(self, sd: dict) -> None:
        self.bytes_sent = int(sd.get("bytes_sent", 0))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def allreduce_hook(state: CommHookState, bucket: "GradBucket") -> comm.CommHandle:
    buf = bucket.buffer()
    if bucket.world_size > 1:
        state.bytes_sent += _nbytes(buf)
    return comm.CommHandle([comm.all_reduce(buf, bucket.group, bucket.world_size)])


def reduce_scatter_hook(state: CommHookState, bucket: "GradBucket") -> comm.CommHandle:
    """Only the rank's shard is valid afterwards (the rest of the buffer holds local grads)."""
    buf = bucket.buffer()
    if bucket.world_size > 1:
        state.bytes_sent += _nbytes(buf)
    return comm.CommHandle([comm.reduce_scatter(bucket.shard(), buf, bucket.group, bucket.world_size)])


# Hooks that leave only the rank's shard reduced say so; DDP refuses them without the
# distributed optimizer (an unsharded optimizer would step on unreduced gradients).
reduce_scatter_hook.shard_only = True  # type: ignore[attr-defined]


def _compress_wrapper(dtype: torch.dtype, hook: CommHook) -> CommHook:
    def wrapped(state: Any, bucket: "GradBucket") -> comm.CommHandle:
        full = bucket.buffer()
        if full.dtype == dtype:
            return hook(state, bucket)
        low = full.to(dtype)
        inner = hook(state, bucket.with_buffer(low))

        def copy_back() -> None:
            inner.wait()
            full.copy_(low)  # decompress; for reduce-scatter only the shard is meaningful

        return comm.CommHandle([], then=copy_back)

    wrapped.__name__ = f"{str(dtype).split('.')[-1]}_compress_{getattr(hook, '__name__', 'hook')}"
    wrapped.shard_only = getattr(hook, "shard_only", False)  # type: ignore[attr-defined]
    return wrapped


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """Communicate in fp16 (half the bytes of fp32), decompress into the original buffer."""
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """Communicate in bf16 (fp32 range, 8-bit mantissa)."""
    return _compress_wrapper(torch.bfloat16, hook)
