"""The one-launch AdamW as a step path of our DDP's optimizers (optimizer/step_paths.py): where it applies, and the
step over every DDP buffer in one kernel launch each (the kernels: optimizer/flat_adamw.py).

Owns: `one_launch_unfit` (every reason it cannot step an optimizer: ZeRO-2, Muon, the overlapped step, pipeline
stages, fp16, amsgrad, a parameter split across buckets, a comm hook other than the all-reduce / reduce-scatter,
OptimizerConfig.one_launch="off"), `one_launch_applies` (where a run takes it: CUDA with Triton, "on" anywhere it
can step, and always with bf16 moments, which live only here), the flat tensors per DDP buffer (`FlatBuffer`),
the step count, the gradients read from the parameters in one process (`keep_grads_on_params`), and the hand-over
to torch's AdamW for good when a kernel cannot be built or a comm hook is registered later.
Must never: count a skipped step, hand over after any buffer was updated (never a half-applied step), or hand over
bf16 moments (torch's AdamW keeps fp32 ones).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from optimizer.flat_adamw import (ParamGrads, Segments, adamw_flat, adamw_param_grads, adamw_segments,
                                  sumsq_param_grads, sumsq_segments, triton_runs_on)
from utils.device import HostCopy

log = logging.getLogger(__name__)


def one_launch_unfit(opt, mode: str) -> str:
    """Why the one-launch AdamW cannot step `opt` ("" when it can); `mode`: OptimizerConfig.one_launch."""
    cfg = opt.config
    for on, why in ((mode == "off", "one_launch=off (MYLLM_FLAT_ADAMW=off)"),
                    (getattr(opt, "zero_stage", 1) == 2, "ZeRO-2"),
                    (opt.muon is not None, "--optimizer=muon"), (cfg.overlap_optim_step, "overlap_optim_step"),
                    (bool(opt.norm_groups), "pipeline stages (the norm is summed over them)"),
                    (getattr(opt, "has_experts", False), "expert-parallel shards (their norm is summed over the "
                                                         "expert-parallel ranks)"),
                    (cfg.precision == "fp16", "fp16 loss scaling"),
                    (not opt.adamw.optimizers or not opt.pieces, "no parameter to step"),
                    (any(o.defaults.get("amsgrad") for o in opt.adamw.optimizers.values()), "amsgrad"),
                    (any(b.buffer.split for b in opt.ddp.buckets), "a parameter split across buckets"),
                    # PowerSGD writes the alignment gaps: the flat norm would count them
                    (not opt.plain_reduction(), "a gradient communication other than all-reduce / "
                                                "reduce-scatter (--comm_hook)")):
        if on:
            return why
    return ""


def one_launch_applies(opt) -> bool:
    """Whether the one-launch AdamW steps `opt` (OptimizerConfig.one_launch: "auto", on CUDA with Triton; "on", on
    any device, the CPU running the kernel's torch reference: tests and kill trials; "off": never). bf16 moments
    (state_dtype=bf16) live only there: on any device, and a layout it cannot step is refused."""
    mode = opt.config.one_launch
    why_not = one_launch_unfit(opt, mode)
    if opt.config.state_dtype == "bf16":
        if why_not:
            raise ValueError(f"--optimizer_state_dtype=bf16 needs the one-launch AdamW (optimizer/one_launch_step.py), "
                             f"which cannot step this run: {why_not}")
        return True
    if why_not:
        return False
    if mode == "auto" and not opt.adamw.skips_on_device:
        return False  # (forced on, a CPU run's foreach AdamW objects only keep the groups and the state)
    return mode == "on" or triton_runs_on(opt.device()) and opt.device().type == "cuda"


@dataclass
class FlatBuffer:
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


class OneLaunchStep:
    """The optimizer's AdamW as one launch per DDP buffer (ZeRO-1: over the rank's shards of it). torch's AdamW
    objects stay (their param groups carry lr, betas, eps and weight decay; their state holds views of the flat
    moments, so state_dict / load and the bytes count are unchanged); the step count is one number here."""
    name = "one_launch"

    def __init__(self, opt, buffers: list[FlatBuffer], betas: tuple, eps: float, weight_decay: float,
                 use_triton: bool, fallback: Callable) -> None:
        self.opt, self.fallback = opt, fallback
        self.buffers, self.betas, self.eps, self.weight_decay = buffers, betas, eps, weight_decay
        self.use_triton = use_triton
        self._steps = 0
        self.launched = False

    @property
    def steps(self) -> int:
        """AdamW steps taken (the bias corrections' count): every verdict not read yet is read first, so a
        skipped step is never counted."""
        self.opt.settle_steps()
        return self._steps

    @steps.setter
    def steps(self, n: int) -> None:
        self._steps = int(n)

    def count(self, stepped: bool) -> None:
        """A step's verdict, read (StepVerdict's settle): a step taken counts."""
        self._steps += int(stepped)

    @classmethod
    def build(cls, opt, fallback: Callable) -> "OneLaunchStep":
        """The flat moments and decay flags of every DDP buffer `opt` holds a part of (torch's AdamW state made
        views of them); `fallback(opt)`: the path it hands over to."""
        device = opt.device()
        ddp_buffers = list(dict.fromkeys(b.buffer for b in opt.ddp.buckets))
        flat: dict[int, FlatBuffer] = {}
        # ZeRO-1: per buffer, (compact start, buffer start, length) of each owned bucket range, in bucket order
        spans: dict[int, list[tuple[int, int, int]]] = {}
        if opt.sharded:
            for b in opt.ddp.buckets:
                if b.index in opt.compact_start:
                    fb = opt.flat_buckets[b.index]
                    spans.setdefault(id(b.buffer), []).append((opt.compact_start[b.index], b.start + fb.lo,
                                                               fb.hi - fb.lo))
        state_dtype = torch.bfloat16 if opt.config.state_dtype == "bf16" else torch.float32
        moments = lambda n: torch.zeros(n, dtype=state_dtype, device=device)  # noqa: E731
        for salt, buf in enumerate(ddp_buffers):  # (salt: the buffer's number, the same on every rank)
            low = buf.param_dtype != torch.float32
            if opt.sharded:
                if id(buf) not in spans:
                    continue  # no shard of this buffer is this rank's
                segs = Segments(spans[id(buf)], device)
                master = opt.buffer_masters[id(buf)] if low else buf.param_data
                flat[id(buf)] = FlatBuffer(master, buf.grad_data, moments(segs.numel), moments(segs.numel),
                                           torch.zeros(segs.numel, dtype=torch.uint8, device=device),
                                           buf.param_data if low else None, segs, master_compact=low, source=buf,
                                           salt=salt)
                continue
            base = opt.buffer_masters[id(buf)] if low else buf.param_data  # fp32: the parameters are the masters
            flat[id(buf)] = FlatBuffer(base, buf.grad_data, moments(base.numel()), moments(base.numel()),
                                       torch.zeros(base.numel(), dtype=torch.uint8, device=device),
                                       buf.param_data if low else None, source=buf, salt=salt)
        adamws = opt.adamw.optimizers
        for pc in opt.pieces:
            bucket = opt.ddp.buckets[pc.bucket_index]
            fb = flat[id(bucket.buffer)]
            if fb.segments is not None:  # the piece's place among the compact shards
                at = pc.model_grad().storage_offset() - bucket.buffer.grad_data.storage_offset()
                lo = opt.compact_start[pc.bucket_index] + at - (bucket.start + opt.flat_buckets[pc.bucket_index].lo)
            else:
                lo = pc.main.storage_offset() - fb.master.storage_offset()
            hi = lo + pc.main.numel()
            if pc.decay:
                fb.decay[lo:hi] = 1
            adamws[pc.bucket_index].state[pc.main] = {
                "step": torch.zeros((), dtype=torch.float32, device=device),
                "exp_avg": fb.exp_avg[lo:hi].view(pc.main.shape),
                "exp_avg_sq": fb.exp_avg_sq[lo:hi].view(pc.main.shape)}
        group = next(iter(adamws.values())).defaults
        made = cls(opt, list(flat.values()), tuple(group["betas"]), float(group["eps"]),
                   float(opt.config.weight_decay), use_triton=triton_runs_on(device), fallback=fallback)
        opt.adamw.step_count = made  # the state dict's AdamW step count is this one
        log.info("AdamW in one launch per parameter buffer (%d buffer(s), %s)%s", len(made.buffers),
                 "Triton" if made.use_triton else "its torch reference",
                 "; moments in bf16, rounded stochastically" if opt.config.state_dtype == "bf16" else "")
        return made

    def keep_grads_on_params(self) -> bool:
        """The engine's call when each step is ONE micro-batch: in one process with the default reduction, unsharded,
        the step reads the gradients from the parameters' .grad where autograd left them (flat_adamw.ParamGrads).
        DDP then runs no hook per parameter and frees its gradient buffers (fp32: 4 bytes a parameter), and no
        gradient is copied: 6 bytes a parameter less to write and read back, and 2 less for the kernel to read. The
        update is the buffer path's (the same fp32 values: each bf16 gradient widened exactly); only the norm's
        summation order differs. OptimizerConfig.grads_on_params=False: never (the bench's ours-gradbuf row).
        Returns whether it applies."""
        opt = self.opt
        if not opt.config.grads_on_params or opt.sharded or opt.world_size != 1 or opt.norm_groups \
                or not opt.plain_reduction() or not hasattr(opt.ddp, "keep_grads_on_params"):
            return False
        opt.ddp.keep_grads_on_params()
        for b in self.buffers:
            buf = b.source
            b.param_grads = ParamGrads([(s.param, bk.start + s.start) for bk in buf.buckets for s in bk.slots],
                                       buf.numel, opt.device(), b.decay)
        log.info("one process, one micro-batch a step: gradients read from the parameters (no gradient buffer)")
        return True

    def step(self):
        """The step in one launch per DDP buffer: the squared norm of the flat gradients (its gaps are zeros),
        queued to the host, then the kernel (clip and skip read from that norm on the device), then the one
        host read, which waits for the norm only."""
        opt = self.opt
        if not opt.plain_reduction():
            return self.hand_over("a comm hook other than the all-reduce was registered").step()
        opt.ddp.finish_grad_sync()
        # one process: the gradients are the parameters' .grad (keep_grads_on_params; a comm hook registered since
        # put DDP back on its buffers)
        on_params = getattr(opt.ddp, "grads_on_params", False)
        if opt.sharded:  # ZeRO-1: the owned shards' sum of squares, summed over the ranks (one all-reduce)
            parts = [sumsq_segments(b.grad, b.segments, self.use_triton) for b in self.buffers]
            sumsq = opt.reduce_sumsq(parts[0] if len(parts) == 1 else torch.stack(parts).sum()).reshape(())
        elif on_params and self.use_triton:
            grads = [b.param_grads.grads() for b in self.buffers]  # (kept alive until the kernels are queued)
            addrs = [b.param_grads.addresses(g) for b, g in zip(self.buffers, grads)]
            try:
                parts = [sumsq_param_grads(b.param_grads, a) for b, a in zip(self.buffers, addrs)]
            except Exception as e:  # noqa: BLE001 - as for the update's kernel below (nothing was written yet)
                return self._kernel_failed("its norm kernel", e, self.launched)
            sumsq = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
        else:  # (the torch reference of the path above reads them laid out like the buffer)
            flats = [b.param_grads.gathered(b.param_grads.grads()) if on_params else b.grad for b in self.buffers]
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in flats]
            n = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
            sumsq = n * n
        s_host = HostCopy(sumsq)
        hyper = dict(lr=opt.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                     weight_decay=self.weight_decay, max_norm=float(opt.config.grad_clip), step=self.steps + 1)
        for i, b in enumerate(self.buffers):
            try:
                if b.segments is not None:
                    adamw_segments(b.master, b.grad, b.exp_avg, b.exp_avg_sq, b.decay, b.param_out, sumsq,
                                   b.segments, master_compact=b.master_compact, use_triton=self.use_triton,
                                   salt=b.salt, **hyper)
                    continue
                if on_params and self.use_triton:
                    adamw_param_grads(b.master, b.param_grads, addrs[i], b.exp_avg, b.exp_avg_sq, b.param_out,
                                      sumsq, salt=b.salt, **hyper)
                    continue
                adamw_flat(b.master, flats[i] if on_params else b.grad, b.exp_avg, b.exp_avg_sq,
                           b.decay, b.param_out, sumsq, use_triton=self.use_triton, salt=b.salt, **hyper)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot be built here: torch's fused AdamW instead
                return self._kernel_failed("its kernel", e, self.launched or i > 0)
        self.launched = True
        if opt.sharded:  # every shard all-gathered (a skipped step's too: every rank issues the same collectives)
            opt.after_step(list(range(len(opt.ddp.buckets))))
        return opt._device_verdict(s_host, then=self.count)  # read by the next step's start at the latest

    def _kernel_failed(self, what: str, e: Exception, updated: bool):
        """A kernel of the one-launch step failed: before anything was updated, this step and every later one are
        torch's fused AdamW's (logged once); after, or with bf16 moments (torch's AdamW keeps fp32 ones), the
        error stands (never a half-applied step)."""
        if updated or self.opt.config.state_dtype == "bf16":
            raise e
        return self.hand_over(f"{what} failed ({' '.join(str(e).split())[:300]})").step()

    def hand_over(self, why: str):
        """Back to the per-parameter torch AdamW for good: the moments stay where they are (its state holds views
        of them), the step counters take the count; the optimizer's path is the fallback from here on, which is
        returned. Refused with bf16 moments (torch's AdamW keeps fp32)."""
        opt = self.opt
        if opt.config.state_dtype == "bf16":
            raise RuntimeError(f"the one-launch AdamW cannot go on ({why}), and its bf16 moments "
                               "(--optimizer_state_dtype=bf16) have no other AdamW to step them")
        opt.settle_steps()  # (step() has: the count below must know every skip)
        log.warning("one-launch AdamW off: %s; torch's fused AdamW steps the parameters from here on", why)
        if getattr(opt.ddp, "grads_on_params", False):
            opt.ddp.restore_grad_buffers()  # this step's gradients into DDP's buffers, its hooks back
        opt.attach_grad_stores()  # torch's AdamW reads fp32 copies of low-precision gradients
        steps = float(self._steps)
        for adamw in opt.adamw.optimizers.values():
            for st in adamw.state.values():
                st["step"].fill_(steps)
        opt.adamw.step_count = None
        opt.path = self.fallback(opt)
        return opt.path
