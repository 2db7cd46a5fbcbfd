"""ZeRO-1/2 distributed optimizer over DDP's bucketed buffers (Megatron's DistributedOptimizer).

Owns: which contiguous 1/world shard of every bucket this rank updates; fp32 masters and Adam
state for that shard only; the all-reduce of the squared grad norm (the clip norm is global
across ranks and shards, trap 8); the parameter all-gather after the step (optionally overlapped
with the next forward via forward pre-hooks); and for ZeRO-2 releasing the gradient buffer once
the owned shard has been copied out.
It must never keep optimizer state for elements it doesn't own, and never step with gradients
that were not reduced for its shard.

ZeRO-2 memory: the owned gradient shard is copied into a persistent fp32 tensor of 1/world
size, then DDP's whole gradient buffer storage is freed (`untyped_storage().resize_(0)`; the
main_grad views stay valid) until the next backward/zero_grad re-allocates it lazily. So during
the optimizer step, and between steps, a rank holds 1/world of the gradients; during backward
(and gradient accumulation) the full buffer exists, as it must for the reduce-scatter input.
"""
from __future__ import annotations

from typing import Optional

import torch

from optimizer.mixed_precision_optimizer import MixedPrecisionOptimizer
from optimizer.optimizer_config import OptimizerConfig
from parallel import comm


class DistributedOptimizer(MixedPrecisionOptimizer):
    sharded = True

    def __init__(self, ddp, config: OptimizerConfig):
        if not ddp.config.use_distributed_optimizer:
            # Trap 7 in reverse: a sharded optimizer needs DDP's buckets sharded too (padding,
            # reduce-scatter). Fail loudly instead of silently all-reducing.
            raise ValueError("use_distributed_optimizer=True needs DDPConfig(use_distributed_optimizer=True)")
        self.zero_stage = config.zero_stage
        self._gather_handles: dict[int, comm.CommHandle] = {}
        self._orphan_buckets: list[int] = []
        self.param_gather_bytes = 0  # payload bytes of parameter all-gathers (cumulative)
        super().__init__(ddp, config)
        self._pre_hooks = []
        if config.overlap_param_gather:
            self._register_forward_pre_hooks()

    def owned_range(self, bucket) -> tuple[int, int]:
        return bucket.shard_range(self.rank, self.world_size)

    def _keep_grad_store(self, param: torch.Tensor) -> bool:
        return self.zero_stage == 2 or param.main_grad.dtype != torch.float32

    def _reduce_sumsq(self, sumsq: torch.Tensor) -> float:
        sumsq = sumsq.detach().clone().reshape(1)
        comm.all_reduce_sum_blocking(sumsq, self.group, self.world_size)
        return float(sumsq.item())

    def _after_grads_loaded(self) -> None:
        if self.zero_stage == 2:
            for buf in self.ddp.buffers_:
                buf.release_grad_storage()

    def _after_step(self, bucket_indices: list[int]) -> None:
        for idx in self._ordered(bucket_indices):
            self._gather_bucket(idx)
        if not self.config.overlap_param_gather:
            self.finish_param_sync()

    def _ordered(self, bucket_indices: list[int]) -> list[int]:
        """Forward order: buckets of directly-used ("orphan") params first, then the last bucket
        (first layers) down to bucket 0 (last layers). Same order on every rank."""
        first = [i for i in self._orphan_buckets if i in bucket_indices]
        return first + [i for i in sorted(bucket_indices, reverse=True) if i not in first]

    def _gather_bucket(self, idx: int) -> None:
        b = self.ddp.buckets[idx]
        lo, hi = b.shard_range(self.rank, self.world_size)
        data = b.param_data
        work = comm.all_gather(data, data[lo:hi], self.group, self.world_size)
        if self.world_size > 1:
            self.param_gather_bytes += data.numel() * data.element_size()
        self._gather_handles[idx] = comm.CommHandle([work])

    def finish_param_sync(self) -> None:
        for h in self._gather_handles.values():
            h.wait()
        self._gather_handles.clear()

    def _after_load(self) -> None:
        for idx in range(len(self.ddp.buckets)):
            self._gather_bucket(idx)
        self.finish_param_sync()

    # ---------------------------------------------------------------- overlap_param_gather
    # Each called module waits, in its forward pre-hook, for the buckets of every parameter in its
    # subtree, so later layers' gathers keep running while earlier layers compute. A parameter
    # used WITHOUT calling a module that contains it (e.g. `F.linear(h, self.lm_head.weight)`, or
    # k/v weights concatenated inside the attention module's forward are fine: their ancestor is
    # called) is an "orphan": the root's pre-hook waits for it, and its bucket is gathered first.
    # Orphans are found on the first forward (nothing is in flight then: no step has run yet),
    # and any module later seen NOT called in a forward turns its params into orphans.
    def _register_forward_pre_hooks(self) -> None:
        p2b = self.ddp.param_to_bucket
        root = self.ddp.module
        self._calibrated = False
        self._called: set[int] = set()
        self._covering: set[int] = set()  # ids of non-root modules seen called in every forward
        self._orphan_buckets: list[int] = []
        self._subtree_buckets: dict[int, list[int]] = {}
        self._modules = {id(m): m for m in root.modules()}
        for m in root.modules():
            idxs = sorted({p2b[p].index for p in m.parameters() if p in p2b})
            self._subtree_buckets[id(m)] = idxs
            if m is not root and idxs:
                self._pre_hooks.append(m.register_forward_pre_hook(
                    lambda mod, _a: self._module_pre_forward(mod)))
        self._pre_hooks.append(root.register_forward_pre_hook(lambda _m, _a: self._root_pre_forward()))
        self._pre_hooks.append(root.register_forward_hook(lambda _m, _a, _o: self._root_post_forward()))

    def _module_pre_forward(self, module) -> None:
        self._called.add(id(module))
        self._wait_buckets(self._subtree_buckets[id(module)])

    def _root_pre_forward(self) -> None:
        self._called = set()
        if not self._calibrated:
            self.finish_param_sync()
            return
        root = self.ddp.module
        p2b = self.ddp.param_to_bucket
        direct = sorted({p2b[p].index for p in root.parameters(recurse=False) if p in p2b})
        self._wait_buckets(direct + self._orphan_buckets)

    def _root_post_forward(self) -> None:
        covering = self._called if not self._calibrated else (self._covering & self._called)
        if not self._calibrated or covering != self._covering:
            self._covering = covering
            covered = {id(p) for mid in covering for p in self._modules[mid].parameters()}
            orphans = {b.index for p, b in self.ddp.param_to_bucket.items() if id(p) not in covered}
            self._orphan_buckets = sorted(orphans, reverse=True)
            self._calibrated = True

    def _wait_buckets(self, idxs: list[int]) -> None:
        for i in idxs:
            h: Optional[comm.CommHandle] = self._gather_handles.pop(i, None)
            if h is not None:
                h.wait()
