"""The optimizer over DDP's gradient buffers, with fp32 master params, loss scaling and global clipping.

Owns: the "pieces" the optimizer updates (one per parameter, or per parameter-shard for ZeRO), their fp32 master
copies when the model is bf16/fp16 (one flat master per bucket range), the flat fp32 gradient stores torch's AdamW
reads, its updates (AdamW, optimizer/adamw.py BucketAdamW, and with --optimizer=muon Muon beside it,
optimizer/muon.py MuonState), the skeleton's hooks over them (loss scaling, the global-norm clip and the skip
decision are optimizer/base.py's), telling a stateful comm hook (PowerSGD) whether the step was applied, and its
step path, chosen ONCE when it is built (optimizer/step_paths.py `choose_path`): `step()` runs that path, never
choosing. The state dict's format is optimizer/ddp_state.py's.
It must never change the model's dtype (trap 10), never read `param.grad` (DDP leaves gradients in
`param.main_grad`) except where it asked DDP to keep them there (`keep_grads_on_params`: one process, one
micro-batch per step, the one-launch AdamW), and never clip with a norm that is not global across ranks (trap 8).

It talks to our DDP (parallel/) by duck typing only (its buckets, buffers and finish_grad_sync), never
by importing it. The sharded subclass (optimizer/distributed_optimizer.py) only changes which bucket range a rank
owns, adds the norm all-reduce and the parameter all-gather.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from optimizer.adamw import BucketAdamW
from optimizer.base import GlobalNormOptimizer
from optimizer.ddp_state import (STATE_FORMAT, check_ddp_state_dict, ddp_state_dict,  # noqa: F401 (STATE_FORMAT: its
                                  load_ddp_state_dict, own_state_fits)  # readers import it from here
from optimizer.muon import MuonState, is_muon_param
from optimizer.optimizer_config import OptimizerConfig
from optimizer.step_paths import choose_path
from utils import comm

log = logging.getLogger(__name__)
__all__ = ["MixedPrecisionOptimizer", "Piece", "FlatBucket", "STATE_FORMAT"]


@dataclass
class Piece:
    """A contiguous element range [lo, hi) of one model parameter that this rank updates."""
    name: str
    param: torch.nn.Parameter  # the model parameter (its .data is a view into DDP's param buffer)
    bucket_index: int
    lo: int
    hi: int
    main: torch.Tensor  # fp32 master: the param itself, a view of it, or a copy
    main_is_copy: bool
    grad_store: Optional[torch.Tensor]  # view of the bucket's flat fp32 grad store (main_grad not fp32)
    decay: bool

    def model_grad(self) -> torch.Tensor:
        return self.param.main_grad.view(-1)[self.lo:self.hi]


@dataclass
class FlatBucket:
    """A bucket's owned range [lo, hi) (bucket-local) and the flat fp32 tensors over it: the masters (None
    when the parameters are fp32: they are their own masters) and the gradient store (None when the
    gradients are fp32 and read in place, or when the one-launch AdamW reads them in place whatever their
    dtype). Alignment gaps between parameters ride along, never updated."""
    lo: int
    hi: int
    master: Optional[torch.Tensor]
    grad_store: Optional[torch.Tensor]


class MixedPrecisionOptimizer(GlobalNormOptimizer):
    sharded = False
    has_experts = False

    def __init__(self, ddp, config: OptimizerConfig, norm_groups: Sequence = (), *, path: Optional[str] = None):
        """norm_groups: more process groups whose ranks hold OTHER parameters of the same model (a
        pipeline's stages): the squared gradient norm is summed, and the skip decided, over them too.
        path: the step path by name (optimizer/step_paths.py PATHS; tests and benchmarks); None: the one
        `choose_path` picks for this run."""
        self.ddp, self.config = ddp, config
        self.group, self.rank, self.world_size = ddp.process_group, ddp.rank, ddp.world_size
        if config.use_distributed_optimizer != self.sharded:
            raise ValueError("use build_optimizer(): use_distributed_optimizer picks the optimizer class")
        if ddp.config.use_distributed_optimizer and not self.sharded:
            # DDP reduce-scatters, so only a shard of each bucket is valid: an unsharded step
            # would use wrong gradients. (The reverse, trap 7, is prevented by build_optimizer.)
            raise ValueError("DDPConfig.use_distributed_optimizer=True requires "
                             "OptimizerConfig.use_distributed_optimizer=True")
        for p in ddp.param_to_bucket:
            if p.dtype == torch.float16 and config.precision != "fp16":
                raise ValueError("fp16 parameters need precision='fp16' (loss scaling)")
        self._init_scaling(config, norm_groups)
        self.pieces: list[Piece] = self._build_pieces()
        self.pieces_by_bucket: dict[int, list[Piece]] = {}
        for pc in self.pieces:
            self.pieces_by_bucket.setdefault(pc.bucket_index, []).append(pc)
        # the updates, chosen once: Muon on the hidden matrices (--optimizer=muon), AdamW on every other piece
        if config.optimizer == "muon":
            self.muon = MuonState(ddp, self.pieces, config, sharded=self.sharded, group=self.group,
                                  rank=self.rank, world_size=self.world_size)
        self._muon_pieces = {id(pc) for pc in self.pieces
                             if self.muon is not None and is_muon_param(pc.name, tuple(pc.param.shape),
                                                                        config.muon_experts)}
        self.adamw = BucketAdamW({b: [pc for pc in ps if id(pc) not in self._muon_pieces]
                                  for b, ps in self.pieces_by_bucket.items()}, config, self.device().type)
        self.updates = [u for u in (self.muon, self.adamw) if u is not None]
        # expert-parallel shards (our DDP keeps them in buffers of their own): each rank's are distinct from the
        # other expert-parallel ranks', so their squared gradient norm is summed over those ranks
        self.has_experts = any(getattr(b.buffer, "expert", False) for b in ddp.buckets)  # the same on every rank
        self.expert_parallel_group = getattr(ddp, "expert_parallel_group", None)
        self.expert_parallel_size = comm.group_rank_and_size(self.expert_parallel_group)[1] if self.has_experts else 1
        self._expert_pieces = {id(pc) for pc in self.pieces if ddp.buckets[pc.bucket_index].buffer.expert} \
            if self.has_experts else set()
        self.path = choose_path(self, path)

    # ------------------------------------------------------------------ construction
    def owned_range(self, bucket) -> tuple[int, int]:
        """Bucket-local range this rank updates: all of it when unsharded."""
        return 0, bucket.numel

    def _keep_grad_store(self, param: torch.Tensor) -> bool:
        return param.main_grad.dtype != torch.float32

    def _build_pieces(self) -> list[Piece]:
        """One piece per (owned part of a) parameter. Per bucket, the owned range [olo, ohi) gets ONE flat fp32
        master (when the parameters are not fp32), laid out like the bucket's buffers; every piece's master is
        a view into it, so the step copies masters back with one copy per bucket, not one per parameter (the
        gradient stores: `attach_grad_stores`)."""
        pieces = []
        self.flat_buckets: dict[int, FlatBucket] = {}
        # unsharded, low-precision parameters: one fp32 master per DDP buffer (id -> it), the buckets' are views
        self.buffer_masters: dict[int, torch.Tensor] = {}
        buffer_masters = self.buffer_masters
        # sharded: per DDP buffer, this rank's owned ranges one after another ("compact"): bucket index ->
        # its range's start there; low-precision parameters get ONE fp32 master per buffer in that layout
        self.compact_start: dict[int, int] = {}
        owned = []
        for bucket in self.ddp.buckets:
            olo, ohi = self.owned_range(bucket)
            slots = [s for s in bucket.slots if max(s.start, olo) < min(s.end, ohi)]
            if slots:
                owned.append((bucket, olo, ohi, slots))
        if self.sharded:
            sizes: dict[int, int] = {}
            for bucket, olo, ohi, slots in owned:
                self.compact_start[bucket.index] = sizes.get(id(bucket.buffer), 0)
                sizes[id(bucket.buffer)] = self.compact_start[bucket.index] + ohi - olo
            for bucket, _, _, slots in owned:  # filled per bucket below
                if slots[0].param.dtype != torch.float32 and id(bucket.buffer) not in buffer_masters:
                    buffer_masters[id(bucket.buffer)] = torch.empty(sizes[id(bucket.buffer)], dtype=torch.float32,
                                                                    device=slots[0].param.device)
        for bucket, olo, ohi, slots in owned:
            p0 = slots[0].param
            copy = p0.dtype != torch.float32  # one buffer: one dtype per bucket
            master = None
            if copy and not self.sharded:
                buf = bucket.buffer
                if id(buf) not in buffer_masters:
                    buffer_masters[id(buf)] = buf.param_data.detach().float().clone()
                master = buffer_masters[id(buf)][bucket.start + olo:bucket.start + ohi]
            elif copy:
                c = self.compact_start[bucket.index]
                master = buffer_masters[id(bucket.buffer)][c:c + ohi - olo]
                master.copy_(bucket.param_data[olo:ohi].detach())
            self.flat_buckets[bucket.index] = FlatBucket(olo, ohi, master, None)
            for slot in slots:
                s, e = max(slot.start, olo), min(slot.end, ohi)
                p = slot.param
                lo, hi = s - slot.start, e - slot.start
                shape = p.shape if not self.sharded else (hi - lo,)
                if copy:
                    main = master[s - olo:e - olo].view(shape)
                elif not self.sharded:
                    main = p  # fp32 path: no copy at all
                else:
                    main = p.detach().view(-1)[lo:hi]  # fp32: a view of the buffer
                pieces.append(Piece(slot.name, p, bucket.index, lo, hi, main, copy, None, p.ndim >= 2))
        return pieces

    def attach_grad_stores(self) -> None:
        """For torch's AdamW (fp32 masters take fp32 gradients): per bucket whose gradients are not fp32, ONE flat
        fp32 gradient store over its owned range, laid out like the bucket, every piece's a view into it (the
        step copies gradients in with one copy per bucket). Not with the one-launch AdamW, which reads bf16
        gradients in place; it attaches them when it hands over."""
        for idx, fb in self.flat_buckets.items():
            pieces = self.pieces_by_bucket.get(idx, [])
            if not pieces or fb.grad_store is not None or not self._keep_grad_store(pieces[0].param):
                continue
            fb.grad_store = torch.zeros(fb.hi - fb.lo, dtype=torch.float32, device=pieces[0].param.device)
            starts = {id(slot.param): slot.start for slot in self.ddp.buckets[idx].slots}
            for pc in pieces:
                at = starts[id(pc.param)] + pc.lo - fb.lo  # the piece's bucket-local start, from the range's
                pc.grad_store = fb.grad_store[at:at + pc.hi - pc.lo]

    def update_of(self, pc: Piece):
        """The update that steps this piece: Muon's or AdamW's."""
        return self.muon if id(pc) in self._muon_pieces else self.adamw

    # ------------------------------------------------------------------ per step API
    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        for pc in self.pieces:
            pc.main.grad = None

    def step(self) -> tuple[bool, float]:
        """Finish grad sync, unscale, skip on inf/nan (any rank), clip by the global norm, update, write masters
        back to the model, by the path chosen at construction (`self.path`). Returns (stepped, grad_norm): a
        StepVerdict where the update was decided on the device (read when unpacked, or a step later by the
        trainer)."""
        self.settle_steps()  # the previous step's verdict: this step's count knows about its skip
        self.finish_param_sync()
        return self.path.step()

    @property
    def flat(self):
        """The one-launch AdamW (optimizer/one_launch_step.py) while it steps this optimizer, else None."""
        return self.path if self.path.name == "one_launch" else None

    @property
    def optimizers(self) -> dict[int, torch.optim.AdamW]:
        """The torch AdamW of each bucket (BucketAdamW's)."""
        return self.adamw.optimizers

    def keep_grads_on_params(self) -> bool:
        """The engine's call when each step is ONE micro-batch: where the one-launch AdamW steps one process with
        the default reduction, it reads the gradients from the parameters' .grad where autograd left them
        (optimizer/one_launch_step.py). Returns whether it applies."""
        return self.path.keep_grads_on_params()

    def plain_reduction(self) -> bool:
        plain = getattr(self.ddp, "plain_reduction", None)
        return bool(plain()) if plain is not None else False

    # ------------------------------------------------------------------ the skeleton's hooks
    def _adamws(self) -> list[torch.optim.AdamW]:
        return list(self.adamw.optimizers.values())

    def _sync_grads(self) -> None:
        self.ddp.finish_grad_sync()
        self.load_grads(self.pieces)
        self.after_grads_loaded()

    def _grads(self) -> list[torch.Tensor]:
        return [pc.main.grad for pc in self.pieces]

    def _sumsq(self) -> torch.Tensor:
        # the local sum of squares, non-finite iff this rank's grads hold an inf/nan; its reduction is the
        # local one itself when every rank holds the same reduced gradients, one SUM all-reduce in ZeRO
        if not self.has_experts:
            return self.reduce_sumsq(self.local_sumsq(self.pieces))
        dense = self.local_sumsq([pc for pc in self.pieces if id(pc) not in self._expert_pieces])
        experts = self.local_sumsq([pc for pc in self.pieces if id(pc) in self._expert_pieces])
        return self.reduce_sumsq(dense.reshape(()) + self.reduce_expert_sumsq(experts).reshape(()))

    def _update(self, norm: float) -> None:
        self._update_on_device(None)  # the host decided: nothing to skip on the device

    def _update_on_device(self, found_inf: Optional[torch.Tensor]) -> None:
        for update in self.updates:  # (Muon never gets a flag: with it the host decides, step_paths.py)
            update.step(found_inf)
        # a skipped step left the masters as they were: writing them back (and ZeRO's all-gather,
        # a collective every rank issues anyway) changes nothing
        self.copy_main_to_model(self.pieces)
        self.after_step(list(range(len(self.ddp.buckets))))  # every bucket: collectives match

    # ------------------------------------------------------------------ helpers (also the step paths')
    def device(self) -> torch.device:
        return self.pieces[0].main.device if self.pieces else torch.device("cpu")

    def load_grads(self, pieces: list[Piece]) -> None:
        dst, src = [], []
        for idx in dict.fromkeys(pc.bucket_index for pc in pieces):  # one flat copy per bucket
            fb = self.flat_buckets[idx]
            if fb.grad_store is not None:
                dst.append(fb.grad_store)
                src.append(self.ddp.buckets[idx].grad_data[fb.lo:fb.hi])
        if dst:
            torch._foreach_copy_(dst, src)  # every bucket in one launch
        for pc in pieces:
            g = pc.grad_store if pc.grad_store is not None else pc.model_grad()
            pc.main.grad = g.view(pc.main.shape)

    def after_grads_loaded(self) -> None:
        """Hook for ZeRO-2: gradient memory can be released once the owned grads are copied."""

    def after_step(self, bucket_indices: list[int]) -> None:
        """Hook for ZeRO: all-gather updated shards."""

    def local_sumsq(self, pieces: list[Piece]) -> torch.Tensor:
        grads = [pc.main.grad for pc in pieces]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self.device())
        norms = torch.stack(torch._foreach_norm(grads, 2))
        return (norms * norms).sum()  # the per-parameter squares, summed in the same order

    def reduce_sumsq(self, sumsq: torch.Tensor) -> torch.Tensor:
        """The global squared gradient norm, left on the device (the caller reads it once).
        Unsharded: every rank holds the same fully reduced gradient, so the local sum IS the
        global one (and a non-finite value is seen by every rank): no collective needed."""
        return sumsq

    def reduce_expert_sumsq(self, sumsq: torch.Tensor) -> torch.Tensor:
        """The expert shards' squared norm over every expert: unsharded, each rank holds its experts' whole reduced
        gradients (the same on the ranks holding the same experts), so one SUM over the expert-parallel ranks."""
        sumsq = sumsq.detach().clone().reshape(1)
        comm.all_reduce_sum_blocking(sumsq, self.expert_parallel_group, self.expert_parallel_size)
        return sumsq

    def full_layout(self, pc: Piece) -> tuple[list, int, int]:
        """(shape, lo, hi) of a piece in its whole tensor: an expert-parallel shard's range is moved to its place in
        the full tensor (the state dict names those elements, so it loads at any expert-parallel size)."""
        shard = getattr(self.ddp, "shard_of", lambda p: None)(pc.param)
        if shard is None:
            return list(pc.param.shape), pc.lo, pc.hi
        return list(shard[0]), shard[1] + pc.lo, shard[1] + pc.hi

    def non_finite_anywhere(self, local_sumsq: torch.Tensor) -> bool:
        """True on every rank iff some rank's `local_sumsq` is inf/nan: a blocking MAX all-reduce
        of a 0/1 flag (a collective: every rank calls it at the same point)."""
        flag = (~torch.isfinite(local_sumsq.detach())).to(torch.float32).reshape(1)
        comm.all_reduce_max_flag(flag, self.group, self.world_size)
        for group in self.norm_groups:  # every stage skips or steps together
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def _verdict_needed_now(self) -> bool:
        # a stateful comm hook (PowerSGD) must learn the verdict before the next backward runs it
        return super()._verdict_needed_now() or \
            getattr(getattr(self.ddp, "comm_hook_state", None), "on_optimizer_step", None) is not None

    def _report_verdict(self, stepped: Union[bool, list[int]]) -> None:
        """Tell a stateful comm hook (PowerSGD) whether this step's gradients were applied, so a
        skipped step leaves its error feedback untouched; the verdict is identical on every rank."""
        report = getattr(getattr(self.ddp, "comm_hook_state", None), "on_optimizer_step", None)
        if report is not None:
            report(stepped)

    def copy_main_to_model(self, pieces: list[Piece]) -> None:
        dst, src = [], []
        for idx in dict.fromkeys(pc.bucket_index for pc in pieces):  # one flat copy per bucket
            fb = self.flat_buckets[idx]
            if fb.master is not None:
                dst.append(self.ddp.buckets[idx].param_data[fb.lo:fb.hi])
                src.append(fb.master)
        if dst:
            torch._foreach_copy_(dst, src)  # every bucket in one launch (fp32 -> the model's dtype)

    def _drop_grads(self) -> None:
        for pc in self.pieces:
            pc.main.grad = None  # main may BE the model param: never leave a .grad autograd adds to

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Bytes of optimizer-owned tensors: Adam moments, Muon momentum, fp32 masters that are real copies."""
        return sum(u.state_bytes() for u in self.updates) + sum(
            fb.master.numel() * 4 for fb in self.flat_buckets.values() if fb.master is not None)

    def state_dict(self, to_host: bool = True) -> dict:
        """Tensors + ints/floats/strings only (torch.load(weights_only=True)). For a sharded
        optimizer this is this rank's shard; every entry is flat with its [lo, hi) range.
        to_host=False: the tensors are flat views of the live state where they live (--async_checkpoint copies
        them at once into its reused, pinned host buffers: one copy, no new host memory per save); the caller
        must copy them before the next step."""
        return ddp_state_dict(self, to_host)

    def load_state_dict(self, state: Union[dict, list[dict]]) -> None:
        """Load this rank's own state dict, a complete one (unsharded, or of a 1-rank run), or a
        list of ALL ranks' state dicts of a run with any world size (re-sharding: each piece is
        assembled from whichever saved ranges cover it)."""
        load_ddp_state_dict(self, state)

    def check_state_dict(self, state: Union[dict, list[dict]]) -> None:
        """What load_state_dict(state) would refuse, raised without a collective and without changing anything."""
        check_ddp_state_dict(self, state)

    def fits_own_state(self, sd: dict) -> bool:
        """Whether this rank's own saved state dict (a run of the same world size) is all it needs to load."""
        return own_state_fits(self, sd)

    def after_load(self) -> None:
        """Hook for ZeRO: re-gather parameters after loading masters."""
