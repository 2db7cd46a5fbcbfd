"""AdamW over DDP's gradient buffers, with fp32 master params, loss scaling and global clipping.

Owns: the "pieces" the optimizer updates (one per parameter, or per parameter-shard for ZeRO),
their fp32 master copies when the model is bf16/fp16, one torch AdamW per bucket (so buckets
can be stepped independently for overlap_optim_step), the skeleton's hooks over them (loss scaling,
the global-norm clip and the skip decision are the skeleton's), the overlapped step (a MAX all-reduce
of a non-finite flag per bucket: every rank skips the same buckets), telling a stateful comm hook
(PowerSGD) whether the step was applied, and the (re-shardable) state dict.
It must never change the model's dtype (trap 10), never read `param.grad` (DDP leaves gradients
in `param.main_grad`) except where it asked DDP to keep them there (`keep_grads_on_params`: one process, one
micro-batch per step, the one-launch AdamW), and never clip with a norm that is not global across ranks (trap 8).

It talks to our DDP (parallel/) by duck typing only (its buckets, buffers and finish_grad_sync), never
by importing it. The step order is optimizer/base.py's skeleton; this class gives its hooks.
The sharded subclass (optimizer/distributed_optimizer.py) only changes which bucket range a rank
owns, adds the norm all-reduce and the parameter all-gather.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from optimizer.adamw import build_adamw
from optimizer.base import GlobalNormOptimizer, clip_coefficient
from optimizer.flat_adamw import (ParamGrads, Segments, adamw_flat, adamw_param_grads, adamw_segments,
                                  sumsq_param_grads, sumsq_segments, triton_runs_on)
from optimizer.fused_step import fused_adamw_step
from optimizer.muon import MuonState, is_muon_param
from optimizer.optimizer_config import OptimizerConfig
from utils import comm
from utils.device import HostCopy

STATE_FORMAT = 1
log = logging.getLogger(__name__)


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
class _FlatBucket:
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

    def __init__(self, ddp, config: OptimizerConfig, norm_groups: Sequence = ()):
        """norm_groups: more process groups whose ranks hold OTHER parameters of the same model (a
        pipeline's stages): the squared gradient norm is summed, and the skip decided, over them too."""
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
        # --optimizer=muon: Muon on the hidden matrices (optimizer/muon.py), AdamW on the rest
        self.muon: Optional[MuonState] = None
        if config.optimizer == "muon":
            self.muon = MuonState(ddp, self.pieces, config, sharded=self.sharded, group=self.group,
                                  rank=self.rank, world_size=self.world_size)
        adamw_pieces = {b: [pc for pc in ps if not self._is_muon(pc)] for b, ps in self.pieces_by_bucket.items()}
        self.optimizers: dict[int, torch.optim.AdamW] = {
            b: self._make_adamw(ps) for b, ps in adamw_pieces.items() if ps}
        # one AdamW launch per DDP buffer (optimizer/flat_adamw.py) where it applies; else None
        self.flat: Optional[_FlatAdamW] = _FlatAdamW.build(self) if self._flat_adamw_applies() else None
        if self.flat is not None:
            log.info("AdamW in one launch per parameter buffer (%d buffer(s), %s)%s", len(self.flat.buffers),
                     "Triton" if self.flat.use_triton else "its torch reference",
                     "; moments in bf16, rounded stochastically" if config.state_dtype == "bf16" else "")
        else:  # torch's AdamW steps fp32 masters with fp32 gradients (the kernel widens bf16 ones as it reads them)
            self._attach_grad_stores()

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
        gradient stores: `_attach_grad_stores`)."""
        pieces = []
        self._flat: dict[int, _FlatBucket] = {}
        # unsharded, low-precision parameters: one fp32 master per DDP buffer (id -> it), the buckets' are views
        self._buffer_masters: dict[int, torch.Tensor] = {}
        buffer_masters = self._buffer_masters
        # sharded: per DDP buffer, this rank's owned ranges one after another ("compact"): bucket index ->
        # its range's start there; low-precision parameters get ONE fp32 master per buffer in that layout
        self._compact_start: dict[int, int] = {}
        owned = []
        for bucket in self.ddp.buckets:
            olo, ohi = self.owned_range(bucket)
            slots = [s for s in bucket.slots if max(s.start, olo) < min(s.end, ohi)]
            if slots:
                owned.append((bucket, olo, ohi, slots))
        if self.sharded:
            sizes: dict[int, int] = {}
            for bucket, olo, ohi, slots in owned:
                self._compact_start[bucket.index] = sizes.get(id(bucket.buffer), 0)
                sizes[id(bucket.buffer)] = self._compact_start[bucket.index] + ohi - olo
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
                c = self._compact_start[bucket.index]
                master = buffer_masters[id(bucket.buffer)][c:c + ohi - olo]
                master.copy_(bucket.param_data[olo:ohi].detach())
            self._flat[bucket.index] = _FlatBucket(olo, ohi, master, None)
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

    def _attach_grad_stores(self) -> None:
        """For torch's AdamW (fp32 masters take fp32 gradients): per bucket whose gradients are not fp32, ONE flat
        fp32 gradient store over its owned range, laid out like the bucket, every piece's a view into it (the
        step copies gradients in with one copy per bucket). Not with the one-launch AdamW, which reads bf16
        gradients in place; `_leave_flat` attaches them when it hands over."""
        for idx, fb in self._flat.items():
            pieces = self.pieces_by_bucket.get(idx, [])
            if not pieces or fb.grad_store is not None or not self._keep_grad_store(pieces[0].param):
                continue
            fb.grad_store = torch.zeros(fb.hi - fb.lo, dtype=torch.float32, device=pieces[0].param.device)
            starts = {id(slot.param): slot.start for slot in self.ddp.buckets[idx].slots}
            for pc in pieces:
                at = starts[id(pc.param)] + pc.lo - fb.lo  # the piece's bucket-local start, from the range's
                pc.grad_store = fb.grad_store[at:at + pc.hi - pc.lo]

    def _is_muon(self, pc: Piece) -> bool:
        return self.config.optimizer == "muon" and is_muon_param(pc.name, tuple(pc.param.shape))

    def _make_adamw(self, pieces: list[Piece]) -> torch.optim.AdamW:
        return build_adamw([pc.main for pc in pieces if pc.decay], [pc.main for pc in pieces if not pc.decay],
                           self.config, self._device().type)

    # ------------------------------------------------------------------ per step API
    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        for pc in self.pieces:
            pc.main.grad = None

    def step(self) -> tuple[bool, float]:
        """Finish grad sync, unscale, skip on inf/nan (any rank), clip by the global norm,
        AdamW step, write masters back to the model. Returns (stepped, grad_norm): a StepVerdict where the
        update was decided on the device (read when unpacked, or a step later by the trainer)."""
        self.settle_steps()  # the previous step's verdict: this step's count knows about its skip
        self.finish_param_sync()
        if self.config.overlap_optim_step:
            return self._step_overlapped()
        if self.flat is not None:
            if self._plain_reduction():
                return self._flat_step()
            self._leave_flat("a comm hook other than the all-reduce was registered")
        return self.global_norm_step()

    # ------------------------------------------------------------------ one launch per buffer
    # "auto": on CUDA with Triton; "on": on any device (the CPU runs the kernel's torch reference, or the kernel
    # in the interpreter): tests; "off": never. Class attribute, like skip_on_device; None (default): the
    # environment's MYLLM_FLAT_ADAMW, read when an optimizer is built, else "auto" (MYLLM_FLAT_ADAMW=off: an A/B
    # on a GPU, bench/bench_model_gpu.py with and without).
    flat_adamw: Optional[str] = None

    def _flat_adamw_applies(self) -> bool:
        """Whether the one-launch AdamW steps this optimizer. bf16 moments (state_dtype=bf16) live only there: on
        any device (the CPU runs the kernel's torch reference), and a layout it cannot step is refused."""
        mode = self.flat_adamw or os.environ.get("MYLLM_FLAT_ADAMW", "auto")
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"MYLLM_FLAT_ADAMW={mode!r}: auto | on | off")
        why_not = self._flat_adamw_unfit(mode)
        if self.config.state_dtype == "bf16":
            if why_not:
                raise ValueError(f"--optimizer_state_dtype=bf16 needs the one-launch AdamW (optimizer/flat_adamw.py), "
                                 f"which cannot step this run: {why_not}")
            return True
        if why_not:
            return False
        if mode == "auto" and not all(opt.defaults.get("fused") for opt in self.optimizers.values()):
            return False  # (forced on, a CPU run's foreach AdamW objects only keep the groups and the state)
        return mode == "on" or triton_runs_on(self._device()) and self._device().type == "cuda"

    def _flat_adamw_unfit(self, mode: str) -> str:
        """Why the one-launch AdamW cannot step this optimizer ("" when it can)."""
        cfg = self.config
        for on, why in ((mode == "off", "MYLLM_FLAT_ADAMW=off"), (getattr(self, "zero_stage", 1) == 2, "ZeRO-2"),
                        (self.muon is not None, "--optimizer=muon"), (cfg.overlap_optim_step, "overlap_optim_step"),
                        (bool(self.norm_groups), "pipeline stages (the norm is summed over them)"),
                        (cfg.precision == "fp16", "fp16 loss scaling"),
                        (not self.optimizers or not self.pieces, "no parameter to step"),
                        (any(opt.defaults.get("amsgrad") for opt in self.optimizers.values()), "amsgrad"),
                        (any(b.buffer.split for b in self.ddp.buckets), "a parameter split across buckets"),
                        # PowerSGD writes the alignment gaps: the flat norm would count them
                        (not self._plain_reduction(), "a gradient communication other than all-reduce / "
                                                      "reduce-scatter (--comm_hook)")):
            if on:
                return why
        return ""

    def _plain_reduction(self) -> bool:
        plain = getattr(self.ddp, "plain_reduction", None)
        return bool(plain()) if plain is not None else False

    # "auto" (default): keep_grads_on_params applies where it can; "off": never (MYLLM_GRADS_ON_PARAMS=off: an A/B
    # on a GPU, the bench's ours-gradbuf row). Class attribute like flat_adamw; None: the environment's, else auto.
    grads_on_params: Optional[str] = None

    def keep_grads_on_params(self) -> bool:
        """The engine's call when each step is ONE micro-batch: in one process with the default reduction, the
        one-launch AdamW unsharded, the step reads the gradients from the parameters' .grad where autograd left
        them (flat_adamw.ParamGrads). DDP then runs no hook per parameter and frees its gradient buffers (fp32:
        4 bytes a parameter), and no gradient is copied: 6 bytes a parameter less to write and read back, and 2
        less for the kernel to read. The update is the buffer path's (the same fp32 values: each bf16 gradient
        widened exactly); only the norm's summation order differs. Returns whether it applies."""
        mode = self.grads_on_params or os.environ.get("MYLLM_GRADS_ON_PARAMS", "auto")
        if mode not in ("auto", "off"):
            raise ValueError(f"MYLLM_GRADS_ON_PARAMS={mode!r}: auto | off")
        if mode == "off" or self.flat is None or self.sharded or self.world_size != 1 or self.norm_groups \
                or not self._plain_reduction() or not hasattr(self.ddp, "keep_grads_on_params"):
            return False
        self.ddp.keep_grads_on_params()
        for b in self.flat.buffers:
            buf = b.source
            b.param_grads = ParamGrads([(s.param, bk.start + s.start) for bk in buf.buckets for s in bk.slots],
                                       buf.numel, self._device(), b.decay)
        log.info("one process, one micro-batch a step: gradients read from the parameters (no gradient buffer)")
        return True

    def _flat_step(self) -> tuple[bool, float]:
        """The step in one launch per DDP buffer: the squared norm of the flat gradients (its gaps are zeros),
        queued to the host, then the kernel (clip and skip read from that norm on the device), then the one
        host read, which waits for the norm only."""
        fl = self.flat
        self.ddp.finish_grad_sync()
        # one process: the gradients are the parameters' .grad (keep_grads_on_params; a comm hook registered since
        # put DDP back on its buffers)
        on_params = getattr(self.ddp, "grads_on_params", False)
        if self.sharded:  # ZeRO-1: the owned shards' sum of squares, summed over the ranks (one all-reduce)
            parts = [sumsq_segments(b.grad, b.segments, fl.use_triton) for b in fl.buffers]
            sumsq = self._reduce_sumsq(parts[0] if len(parts) == 1 else torch.stack(parts).sum()).reshape(())
        elif on_params and fl.use_triton:
            grads = [b.param_grads.grads() for b in fl.buffers]  # (kept alive until the kernels are queued)
            addrs = [b.param_grads.addresses(g) for b, g in zip(fl.buffers, grads)]
            try:
                parts = [sumsq_param_grads(b.param_grads, a) for b, a in zip(fl.buffers, addrs)]
            except Exception as e:  # noqa: BLE001 - as for the update's kernel below (nothing was written yet)
                return self._hand_over("its norm kernel", e, fl.launched)
            sumsq = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
        else:  # (the torch reference of the path above reads them laid out like the buffer)
            flats = [b.param_grads.gathered(b.param_grads.grads()) if on_params else b.grad for b in fl.buffers]
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in flats]
            n = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
            sumsq = n * n
        s_host = HostCopy(sumsq)
        hyper = dict(lr=self.lr, beta1=fl.betas[0], beta2=fl.betas[1], eps=fl.eps, weight_decay=fl.weight_decay,
                     max_norm=float(self.config.grad_clip), step=fl.steps + 1)
        for i, b in enumerate(fl.buffers):
            try:
                if b.segments is not None:
                    adamw_segments(b.master, b.grad, b.exp_avg, b.exp_avg_sq, b.decay, b.param_out, sumsq,
                                   b.segments, master_compact=b.master_compact, use_triton=fl.use_triton,
                                   salt=b.salt, **hyper)
                    continue
                if on_params and fl.use_triton:
                    adamw_param_grads(b.master, b.param_grads, addrs[i], b.exp_avg, b.exp_avg_sq, b.param_out,
                                      sumsq, salt=b.salt, **hyper)
                    continue
                adamw_flat(b.master, flats[i] if on_params else b.grad, b.exp_avg, b.exp_avg_sq,
                           b.decay, b.param_out, sumsq, use_triton=fl.use_triton, salt=b.salt, **hyper)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot be built here: torch's fused AdamW instead
                return self._hand_over("its kernel", e, fl.launched or i > 0)
        fl.launched = True
        if self.sharded:  # every shard all-gathered (a skipped step's too: every rank issues the same collectives)
            self._after_step(list(range(len(self.ddp.buckets))))
        return self._device_verdict(s_host, then=fl.count)  # read by the next step's start at the latest

    def _hand_over(self, what: str, e: Exception, updated: bool) -> tuple[bool, float]:
        """A kernel of the one-launch step failed: before anything was updated, this step and every later one are
        torch's fused AdamW's (logged once); after, or with bf16 moments (torch's AdamW keeps fp32 ones), the
        error stands (never a half-applied step)."""
        if updated or self.config.state_dtype == "bf16":
            raise e
        self._leave_flat(f"{what} failed ({' '.join(str(e).split())[:300]})")
        return self.global_norm_step()

    def _leave_flat(self, why: str) -> None:
        """Back to the per-parameter fused AdamW for good: the moments stay where they are (its state holds
        views of them), the step counters take the count. Refused with bf16 moments (torch's AdamW keeps fp32)."""
        if self.config.state_dtype == "bf16":
            raise RuntimeError(f"the one-launch AdamW cannot go on ({why}), and its bf16 moments "
                               "(--optimizer_state_dtype=bf16) have no other AdamW to step them")
        self.settle_steps()  # (step() has: the count below must know every skip)
        log.warning("one-launch AdamW off: %s; torch's fused AdamW steps the parameters from here on", why)
        if getattr(self.ddp, "grads_on_params", False):
            self.ddp.restore_grad_buffers()  # this step's gradients into DDP's buffers, its hooks back
        self._attach_grad_stores()  # torch's AdamW reads fp32 copies of low-precision gradients
        for opt in self.optimizers.values():
            for st in opt.state.values():
                st["step"].fill_(float(self.flat.steps))
        self.flat = None

    # ------------------------------------------------------------------ the skeleton's hooks
    def _adamws(self) -> list[torch.optim.AdamW]:
        return list(self.optimizers.values())

    def _sync_grads(self) -> None:
        self.ddp.finish_grad_sync()
        self._load_grads(self.pieces)
        self._after_grads_loaded()

    def _grads(self) -> list[torch.Tensor]:
        return [pc.main.grad for pc in self.pieces]

    def _sumsq(self) -> torch.Tensor:
        # the local sum of squares, non-finite iff this rank's grads hold an inf/nan; its reduction is the
        # local one itself when every rank holds the same reduced gradients, one SUM all-reduce in ZeRO
        return self._reduce_sumsq(self._local_sumsq(self.pieces))

    def _step_adamws(self, found_inf: Optional[torch.Tensor] = None) -> None:
        """Every bucket's AdamW: as one batch of fused launches (optimizer/fused_step.py) when they are
        fused and hold state, else one by one (the first step, foreach / single-tensor AdamW)."""
        opts = list(self.optimizers.values())
        if self.batch_adamw_steps and fused_adamw_step(opts, found_inf):
            return
        for opt in opts:
            opt.found_inf = found_inf  # read by torch's Adam.step and passed to the fused kernel
            try:
                opt.step()
            finally:
                opt.found_inf = None

    def _update(self, norm: float) -> None:
        self._update_on_device(None)  # the host decided: nothing to skip on the device

    # Decided on the device (fused AdamW only: foreach / single-tensor AdamW take no found_inf flag).
    # Class attribute: tests compare both ways.
    skip_on_device = True
    batch_adamw_steps = True  # one fused AdamW launch per group for all buckets (tests compare both ways)

    def _skips_on_device(self) -> bool:
        # Muon has no found_inf input: with it the host decides (one host read, before the update)
        return self.skip_on_device and self.muon is None and bool(self.optimizers) and all(
            opt.defaults.get("fused") for opt in self.optimizers.values())

    def _update_on_device(self, found_inf: Optional[torch.Tensor]) -> None:
        if self.muon is not None:  # (never with found_inf: with Muon the host decides, `_skips_on_device`)
            self.muon.step()
        self._step_adamws(found_inf)
        # a skipped step left the masters as they were: writing them back (and ZeRO's all-gather,
        # a collective every rank issues anyway) changes nothing
        self._copy_main_to_model(self.pieces)
        self._after_step(list(range(len(self.ddp.buckets))))  # every bucket: collectives match

    def _step_overlapped(self) -> tuple[bool, float]:
        """Step each bucket right after its communication finished. Clipping uses the PREVIOUS
        step's global norm (the current one needs every bucket); the first step is unclipped.
        A bucket whose gradients hold an inf/nan on ANY rank is skipped on every rank (a MAX
        all-reduce of the flag per bucket); the other buckets are stepped."""
        coef = clip_coefficient(self.config.grad_clip, self.prev_grad_norm)
        sumsq = torch.zeros((), dtype=torch.float32, device=self._device())
        skipped: list[int] = []

        def on_bucket(bucket) -> None:
            pieces = self.pieces_by_bucket.get(bucket.index, [])
            sq = torch.zeros((), dtype=torch.float32, device=self._device())
            if pieces:
                self._load_grads(pieces)
                sq = self._local_sumsq(pieces)
                sumsq.add_(sq)
            # every rank calls this for every bucket, in launch order (a collective)
            if self._non_finite_anywhere(sq):
                skipped.append(bucket.index)
            elif pieces:
                if coef < 1.0:
                    torch._foreach_mul_([pc.main.grad for pc in pieces], coef)
                self.optimizers[bucket.index].step()
                self._copy_main_to_model(pieces)
            self._after_step([bucket.index])  # always: the all-gather is a collective

        self.ddp.finish_grad_sync(on_bucket_done=on_bucket)
        self._after_grads_loaded()
        self._report_verdict(True if not skipped else
                             [b.index for b in self.ddp.buckets if b.index not in skipped])
        norm = math.sqrt(float(self._sum_over_norm_groups(self._reduce_sumsq(sumsq)).item()))
        self.prev_grad_norm = norm
        self._drop_grads()
        return not skipped, norm

    # ------------------------------------------------------------------ helpers
    def _device(self) -> torch.device:
        return self.pieces[0].main.device if self.pieces else torch.device("cpu")

    def _load_grads(self, pieces: list[Piece]) -> None:
        dst, src = [], []
        for idx in dict.fromkeys(pc.bucket_index for pc in pieces):  # one flat copy per bucket
            fb = self._flat[idx]
            if fb.grad_store is not None:
                dst.append(fb.grad_store)
                src.append(self.ddp.buckets[idx].grad_data[fb.lo:fb.hi])
        if dst:
            torch._foreach_copy_(dst, src)  # every bucket in one launch
        for pc in pieces:
            g = pc.grad_store if pc.grad_store is not None else pc.model_grad()
            pc.main.grad = g.view(pc.main.shape)

    def _after_grads_loaded(self) -> None:
        """Hook for ZeRO-2: gradient memory can be released once the owned grads are copied."""

    def _after_step(self, bucket_indices: list[int]) -> None:
        """Hook for ZeRO: all-gather updated shards."""

    def _local_sumsq(self, pieces: list[Piece]) -> torch.Tensor:
        grads = [pc.main.grad for pc in pieces]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self._device())
        norms = torch.stack(torch._foreach_norm(grads, 2))
        return (norms * norms).sum()  # the per-parameter squares, summed in the same order

    def _reduce_sumsq(self, sumsq: torch.Tensor) -> torch.Tensor:
        """The global squared gradient norm, left on the device (the caller reads it once).
        Unsharded: every rank holds the same fully reduced gradient, so the local sum IS the
        global one (and a non-finite value is seen by every rank): no collective needed."""
        return sumsq

    def _non_finite_anywhere(self, local_sumsq: torch.Tensor) -> bool:
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

    def _copy_main_to_model(self, pieces: list[Piece]) -> None:
        dst, src = [], []
        for idx in dict.fromkeys(pc.bucket_index for pc in pieces):  # one flat copy per bucket
            fb = self._flat[idx]
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
        muon = self.muon.state_bytes() if self.muon is not None else 0
        return self._moment_bytes() + muon + sum(fb.master.numel() * 4 for fb in self._flat.values()
                                                 if fb.master is not None)

    def state_dict(self, to_host: bool = True) -> dict:
        """Tensors + ints/floats/strings only (torch.load(weights_only=True)). For a sharded
        optimizer this is this rank's shard; every entry is flat with its [lo, hi) range.
        to_host=False: the tensors are flat views of the live state where they live (--async_checkpoint copies
        them at once into its reused, pinned host buffers: one copy, no new host memory per save); the caller
        must copy them before the next step."""
        self.settle_steps()  # the step counts (a skip not read yet would be counted as a step)
        self.finish_param_sync()
        own = (lambda t: t.cpu().clone()) if to_host else (lambda t: t)  # noqa: E731
        params = {}
        for pc in self.pieces:
            if self._is_muon(pc):
                params[pc.name] = {
                    "shape": list(pc.param.shape), "numel": pc.param.numel(), "lo": pc.lo, "hi": pc.hi,
                    "main": own(pc.main.detach().reshape(-1).float()),
                    "momentum": own(self.muon.momentum_of(pc)), "step": float(self.muon.steps)}
                continue
            opt = self.optimizers[pc.bucket_index]
            st = opt.state.get(pc.main, {})
            n = pc.hi - pc.lo
            zeros = torch.zeros(n, dtype=torch.float32)
            params[pc.name] = {
                "shape": list(pc.param.shape), "numel": pc.param.numel(), "lo": pc.lo, "hi": pc.hi,
                "main": own(pc.main.detach().reshape(-1).float()),
                "exp_avg": own(st["exp_avg"].reshape(-1)) if st else zeros,
                "exp_avg_sq": own(st["exp_avg_sq"].reshape(-1)) if st else zeros.clone(),
                "step": float(self.flat.steps) if self.flat is not None else float(st["step"]) if st else 0.0,
            }
        return {"format": STATE_FORMAT, "optimizer": self.config.optimizer, "sharded": int(self.sharded),
                "world_size": self.world_size, "rank": self.rank, **self._scaling_state(), "params": params}

    def load_state_dict(self, state: Union[dict, list[dict]]) -> None:
        """Load this rank's own state dict, a complete one (unsharded, or of a 1-rank run), or a
        list of ALL ranks' state dicts of a run with any world size (re-sharding: each piece is
        assembled from whichever saved ranges cover it)."""
        self.settle_steps()  # a verdict read after the load would count its step into the loaded count
        sds = [state] if isinstance(state, dict) or state is None else list(state)
        if not sds:
            raise ValueError("empty optimizer state")
        for sd in sds:
            if sd is None:
                raise ValueError("an optimizer state dict is missing (None): was a rank's optimizer file "
                                 "not found? A ZeRO run saves one per rank")
            if sd.get("format") != STATE_FORMAT:
                raise ValueError(f"unknown optimizer state format {sd.get('format')!r}")
            saved_kind = sd.get("optimizer", "adamw")  # states older than --optimizer were AdamW's
            if saved_kind != self.config.optimizer:
                raise ValueError(f"the checkpoint's optimizer state is {saved_kind}'s but this run has "
                                 f"--optimizer={self.config.optimizer}: switching optimizers on resume is refused")
        if len(sds) > 1:
            shard_runs = {int(sd["world_size"]) for sd in sds if sd["sharded"]}
            if len(shard_runs) > 1:
                raise ValueError(f"the optimizer state dicts come from ZeRO runs of {sorted(shard_runs)} ranks; "
                                 "pass the dicts of one run")
            for n in shard_runs:
                ranks = {int(sd["rank"]) for sd in sds if sd["sharded"]}
                missing = sorted(set(range(n)) - ranks)
                if missing:
                    raise ValueError(f"rank {missing[0]} of {n} is missing from the optimizer state dicts "
                                     f"(got ranks {sorted(ranks)}); pass every rank's state dict to re-shard")
        # One shard of a multi-rank ZeRO run can't fill another world's shards; a 1-rank run's
        # state (sharded or not) is complete and loads at any world size (1 -> N).
        if len(sds) == 1 and sds[0]["sharded"] and int(sds[0]["world_size"]) not in (1, self.world_size):
            raise ValueError(
                f"this sharded optimizer state is one rank of a world of {sds[0]['world_size']} ranks, "
                f"but the current world has {self.world_size}; pass the list of all "
                f"{sds[0]['world_size']} ranks' state dicts to re-shard")
        saved: dict[str, list[dict]] = {}
        for sd in sds:
            for name, e in sd["params"].items():
                saved.setdefault(name, []).append(e)
        kept = torch.bfloat16 if self.config.state_dtype == "bf16" else torch.float32
        stored = {e["exp_avg"].dtype for es in saved.values() for e in es if torch.is_tensor(e.get("exp_avg"))}
        if stored - {kept}:
            log.info("optimizer state: AdamW moments saved as %s, kept as %s (--optimizer_state_dtype)%s",
                     "/".join(sorted(str(d) for d in stored)), kept,
                     ": rounded to nearest on load" if kept == torch.bfloat16 else ": widened exactly")
        loaded_steps = 0
        for pc in self.pieces:
            entries = saved.get(pc.name)
            if not entries:
                raise KeyError(f"optimizer state has no entry for parameter {pc.name!r}")
            if list(entries[0]["shape"]) != list(pc.param.shape):
                raise ValueError(f"{pc.name}: saved shape {entries[0]['shape']} != {list(pc.param.shape)}")
            for e in entries:  # saved as fp32 (the moments: as kept, fp32 or bf16): another dtype is refused
                for key in ("main", "exp_avg", "exp_avg_sq", "momentum"):
                    t = e.get(key)
                    ok = (torch.float32, torch.bfloat16) if key in ("exp_avg", "exp_avg_sq") else (torch.float32,)
                    if torch.is_tensor(t) and t.dtype not in ok:
                        raise ValueError(f"{pc.name}: its {key} is saved as {t.dtype}, but this optimizer keeps "
                                         f"{' or '.join(map(str, ok))} (and saves it so): refused rather than cast")
            muon = self._is_muon(pc)
            keys = ("main", "momentum") if muon else ("main", "exp_avg", "exp_avg_sq")
            parts = {k: self._assemble(pc, entries, k) for k in keys}
            step = max(float(e["step"]) for e in entries)
            with torch.no_grad():
                pc.main.view(-1).copy_(parts["main"])
            if muon:
                self.muon.momentum_of(pc).copy_(parts["momentum"])
                self.muon.steps = int(step)
                continue
            opt = self.optimizers[pc.bucket_index]
            if self.flat is not None:  # the state is views of the flat moments: filled in place
                st = opt.state[pc.main]
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key].copy_(parts[key].view(pc.main.shape) if step > 0 else torch.zeros_like(st[key]))
                loaded_steps = max(loaded_steps, int(step))
                continue
            opt.state.pop(pc.main, None)
            if step > 0:
                fused = bool(opt.defaults.get("fused"))
                opt.state[pc.main] = {
                    "step": torch.tensor(step, dtype=torch.float32,
                                         device=pc.main.device if fused else "cpu"),
                    "exp_avg": parts["exp_avg"].view(pc.main.shape).clone(),
                    "exp_avg_sq": parts["exp_avg_sq"].view(pc.main.shape).clone()}
        if self.flat is not None:
            self.flat.steps = loaded_steps
        self._copy_main_to_model(self.pieces)
        self._after_load()
        self._load_scaling_state(sds[0])

    def _assemble(self, pc: Piece, entries: list[dict], key: str) -> torch.Tensor:
        out = torch.empty(pc.hi - pc.lo, dtype=torch.float32, device=pc.main.device)
        covered = 0
        for e in entries:
            s, t = max(pc.lo, e["lo"]), min(pc.hi, e["hi"])
            if s < t:
                out[s - pc.lo:t - pc.lo].copy_(e[key][s - e["lo"]:t - e["lo"]])
                covered += t - s
        if covered != pc.hi - pc.lo:
            raise ValueError(f"{pc.name}: saved state covers {covered} of the {pc.hi - pc.lo} elements "
                             f"[{pc.lo}, {pc.hi}) this rank needs; pass every rank's state dict")
        return out

    def _after_load(self) -> None:
        """Hook for ZeRO: re-gather parameters after loading masters."""


