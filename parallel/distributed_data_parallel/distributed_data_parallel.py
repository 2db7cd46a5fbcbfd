"""Megatron-style data-parallel wrapper: contiguous buffers, buckets, grad-ready hooks.

Owns: grouping parameters into one ParamAndGradBuffer per (param dtype, grad dtype); the
post-accumulate-grad hooks that move each `.grad` into `param.main_grad` and, once every
parameter of a bucket is ready, launch that bucket's comm hook; `no_sync()`; waiting for all
communication in `finish_grad_sync()`; broadcasting parameters at start.
It must never change the model's dtype, step an optimizer, or scale a loss.

Gradient convention: autograd still writes `param.grad`; our hook adds it into `param.main_grad`
(a view into the gradient buffer) and sets `param.grad = None`. So after backward the
gradients live ONLY in `main_grad`; the optimizers in optimizer/ read them from there.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel import comm
from parallel.comm_hooks import CommHook, CommHookState, allreduce_hook, reduce_scatter_hook
from parallel.distributed_data_parallel.ddp_config import DDPConfig
from parallel.distributed_data_parallel.param_and_grad_buffer import (Bucket, GradBucket,
                                                                      ParamAndGradBuffer)


class DistributedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, config: Optional[DDPConfig] = None,
                 process_group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        self.module = module
        self.config = config or DDPConfig()
        self.process_group = process_group
        self.rank, self.world_size = comm.group_rank_and_size(process_group)

        # Unique trainable params in reverse registration order: backward roughly visits them
        # in that order, so the first bucket completes first.
        seen: set[int] = set()
        named: list[tuple[str, nn.Parameter]] = []
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        named.reverse()
        self.param_names = {p: n for n, p in named}
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for n, p in named:
            by_dtype.setdefault(p.dtype, []).append((n, p))
        self.buffers_: list[ParamAndGradBuffer] = []
        self.buckets: list[Bucket] = []
        for dtype, params in by_dtype.items():
            grad_dtype = torch.float32 if self.config.grad_reduce_in_fp32 else dtype
            buf = ParamAndGradBuffer(params, grad_dtype, self.config.bucket_size, self.world_size,
                                     self.config.pad_alignment, self.config.param_alignment,
                                     first_bucket_index=len(self.buckets))
            self.buffers_.append(buf)
            self.buckets.extend(buf.buckets)
        self.param_to_bucket: dict[nn.Parameter, Bucket] = {
            s.param: b for b in self.buckets for s in b.slots}

        default_hook = reduce_scatter_hook if self.config.use_distributed_optimizer else allreduce_hook
        self._hook: CommHook = default_hook
        self._hook_state: Any = CommHookState()

        self._sync_enabled = True
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._handles: dict[int, comm.CommHandle] = {}
        self._launch_order: list[int] = []
        self._next_launch = 0  # buckets are launched in index order, see _grad_ready
        self._bytes_at_sync_start = 0
        self.last_step_comm_bytes = 0
        self._hook_removers = [p.register_post_accumulate_grad_hook(self._grad_ready)
                               for p in self.param_to_bucket]

    # ------------------------------------------------------------------ public API
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the bucket communication. With use_distributed_optimizer the hook must leave
        at least the rank's shard reduced (reduce-scatter or anything stronger)."""
        if self._handles:
            raise RuntimeError("register_comm_hook while communication is in flight")
        if getattr(hook, "shard_only", False) and not self.config.use_distributed_optimizer:
            raise ValueError(f"{getattr(hook, '__name__', 'this hook')} leaves only each rank's shard "
                             "reduced; it needs DDPConfig(use_distributed_optimizer=True) and the "
                             "distributed optimizer (an unsharded optimizer would use unreduced grads)")
        self._hook, self._hook_state = hook, (state if state is not None else CommHookState())

    @property
    def comm_hook_state(self) -> Any:
        return self._hook_state

    def comm_hook_state_dict(self) -> dict:
        sd = getattr(self._hook_state, "state_dict", None)
        return sd() if sd is not None else {}

    def load_comm_hook_state_dict(self, sd: dict) -> None:
        load = getattr(self._hook_state, "load_state_dict", None)
        if load is not None:
            load(sd)
        elif sd:
            raise ValueError("the registered comm hook state has no load_state_dict")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: grads keep accumulating in main_grad, nothing is launched.
        The first backward outside no_sync() launches the communication."""
        prev, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = prev

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer (re-allocating any storage freed by ZeRO-2)."""
        if self._handles:
            raise RuntimeError("zero_grad_buffer() before finish_grad_sync()")
        for buf in self.buffers_:
            if buf.grad_storage_allocated():
                buf.grad_data.zero_()
            else:
                buf.ensure_grad_storage()
        for p in self.param_to_bucket:
            p.grad = None

    def start_grad_sync(self) -> None:
        """Launch every bucket not launched yet (all of them when overlap_grad_reduce is off;
        buckets holding a parameter that got no gradient this step otherwise)."""
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])

    def finish_grad_sync(self, on_bucket_done: Optional[Callable[[Bucket], None]] = None) -> None:
        """Wait for every bucket's communication, in launch order. `on_bucket_done(bucket)` runs
        right after each bucket's data arrived (overlap_optim_step uses it)."""
        self.start_grad_sync()
        for idx in list(self._launch_order):
            self._handles[idx].wait()
            if on_bucket_done is not None:
                on_bucket_done(self.buckets[idx])
        self._handles.clear()
        self._launch_order.clear()
        self._next_launch = 0
        for r in self._ready:
            r.clear()
        end = getattr(self._hook_state, "on_sync_end", None)
        if end is not None:
            end()
        self.last_step_comm_bytes = getattr(self._hook_state, "bytes_sent", 0) - self._bytes_at_sync_start

    def broadcast_params(self) -> None:
        """Make every rank start from rank 0's parameters (buffers are broadcast flat)."""
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for buf in self.buffers_:
            dist.broadcast(buf.param_data, src=src, group=self.process_group)
        for t in self.module.buffers():  # e.g. running stats / rope caches
            dist.broadcast(t, src=src, group=self.process_group)

    def grad_buffer_bytes(self) -> int:
        """Bytes currently held by the gradient buffers (0 for a buffer freed by ZeRO-2)."""
        return sum(b.grad_bytes_allocated() for b in self.buffers_)

    # ------------------------------------------------------------------ internals
    def _grad_ready(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        bucket = self.param_to_bucket[param]
        bucket.buffer.ensure_grad_storage()  # a lazily re-allocated ZeRO-2 buffer
        param.main_grad.add_(param.grad)
        param.grad = None  # the gradient now lives only in the contiguous buffer
        if not self._sync_enabled:
            return
        ready = self._ready[bucket.index]
        ready.add(id(param))
        if self.config.overlap_grad_reduce and len(ready) == len(bucket.slots):
            # Launch strictly in bucket order so every rank issues its collectives in the same
            # sequence even if (data-dependent) readiness order differs between ranks.
            while (self._next_launch < len(self.buckets)
                   and len(self._ready[self._next_launch]) == len(self.buckets[self._next_launch].slots)):
                self._launch(self.buckets[self._next_launch])

    def _launch(self, bucket: Bucket) -> None:
        if not self._launch_order:
            self._bytes_at_sync_start = getattr(self._hook_state, "bytes_sent", 0)
        if self.world_size > 1:
            # Average like torch DDP: divide first, then every hook SUMs.
            bucket.grad_data.mul_(1.0 / self.world_size)
        gb = GradBucket(bucket, self.process_group, self.rank, self.world_size)
        self._handles[bucket.index] = self._hook(self._hook_state, gb)
        self._launch_order.append(bucket.index)
        self._next_launch = bucket.index + 1
