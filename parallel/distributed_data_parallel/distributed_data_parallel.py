"""Megatron-style data-parallel wrapper: contiguous buffers, buckets, grad-ready hooks.

Owns: grouping parameters into one ParamAndGradBuffer per (param dtype, grad dtype); the
post-accumulate-grad hooks that move each `.grad` into `param.main_grad` and, once every
parameter of a bucket is ready, launch that bucket's comm hook; `no_sync()`; waiting for all
communication in `finish_grad_sync()` (once per step: calling it again is a no-op); refusing
gradients that would be added to a bucket already handed to communication; broadcasting every
parameter and buffer at start; running the optimizer's pre-forward callbacks outside any
torch.compile graph.
It must never change the model's dtype, step an optimizer, or scale a loss.

Gradient convention: autograd still writes `param.grad`; our hook adds it into `param.main_grad`
(a view into the gradient buffer) and sets `param.grad = None`. So after backward the
gradients live ONLY in `main_grad`; the optimizers in optimizer/ read them from there.
Expert parallelism: a parameter marked with SHARD_OF_ATTR (parallel/transforms/expert_parallel.py) is this rank's
slice of a tensor split over the expert-parallel ranks; such parameters get buffers of their own, reduced (ZeRO:
sharded) over `expert_group`, the ranks holding the same slice, but divided by the same world size as every other
gradient (the all-to-all's backward already summed the expert-parallel ranks' tokens into them).
Except after `keep_grads_on_params()` (one process, one micro-batch per step, asked for by the
optimizer that reads `.grad` itself): then there are no hooks, the gradient buffers hold no memory and
the gradients stay in `param.grad`, until `restore_grad_buffers()`.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from utils import comm
from parallel.comm_hooks import CommHook, CommHookState, allreduce_hook, reduce_scatter_hook
from parallel.distributed_data_parallel.ddp_config import DDPConfig
from parallel.distributed_data_parallel.param_and_grad_buffer import (Bucket, GradBucket,
                                                                      ParamAndGradBuffer)

# on a parameter that is this rank's slice of a larger tensor (an expert-parallel shard): (the full tensor's shape,
# the slice's first element in the full tensor's flat view)
SHARD_OF_ATTR = "shard_of"


class DistributedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, config: Optional[DDPConfig] = None,
                 process_group: Optional[dist.ProcessGroup] = None, expert_group: Optional[dist.ProcessGroup] = None,
                 expert_parallel_group: Optional[dist.ProcessGroup] = None):
        """expert_group: the ranks that hold the same expert-parallel shards (SHARD_OF_ATTR), which their gradients
        are reduced over; expert_parallel_group: the ranks holding the other shards (the optimizer sums the
        shards' gradient norms over it)."""
        super().__init__()
        self.module = module
        self.config = config or DDPConfig()
        self.process_group = process_group
        self.rank, self.world_size = comm.group_rank_and_size(process_group)
        self.expert_group, self.expert_parallel_group = expert_group, expert_parallel_group
        expert_rank, expert_world = comm.group_rank_and_size(expert_group)

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
        by_dtype: dict[tuple[torch.dtype, bool], list[tuple[str, nn.Parameter]]] = {}
        for n, p in named:  # expert-parallel shards in buffers of their own
            by_dtype.setdefault((p.dtype, self.shard_of(p) is not None), []).append((n, p))
        if any(expert for _, expert in by_dtype) and expert_group is None and self.world_size > 1:
            raise ValueError("expert-parallel shards (SHARD_OF_ATTR) need the expert_group they are reduced over")
        self.buffers_: list[ParamAndGradBuffer] = []
        self.buckets: list[Bucket] = []
        for (dtype, expert), params in by_dtype.items():
            grad_dtype = torch.float32 if self.config.grad_reduce_in_fp32 else dtype
            group, rank, world = (expert_group, expert_rank, expert_world) if expert else \
                (process_group, self.rank, self.world_size)
            buf = ParamAndGradBuffer(params, grad_dtype, self.config.bucket_size, world,
                                     self.config.pad_alignment, self.config.param_alignment,
                                     first_bucket_index=len(self.buckets), group=group, rank=rank, expert=expert)
            self.buffers_.append(buf)
            self.buckets.extend(buf.buckets)
        if any(expert for _, expert in by_dtype):  # launch order = backward order across the experts' buffers too
            at = {id(p): i for i, (_, p) in enumerate(named)}
            self.buckets.sort(key=lambda b: min(at[id(s.param)] for s in b.slots))
            for i, b in enumerate(self.buckets):
                b.index = i
        self.param_to_bucket: dict[nn.Parameter, Bucket] = {
            s.param: b for b in self.buckets for s in b.slots}

        default_hook = reduce_scatter_hook if self.config.use_distributed_optimizer else allreduce_hook
        self._hook: CommHook = default_hook
        self._hook_state: Any = CommHookState()

        self._sync_enabled = True
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._handles: dict[int, comm.CommHandle] = {}
        self._launch_order: list[int] = []
        self._last_launch_order: list[int] = []
        self._next_launch = 0  # buckets are launched in index order, see _grad_ready
        self._finished: set[int] = set()  # launched buckets already waited (callbacks ran)
        # True from the end of finish_grad_sync() until the next gradient or zero_grad_buffer():
        # the buffers hold this step's reduced gradients and must not be reduced again.
        self._synced = False
        # Gradients are not zeroed between steps (`zero_grad_buffer`): a parameter's first gradient since then
        # is copied over its stale main_grad, later ones added (`_graded`: ids of the parameters written since),
        # and the main_grad of a parameter no gradient reached is zeroed when its bucket is launched.
        self._stale = False
        self._graded: set[int] = set()
        # A bucket's gradients are written into its buffer together, when its last one arrived (or at its launch):
        # one multi-tensor copy (bf16 -> fp32 in one launch) instead of one copy per parameter. bucket index ->
        # [(param, grad, first)]; `first`: copied over the stale value, else added.
        self._pending: list[list[tuple]] = [[] for _ in self.buckets]
        self._bucket_synced_callbacks: list[Callable[[Bucket], None]] = []
        self._pre_forward_callbacks: list[Callable[[bool], None]] = []
        self._bytes_at_sync_start = 0
        self.last_step_comm_bytes = 0
        # The hooks live on the parameters and reach this wrapper only through a weak reference: a
        # strong one (the bound method) would make param -> hook -> wrapper -> module -> param a cycle
        # that the garbage collector cannot break (autograd holds the parameters from C++), so a
        # dropped wrapper, its buffers and its optimizer would stay in memory for the process's life.
        # When the wrapper is collected its hooks are removed, and so are the parameters' main_grad
        # views, which would otherwise keep the gradient buffers alive with the model.
        self._hook_removers: list = []
        self._register_grad_hooks()
        weakref.finalize(self, _detach_from_params, self._hook_removers, list(self.param_to_bucket))
        self.grads_on_params = False  # keep_grads_on_params()

    def _register_grad_hooks(self) -> None:
        hook = _weak_grad_ready(weakref.ref(self))
        self._hook_removers.extend(p.register_post_accumulate_grad_hook(hook) for p in self.param_to_bucket)

    # ------------------------------------------------------------------ public API
    def forward(self, *args, **kwargs):
        if self._pre_forward_callbacks:
            # Outside any compiled graph (torch.compiler.disable): a collective's wait must run
            # on every call, with THIS instance's handles, never be traced away or reused from
            # another instance's graph. `compiled` is a constant True inside a traced forward.
            _PRE_FORWARD_RUNNER(self, torch.compiler.is_compiling())
        return self.module(*args, **kwargs)

    def register_pre_forward_callback(self, fn: Callable[[bool], None]) -> None:
        """`fn(compiled)` runs eagerly at the start of every forward (the ZeRO optimizer waits
        for in-flight parameter all-gathers there); `compiled` is True when this forward is
        being run by torch.compile."""
        global _PRE_FORWARD_RUNNER
        if _PRE_FORWARD_RUNNER is None:
            _PRE_FORWARD_RUNNER = torch.compiler.disable(_run_pre_forward_callbacks)
        self._pre_forward_callbacks.append(fn)

    def register_bucket_synced_callback(self, fn: Callable[[Bucket], None]) -> None:
        """`fn(bucket)` runs once per step right after the bucket's communication was waited:
        in finish_grad_sync(), or earlier in backward when the default hooks report the
        collective complete (ZeRO-2 frees the bucket's gradient memory there)."""
        self._bucket_synced_callbacks.append(fn)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the bucket communication. With use_distributed_optimizer the hook must leave
        at least the rank's shard reduced (reduce-scatter or anything stronger)."""
        if self._handles:
            raise RuntimeError("register_comm_hook while communication is in flight")
        self.restore_grad_buffers()  # a comm hook reads the buckets
        if getattr(hook, "shard_only", False) and not self.config.use_distributed_optimizer:
            raise ValueError(f"{getattr(hook, '__name__', 'this hook')} leaves only each rank's shard "
                             "reduced; it needs DDPConfig(use_distributed_optimizer=True) and the "
                             "distributed optimizer (an unsharded optimizer would use unreduced grads)")
        self._hook, self._hook_state = hook, (state if state is not None else CommHookState())

    @staticmethod
    def shard_of(param: torch.Tensor) -> Optional[tuple]:
        """(the full tensor's shape, this slice's first flat element) of an expert-parallel shard, else None."""
        return getattr(param, SHARD_OF_ATTR, None)

    def plain_reduction(self) -> bool:
        """Whether the gradient communication is the default all-reduce / reduce-scatter: it writes nothing but
        the reduced sums, so the buffers' alignment gaps stay zero (PowerSGD writes its approximation there)."""
        return self._hook in (allreduce_hook, reduce_scatter_hook)

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

    def keep_grads_on_params(self) -> None:
        """One process and ONE micro-batch per step (the caller's promise: no_sync() refuses from now on):
        nothing is reduced or accumulated, so the gradients stay in `param.grad` where autograd writes them,
        for an optimizer that reads them there (optimizer/flat_adamw.py ParamGrads). The grad-ready hooks are
        removed (no Python call per parameter in backward) and the gradient buffers' memory is released
        (main_grad views then hold nothing: reading one fails). `restore_grad_buffers()` undoes it."""
        if self.world_size != 1 or not self.plain_reduction() or self.config.use_distributed_optimizer:
            raise ValueError("keep_grads_on_params: only in one process, with the default all-reduce and an "
                             "unsharded optimizer (there the gradient buffers only copy the gradients)")
        if self._handles or any(self._pending):
            raise RuntimeError("keep_grads_on_params() between steps only (gradients are pending or in flight)")
        if self.grads_on_params:
            return
        for r in self._hook_removers:
            r.remove()
        self._hook_removers.clear()
        for buf in self.buffers_:
            buf.release_grad_storage()
        self.grads_on_params = True

    def restore_grad_buffers(self) -> None:
        """Back from keep_grads_on_params(): the buffers re-allocated (zeroed), the gradients now in
        `param.grad` moved into main_grad (this step's, as if the hooks had written them), the hooks back."""
        if not self.grads_on_params:
            return
        for buf in self.buffers_:
            buf.ensure_grad_storage()
        self._graded.clear()
        for p in self.param_to_bucket:
            if p.grad is not None:
                p.main_grad.copy_(p.grad)
                self._graded.add(id(p))
                p.grad = None
        self._stale, self._synced = True, False  # parameters no gradient reached: zeroed at launch (already zero)
        self._register_grad_hooks()
        self.grads_on_params = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: grads keep accumulating in main_grad, nothing is launched.
        The first backward outside no_sync() launches the communication."""
        if self.grads_on_params:
            raise RuntimeError("no_sync(): this DDP keeps the gradients on the parameters (keep_grads_on_params: "
                               "built for one micro-batch per step); gradient accumulation needs its fp32 "
                               "buffers: build the engine with gradient_accumulation_steps > 1")
        prev, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = prev

    def zero_grad_buffer(self) -> None:
        """Start a new step's gradients. With the default communication (all-reduce, reduce-scatter) nothing is
        written here: each parameter's first gradient of the step is COPIED into its main_grad (later ones
        added), and a parameter that gets none is zeroed when its bucket is launched, so every main_grad holds
        this step's gradient whenever it is read (after finish_grad_sync). That saves a zero-fill and a read of
        the whole fp32 buffer per step (8 bytes per parameter: 9 GB a step at 1B). A custom comm hook (PowerSGD
        writes approximations into the alignment gaps too) gets the buffers zeroed as before."""
        if self._handles:
            raise RuntimeError("zero_grad_buffer() before finish_grad_sync()")
        # (keep_grads_on_params needs the default communication: the released buffers are never zero-filled here)
        self._stale = self.plain_reduction()
        if not self._stale:
            for buf in self.buffers_:
                buf.zero_grad()
        self._graded.clear()
        for pending in self._pending:  # gradients not yet written (a backward without a step): dropped, as zeroed
            pending.clear()
        for p in self.param_to_bucket:
            p.grad = None
        self._synced = False

    def start_grad_sync(self) -> None:
        """Launch every bucket not launched yet (all of them when overlap_grad_reduce is off;
        buckets holding a parameter that got no gradient this step otherwise)."""
        if self.grads_on_params:  # nothing to reduce: the gradients are final in param.grad
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])

    def finish_grad_sync(self, on_bucket_done: Optional[Callable[[Bucket], None]] = None) -> None:
        """Wait for every bucket's communication, in launch order. `on_bucket_done(bucket)` runs
        right after each bucket's data arrived (overlap_optim_step uses it).
        Called again with no new gradient in between, it reduces nothing (a second reduction
        would be wrong for reduce-scatter, and ZeRO-2 has freed the buffers) and only replays
        `on_bucket_done` in the last launch order."""
        if self.grads_on_params:
            if on_bucket_done is not None:
                raise RuntimeError("finish_grad_sync(on_bucket_done): the gradients are on the parameters, not in "
                                   "buckets (keep_grads_on_params)")
            self._synced = True
            return
        if self._synced:
            if on_bucket_done is not None:
                for idx in self._last_launch_order:
                    on_bucket_done(self.buckets[idx])
            return
        self.start_grad_sync()
        for idx in list(self._launch_order):
            self._finish_bucket(idx)
            if on_bucket_done is not None:
                on_bucket_done(self.buckets[idx])
        self._last_launch_order = list(self._launch_order)
        self._handles.clear()
        self._launch_order.clear()
        self._finished.clear()
        self._next_launch = 0
        for r in self._ready:
            r.clear()
        self._synced = True
        end = getattr(self._hook_state, "on_sync_end", None)
        if end is not None:
            end()
        self.last_step_comm_bytes = getattr(self._hook_state, "bytes_sent", 0) - self._bytes_at_sync_start

    def broadcast_params(self, coalesce_bytes: int = 64 * 2**20) -> None:
        """Make every rank start from rank 0's parameters AND buffers: the trainable parameters
        flat (one broadcast per buffer), then every other tensor (frozen parameters such as a
        LoRA base, module buffers such as running stats or rope caches) in registration order,
        packed per dtype into chunks of at most `coalesce_bytes`. Expert-parallel shards come from
        the first rank holding the same ones (over their expert group), frozen ones too."""
        if self.world_size == 1:
            return
        src = _first_rank(self.process_group, 0)
        for buf in self.buffers_:  # expert shards: from the first rank holding the same ones
            if buf.world_size > 1:
                dist.broadcast(buf.param_data, src=_first_rank(buf.group, src), group=buf.group)
        rest = [p for p in self.module.parameters() if p not in self.param_to_bucket]
        frozen_shards = [p.data for p in rest if self.shard_of(p) is not None]  # (LoRA on the experts: their weights)
        if frozen_shards and comm.group_rank_and_size(self.expert_group)[1] > 1:
            _broadcast_coalesced(frozen_shards, _first_rank(self.expert_group, src), self.expert_group, coalesce_bytes)
        rest = [p for p in rest if self.shard_of(p) is None] + list(self.module.buffers())
        _broadcast_coalesced([t.data for t in rest], src, self.process_group, coalesce_bytes)

    def grad_buffer_bytes(self) -> int:
        """Bytes currently held by the gradient buffers (ZeRO-2 frees each bucket after its
        reduce-scatter; the optimizer's own copies are `opt.grad_store_bytes()`)."""
        return sum(b.grad_bytes_allocated() for b in self.buffers_)

    # ------------------------------------------------------------------ internals
    def _grad_ready(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        bucket = self.param_to_bucket[param]
        self._check_can_accumulate(param, bucket)
        self._synced = False
        bucket.ensure_grad_storage()  # a lazily re-allocated ZeRO-2 bucket
        first = self._stale and id(param) not in self._graded  # its first gradient since zero_grad_buffer
        self._graded.add(id(param))
        grad, param.grad = param.grad, None  # autograd's next gradient for it starts afresh, never adds to this
        if not self._sync_enabled:  # a no_sync() micro-batch: into the buffer now (nothing launches)
            (param.main_grad.copy_ if first else param.main_grad.add_)(grad)
            return
        self._pending[bucket.index].append((param, grad, first))
        ready = self._ready[bucket.index]
        ready.add(id(param))
        complete = len(ready) == len(bucket.slots)
        if complete:
            self._write_pending(bucket.index)
        if self.config.overlap_grad_reduce and complete:
            # Launch strictly in bucket order so every rank issues its collectives in the same
            # sequence even if (data-dependent) readiness order differs between ranks.
            while (self._next_launch < len(self.buckets)
                   and len(self._ready[self._next_launch]) == len(self.buckets[self._next_launch].slots)):
                self._launch(self.buckets[self._next_launch])
            if self._bucket_synced_callbacks and self._hook in (allreduce_hook, reduce_scatter_hook):
                # Their handles are plain Works, so is_completed() is exact and wait() does not
                # block: finish (and let ZeRO-2 free) every bucket already reduced, in order.
                for idx in self._launch_order:
                    if idx in self._finished:
                        continue
                    if not self._handles[idx].is_completed():
                        break
                    self._finish_bucket(idx)

    def _write_pending(self, idx: int) -> None:
        """The bucket's gradients that arrived since its last write, into its buffer: first ones copied (one
        multi-tensor launch for the bucket, casting bf16 to fp32), later ones added, in arrival order."""
        pending = self._pending[idx]
        if not pending:
            return
        self._pending[idx] = []
        copies = [(p.main_grad, g) for p, g, first in pending if first]
        if copies:
            torch._foreach_copy_([d for d, _ in copies], [g for _, g in copies])
        for p, g, first in pending:
            if not first:
                p.main_grad.add_(g)

    def _check_can_accumulate(self, param: torch.Tensor, bucket: Bucket) -> None:
        """A gradient may not be added to a bucket whose communication already started (its
        buffer is being, or has been, reduced): that silently mixes reduced and local values."""
        if bucket.index in self._handles:
            raise RuntimeError(
                f"backward() produced a gradient for {self.param_names[param]!r} after its bucket's "
                "gradient communication had already started in this step (a second backward() "
                "without no_sync() while overlap_grad_reduce=True); the result would be wrong. To "
                "accumulate gradients over several backward() calls, run every one but the last "
                "inside `with ddp.no_sync():`, or finish the step (opt.step(), or "
                "ddp.finish_grad_sync() with an unsharded optimizer) before the next backward().")
        if self._synced and self.config.use_distributed_optimizer:
            raise RuntimeError(
                f"backward() produced a gradient for {self.param_names[param]!r} after this step's "
                "gradients were already reduced (finish_grad_sync() or opt.step() ran) and not "
                "zeroed: with the distributed optimizer only each rank's shard was reduced (and "
                "ZeRO-2 freed the rest), so nothing can be accumulated on top. Call opt.zero_grad() "
                "before the next step's backward(); accumulate micro-batches with `with ddp.no_sync():`.")

    def _finish_bucket(self, idx: int) -> None:
        if idx in self._finished:
            return
        self._handles[idx].wait()
        self._finished.add(idx)
        for fn in self._bucket_synced_callbacks:
            fn(self.buckets[idx])

    def _launch(self, bucket: Bucket) -> None:
        if not self._launch_order:
            self._bytes_at_sync_start = getattr(self._hook_state, "bytes_sent", 0)
        bucket.ensure_grad_storage()  # a ZeRO-2 bucket no gradient reached this step
        self._write_pending(bucket.index)  # a bucket launched with a parameter no gradient reached
        if self._stale:  # a parameter no gradient reached since zero_grad_buffer: zero, not last step's
            for slot in bucket.slots:
                if id(slot.param) not in self._graded:
                    slot.param.main_grad.zero_()
                    self._graded.add(id(slot.param))
        if self.world_size > 1:
            # Average like torch DDP: divide first, then every hook SUMs (expert shards too: over fewer ranks,
            # their gradients already summed over the expert-parallel ones)
            bucket.grad_data.mul_(1.0 / self.world_size)
        buf = bucket.buffer
        gb = GradBucket(bucket, buf.group, buf.rank, buf.world_size)
        self._handles[bucket.index] = self._hook(self._hook_state, gb)
        self._launch_order.append(bucket.index)
        self._next_launch = bucket.index + 1


def _weak_grad_ready(ref: "weakref.ReferenceType[DistributedDataParallel]") -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._grad_ready(param)
    return hook


def _detach_from_params(removers: list, params: list) -> None:
    for r in removers:
        r.remove()
    for p in params:
        if hasattr(p, "main_grad"):
            del p.main_grad


def _run_pre_forward_callbacks(ddp: DistributedDataParallel, compiled: bool) -> None:
    for fn in ddp._pre_forward_callbacks:
        fn(compiled)


# torch.compiler.disable(_run_pre_forward_callbacks), made on the first registration (importing
# dynamo costs ~1.5 s, paid only by runs that need it). Never traced: dynamo calls it as is on
# every run of a compiled forward (a graph break before the module) with the runtime `ddp`, so
# waits can neither be traced away nor taken from another instance whose graph this one reuses.
_PRE_FORWARD_RUNNER: Optional[Callable[[DistributedDataParallel, bool], None]] = None


def _first_rank(group: Optional[dist.ProcessGroup], default: int) -> int:
    """The global rank of `group`'s first member (`default` for the default group: None)."""
    return dist.get_global_rank(group, 0) if group is not None else default


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, group: Optional[dist.ProcessGroup],
                         chunk_bytes: int) -> None:
    """Broadcast `tensors` (any layout) from `src`, packed per (dtype, device) into flat chunks."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for i, t in enumerate(ts):
            chunk.append(t)
            size += t.numel() * t.element_size()
            if size >= chunk_bytes or i == len(ts) - 1:
                flat = torch.cat([c.reshape(-1) for c in chunk])
                dist.broadcast(flat, src=src, group=group)
                off = 0
                for c in chunk:
                    c.copy_(flat[off:off + c.numel()].view(c.shape))
                    off += c.numel()
                chunk, size = [], 0