@dataclass
class _FlatBuffer:
    """One DDP buffer's flat tensors for optimizer/flat_adamw.py, laid out like the buffer (unsharded) or as
    this rank's shards one after another (ZeRO-1, `segments`)."""
    master: torch.Tensor  # fp32: the optimizer's masters (or the fp32 parameters themselves)
    grad: torch.Tensor  # the buffer's gradients (fp32; bf16 with grad_reduce_in_fp32=False: widened as they are read)
    exp_avg: torch.Tensor  # fp32, or bf16 (--optimizer_state_dtype=bf16)
    exp_avg_sq: torch.Tensor
    decay: torch.Tensor  # uint8: 1 where the element's parameter decays
    param_out: Optional[torch.Tensor]  # the low-precision parameters, written from the masters (None: fp32)
    # ZeRO-1: this rank's shards of the buffer (then exp_avg, exp_avg_sq, decay are compact: the shards one after
    # another; grad and param_out are the whole buffer; master is compact, or the fp32 parameters' buffer)
    segments: Optional[Segments] = None
    master_compact: bool = False
    source: Any = None  # the DDP ParamAndGradBuffer
    # one process, one micro-batch per step: the gradients read from the parameters' .grad (keep_grads_on_params)
    param_grads: Optional[ParamGrads] = None
    salt: int = 0  # the buffer's number among DDP's buffers: seeds bf16 moments' stochastic rounding


