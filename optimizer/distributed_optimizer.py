"""ZeRO-1/2 distributed optimizer over DDP's bucketed buffers (Megatron's DistributedOptimizer).

Owns: which contiguous 1/world shard of every bucket this rank updates (of an expert-parallel buffer: 1/its group's
size, the ranks holding the same experts); fp32 masters and Adam
state for that shard only; the all-reduce of the squared grad norm (the clip norm is global
across ranks and shards, trap 8); the parameter all-gather after the step, in an order fixed at
construction (optionally overlapped with the next forward via forward pre-hooks); and for ZeRO-2
freeing each bucket's gradient memory as soon as its reduce-scatter finished.
It must never keep optimizer state for elements it doesn't own, never step with gradients
that were not reduced for its shard, and never issue collectives in an order that depends on
what one rank saw (a data-dependent forward): only the model decides it. Like its base class it
reaches our DDP (parallel/) by duck typing, never by an import; its collectives are utils/comm.py's.

Gradient memory per rank (`ddp.grad_buffer_bytes() + opt.grad_store_bytes()`), with G the
gradient buffer (every bucket, padded) and W the world size:
- ZeRO-1: G, always (fp32 grads are read in place; non-fp32 grads add persistent fp32 copies of
  the owned shard, G_shard).
- ZeRO-2: each bucket has its own storage, allocated (zeroed) by the first gradient that reaches
  it in backward; right after the bucket's reduce-scatter completes (seen at a later grad hook
  with the default hooks, else in finish_grad_sync) its owned 1/W is copied to an fp32 tensor
  and the bucket's storage is freed. So during backward it holds at most G (the buckets that
  got gradients; minus (W-1)/W of every bucket already reduced), after finish_grad_sync
  exactly the fp32 shards (G/W for fp32 grads), and after the step nothing (the shards are
  dropped with the step's grads). Gradient accumulation under no_sync() holds the touched
  buckets in full until the last micro-batch's reduce-scatter, as it must (they are its input).
  Transiently, one bucket's shard exists twice while it is copied out.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from optimizer.mixed_precision_optimizer import MixedPrecisionOptimizer
from optimizer.optimizer_config import OptimizerConfig
from utils import comm


class DistributedOptimizer(MixedPrecisionOptimizer):
    sharded = True

    def __init__(self, ddp, config: OptimizerConfig, norm_groups: Sequence = (), *, path: Optional[str] = None):
        if not ddp.config.use_distributed_optimizer:
            # Trap 7 in reverse: a sharded optimizer needs DDP's buckets sharded too (padding,
            # reduce-scatter). Fail loudly instead of silently all-reducing.
            raise ValueError("use_distributed_optimizer=True needs DDPConfig(use_distributed_optimizer=True)")
        self.zero_stage = config.zero_stage
        self._gather_handles: dict[int, comm.CommHandle] = {}
        self._orphan_buckets: list[int] = []
        self._grad_shards: dict[int, torch.Tensor] = {}  # ZeRO-2: bucket index -> owned fp32 grads
        self.param_gather_bytes = 0  # payload bytes of parameter all-gathers (cumulative)
        super().__init__(ddp, config, norm_groups, path=path)
        self._gather_order = self._static_gather_order()
        if self.zero_stage == 2:
            self._slot_start = {(b.index, id(s.param)): s.start for b in ddp.buckets for s in b.slots}
            for buf in ddp.buffers_:
                buf.split_grad_storage()
            ddp.register_bucket_synced_callback(self._release_bucket_grads)
        self._pre_hooks = []
        if config.overlap_param_gather:
            self._register_forward_pre_hooks()
            ddp.register_pre_forward_callback(self._ddp_pre_forward)

    def owned_range(self, bucket) -> tuple[int, int]:
        # an expert-parallel buffer is sharded over its own group (the ranks holding the same experts)
        buf = bucket.buffer
        return bucket.shard_range(buf.rank, buf.world_size) if getattr(buf, "expert", False) else \
            bucket.shard_range(self.rank, self.world_size)

    def _keep_grad_store(self, param: torch.Tensor) -> bool:
        # ZeRO-2 keeps no persistent copy: each bucket's shard is copied out when it is reduced.
        return self.zero_stage == 1 and param.main_grad.dtype != torch.float32

    def grad_store_bytes(self) -> int:
        """Bytes of gradient copies the optimizer holds outside DDP's buffers (ZeRO-1: persistent
        fp32 shard stores of non-fp32 grads; ZeRO-2: the owned shards of reduced buckets).
        `ddp.grad_buffer_bytes() + opt.grad_store_bytes()` is all the gradient memory of a rank."""
        stores = sum(fb.grad_store.numel() * fb.grad_store.element_size()
                     for fb in self.flat_buckets.values() if fb.grad_store is not None)
        return stores + sum(t.numel() * t.element_size() for t in self._grad_shards.values())

    # ---------------------------------------------------------------- ZeRO-2 gradient release
    def _release_bucket_grads(self, bucket) -> None:
        """DDP calls this right after the bucket's reduce-scatter was waited: keep the owned
        shard (fp32), free the bucket's whole gradient storage."""
        if not bucket.grad_storage_allocated():
            return
        lo, hi = self.owned_range(bucket)
        self._grad_shards[bucket.index] = bucket.grad_data[lo:hi].to(torch.float32, copy=True)
        bucket.release_grad_storage()

    def load_grads(self, pieces) -> None:
        if self.zero_stage != 2:
            return super().load_grads(pieces)
        for pc in pieces:
            bucket = self.ddp.buckets[pc.bucket_index]
            shard = self._grad_shards.get(pc.bucket_index)
            if shard is None:
                raise RuntimeError(f"ZeRO-2: bucket {pc.bucket_index} was not reduced before the step")
            off = self._slot_start[(pc.bucket_index, id(pc.param))] + pc.lo - self.owned_range(bucket)[0]
            pc.main.grad = shard[off:off + pc.hi - pc.lo].view(pc.main.shape)

    def _drop_grads(self) -> None:
        super()._drop_grads()
        self._grad_shards.clear()  # ZeRO-2 holds no gradient memory between steps

    def reduce_sumsq(self, sumsq: torch.Tensor) -> torch.Tensor:
        sumsq = sumsq.detach().clone().reshape(1)
        comm.all_reduce_sum_blocking(sumsq, self.group, self.world_size)
        return sumsq

    def reduce_expert_sumsq(self, sumsq: torch.Tensor) -> torch.Tensor:
        # each element of every expert is owned by one rank of the world: reduce_sumsq's SUM counts it once
        return sumsq

    def after_grads_loaded(self) -> None:
        if self.zero_stage == 2:
            for buf in self.ddp.buffers_:
                buf.release_grad_storage()

    def after_step(self, bucket_indices: list[int]) -> None:
        for idx in self._ordered(bucket_indices):
            self._gather_bucket(idx)
        if not self.config.overlap_param_gather:
            self.finish_param_sync()

    def _static_gather_order(self) -> list[int]:
        """The all-gather order, a pure function of the model (identical on every rank, whatever
        each rank's forward did): buckets holding parameters of the root module or of its direct
        leaf children first (embeddings, final norm, LM head: the usual candidates for being
        used without calling their module, like `F.linear(h, self.lm_head.weight)`, which the
        root's pre-hook must wait for), then the rest in forward order (last bucket first)."""
        root = self.ddp.module
        root = getattr(root, "_orig_mod", root)  # a torch.compile'd module
        early = {id(p) for p in root.parameters(recurse=False)}
        for child in root.children():
            if next(child.children(), None) is None:
                early.update(id(p) for p in child.parameters())
        first = sorted({b.index for p, b in self.ddp.param_to_bucket.items() if id(p) in early}, reverse=True)
        return first + [i for i in reversed(range(len(self.ddp.buckets))) if i not in first]

    def _ordered(self, bucket_indices: list[int]) -> list[int]:
        wanted = set(bucket_indices)
        return [i for i in self._gather_order if i in wanted]

    def _gather_bucket(self, idx: int) -> None:
        b = self.ddp.buckets[idx]
        lo, hi = self.owned_range(b)
        data = b.param_data
        group, world = (b.buffer.group, b.buffer.world_size) if getattr(b.buffer, "expert", False) else \
            (self.group, self.world_size)
        work = comm.all_gather(data, data[lo:hi], group, world)
        if world > 1:
            self.param_gather_bytes += data.numel() * data.element_size()
        self._gather_handles[idx] = comm.CommHandle([work])

    def finish_param_sync(self) -> None:
        for h in self._gather_handles.values():
            h.wait()
        self._gather_handles.clear()

    def after_load(self) -> None:
        for idx in range(len(self.ddp.buckets)):
            self._gather_bucket(idx)
        self.finish_param_sync()

    # ---------------------------------------------------------------- overlap_param_gather
    # Each called module waits, in its forward pre-hook, for the buckets of every parameter in its
    # subtree, so later layers' gathers keep running while earlier layers compute. A parameter
    # used WITHOUT calling a module that contains it (e.g. `F.linear(h, self.lm_head.weight)`, or
    # k/v weights concatenated inside the attention module's forward are fine: their ancestor is
    # called) is an "orphan": the root's pre-hook waits for it.
    # Orphans are found on the first forward (nothing is in flight then: no step has run yet),
    # and any module later seen NOT called in a forward turns its params into orphans. They are
    # per rank and only decide local waits; the gather ORDER never depends on them.
    # Under torch.compile the hooks are traced as no-ops and DDP.forward waits for every gather
    # before the compiled graph runs (_ddp_pre_forward): no overlap, but never a skipped wait.
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

    def _ddp_pre_forward(self, compiled: bool) -> None:
        """Runs eagerly at the start of DDP.forward. A compiled forward (or a compiled module
        inside) cannot run the per-module waits, so everything in flight is waited for here."""
        if self._gather_handles and (compiled or _contains_compiled(self.ddp.module)):
            self.finish_param_sync()

    def _module_pre_forward(self, module) -> None:
        if torch.compiler.is_compiling():
            return  # traced: _ddp_pre_forward already waited for every gather
        self._called.add(id(module))
        self._wait_buckets(self._subtree_buckets[id(module)])

    def _root_pre_forward(self) -> None:
        if torch.compiler.is_compiling():
            return
        self._called = set()
        if not self._calibrated:
            self.finish_param_sync()
            return
        root = self.ddp.module
        p2b = self.ddp.param_to_bucket
        direct = sorted({p2b[p].index for p in root.parameters(recurse=False) if p in p2b})
        self._wait_buckets(direct + self._orphan_buckets)

    def _root_post_forward(self) -> None:
        if torch.compiler.is_compiling():
            return
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


def _contains_compiled(module: nn.Module) -> bool:
    """True when torch.compile wraps the module or a submodule (torch.compile(m) or m.compile())."""
    return any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())