class _FlatAdamW:
    """The optimizer's AdamW as one launch per DDP buffer (ZeRO-1: over the rank's shards of it). torch's AdamW
    objects stay (their param groups carry lr, betas, eps and weight decay; their state holds views of the flat
    moments, so state_dict / load and the bytes count are unchanged); the step count is one number here."""

    def __init__(self, buffers: list[_FlatBuffer], betas: tuple, eps: float, weight_decay: float,
                 use_triton: bool) -> None:
        self.buffers, self.betas, self.eps, self.weight_decay = buffers, betas, eps, weight_decay
        self.use_triton = use_triton
        self._steps = 0
        self.launched = False
        self.settle: Callable[[], None] = lambda: None  # the optimizer's settle_steps (set by build)

    @property
    def steps(self) -> int:
        """AdamW steps taken (the bias corrections' count): every verdict not read yet is read first, so a
        skipped step is never counted."""
        self.settle()
        return self._steps

    @steps.setter
    def steps(self, n: int) -> None:
        self._steps = int(n)

    def count(self, stepped: bool) -> None:
        """A step's verdict, read (StepVerdict's settle): a step taken counts."""
        self._steps += int(stepped)

    @classmethod
    def build(cls, opt: "MixedPrecisionOptimizer") -> "_FlatAdamW":
        device = opt._device()
        ddp_buffers = list(dict.fromkeys(b.buffer for b in opt.ddp.buckets))
        flat: dict[int, _FlatBuffer] = {}
        # ZeRO-1: per buffer, (compact start, buffer start, length) of each owned bucket range, in bucket order
        spans: dict[int, list[tuple[int, int, int]]] = {}
        if opt.sharded:
            for b in opt.ddp.buckets:
                if b.index in opt._compact_start:
                    fb = opt._flat[b.index]
                    spans.setdefault(id(b.buffer), []).append((opt._compact_start[b.index], b.start + fb.lo,
                                                               fb.hi - fb.lo))
        state_dtype = torch.bfloat16 if opt.config.state_dtype == "bf16" else torch.float32
        moments = lambda n: torch.zeros(n, dtype=state_dtype, device=device)  # noqa: E731
        for salt, buf in enumerate(ddp_buffers):  # (salt: the buffer's number, the same on every rank)
            low = buf.param_dtype != torch.float32
            if opt.sharded:
                if id(buf) not in spans:
                    continue  # no shard of this buffer is this rank's
                segs = Segments(spans[id(buf)], device)
                master = opt._buffer_masters[id(buf)] if low else buf.param_data
                flat[id(buf)] = _FlatBuffer(master, buf.grad_data, moments(segs.numel), moments(segs.numel),
                                            torch.zeros(segs.numel, dtype=torch.uint8, device=device),
                                            buf.param_data if low else None, segs, master_compact=low, source=buf,
                                            salt=salt)
                continue
            base = opt._buffer_masters[id(buf)] if low else buf.param_data  # fp32: the parameters are the masters
            flat[id(buf)] = _FlatBuffer(base, buf.grad_data, moments(base.numel()), moments(base.numel()),
                                        torch.zeros(base.numel(), dtype=torch.uint8, device=device),
                                        buf.param_data if low else None, source=buf, salt=salt)
        for pc in opt.pieces:
            bucket = opt.ddp.buckets[pc.bucket_index]
            fb = flat[id(bucket.buffer)]
            if fb.segments is not None:  # the piece's place among the compact shards
                at = pc.model_grad().storage_offset() - bucket.buffer.grad_data.storage_offset()
                lo = opt._compact_start[pc.bucket_index] + at - (bucket.start + opt._flat[pc.bucket_index].lo)
            else:
                lo = pc.main.storage_offset() - fb.master.storage_offset()
            hi = lo + pc.main.numel()
            if pc.decay:
                fb.decay[lo:hi] = 1
            opt.optimizers[pc.bucket_index].state[pc.main] = {
                "step": torch.zeros((), dtype=torch.float32, device=device),
                "exp_avg": fb.exp_avg[lo:hi].view(pc.main.shape),
                "exp_avg_sq": fb.exp_avg_sq[lo:hi].view(pc.main.shape)}
        group = next(iter(opt.optimizers.values())).defaults
        made = cls(list(flat.values()), tuple(group["betas"]), float(group["eps"]), float(opt.config.weight_decay),
                   use_triton=triton_runs_on(device))
        made.settle = opt.settle_steps
        return made
