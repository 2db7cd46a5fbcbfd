"""The step paths of our DDP's optimizers (optimizer/mixed_precision_optimizer.py), one class each, and the one
place a path is chosen: `choose_path`, when the optimizer is built.

- `overlapped`, OverlappedStep: `--overlap_optim_step`, each bucket stepped as soon as its gradients arrived;
- `one_launch`, OneLaunchStep (optimizer/one_launch_step.py): AdamW in one launch per DDP buffer, on CUDA with
  Triton where it can step the run (OptimizerConfig.one_launch: "on" anywhere it can, "off" never), and always
  with bf16 moments, which live only there;
- `device_decided`, DeviceDecidedStep: every update takes a device flag (torch's fused AdamW): the clip and the
  skip decided on the device, the norm read after the update's launches;
- `host_decided`, HostDecidedStep: the rest (Muon; foreach / single-tensor AdamW, e.g. a CPU run): the norm read,
  then the clip or the skip.

A path steps the optimizer it was built for through the optimizer's hooks and helpers (its pieces, updates,
gradient loading and the skeleton of optimizer/base.py); `step()` runs it and never chooses. The one change of
path after construction is the one-launch AdamW handing over to torch's AdamW for good (a kernel that cannot be
built, a comm hook registered later: `OneLaunchStep.hand_over`).
Must never: step a bucket that some rank skips (the overlapped step's flag is MAX-reduced), or be picked where it
cannot step the run (a path given by name is refused with the reason).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from optimizer.base import clip_coefficient
from optimizer.one_launch_step import OneLaunchStep, one_launch_applies, one_launch_unfit

PATHS = ("overlapped", "one_launch", "device_decided", "host_decided")


class HostDecidedStep:
    """The skeleton with the host deciding: the squared norm read, then skip, or clip and update."""
    name = "host_decided"

    def __init__(self, opt) -> None:
        self.opt = opt

    def step(self) -> tuple[bool, float]:
        return self.opt.host_decided_step()

    def keep_grads_on_params(self) -> bool:
        return False


class DeviceDecidedStep(HostDecidedStep):
    """The skeleton with the clip and the skip decided on the device (torch's fused AdamW reads the skip flag,
    `found_inf`): the one host read comes after the update's launches; the same bits as HostDecidedStep."""
    name = "device_decided"

    def step(self):
        return self.opt.device_decided_step()


class OverlappedStep(HostDecidedStep):
    """--overlap_optim_step: step each bucket right after its communication finished. Clipping uses the PREVIOUS
    step's global norm (the current one needs every bucket); the first step is unclipped. A bucket whose gradients
    hold an inf/nan on ANY rank is skipped on every rank (a MAX all-reduce of the flag per bucket); the other
    buckets are stepped. AdamW only (optimizer_config.py refuses Muon and fp16 with it)."""
    name = "overlapped"

    def step(self) -> tuple[bool, float]:
        opt = self.opt
        coef = clip_coefficient(opt.config.grad_clip, opt.prev_grad_norm)
        sumsq = torch.zeros((), dtype=torch.float32, device=opt.device())
        skipped: list[int] = []

        def on_bucket(bucket) -> None:
            pieces = opt.pieces_by_bucket.get(bucket.index, [])
            sq = torch.zeros((), dtype=torch.float32, device=opt.device())
            if pieces:
                opt.load_grads(pieces)
                sq = opt.local_sumsq(pieces)
                sumsq.add_(sq)
            # every rank calls this for every bucket, in launch order (a collective)
            if opt.non_finite_anywhere(sq):
                skipped.append(bucket.index)
            elif pieces:
                if coef < 1.0:
                    torch._foreach_mul_([pc.main.grad for pc in pieces], coef)
                opt.adamw.optimizers[bucket.index].step()
                opt.copy_main_to_model(pieces)
            opt.after_step([bucket.index])  # always: the all-gather is a collective

        opt.ddp.finish_grad_sync(on_bucket_done=on_bucket)
        opt.after_grads_loaded()
        opt._report_verdict(True if not skipped else
                            [b.index for b in opt.ddp.buckets if b.index not in skipped])
        norm = math.sqrt(float(opt._sum_over_norm_groups(opt.reduce_sumsq(sumsq)).item()))
        opt.prev_grad_norm = norm
        opt._drop_grads()
        return not skipped, norm


def torch_adamw_path(opt) -> HostDecidedStep:
    """The skeleton's path for torch's AdamW (with Muon beside it): decided on the device where every update takes
    a device flag, else on the host."""
    if all(u.skips_on_device for u in opt.updates):
        return DeviceDecidedStep(opt)
    return HostDecidedStep(opt)


def choose_path(opt, name: Optional[str] = None):
    """The path that steps `opt`, chosen once: `name` (one of PATHS; tests and benchmarks) or, for None, the run's:
    overlapped with --overlap_optim_step, else the one-launch AdamW where `one_launch_applies`, else torch's AdamW
    decided on the device or the host. A named path that cannot step this optimizer is refused."""
    if name is not None and name not in PATHS:
        raise ValueError(f"unknown optimizer step path {name!r}: one of {', '.join(PATHS)}")
    overlapped = bool(opt.config.overlap_optim_step)
    if name is not None and (name == "overlapped") != overlapped:
        raise ValueError(f"the {name} step path {'needs' if name == 'overlapped' else 'cannot run with'} "
                         "overlap_optim_step=True")
    if overlapped and getattr(opt, "has_experts", False):
        raise ValueError("overlap_optim_step cannot step expert-parallel shards (their norm is summed over the "
                         "expert-parallel ranks, not per bucket)")
    if overlapped:
        opt.attach_grad_stores()
        return OverlappedStep(opt)
    if name == "one_launch":
        why_not = one_launch_unfit(opt, "off" if opt.config.one_launch == "off" else "on")
        if why_not:
            raise ValueError(f"the one-launch AdamW cannot step this optimizer: {why_not}")
    if name == "one_launch" or name is None and one_launch_applies(opt):
        return OneLaunchStep.build(opt, fallback=torch_adamw_path)
    if opt.config.state_dtype == "bf16":
        raise ValueError(f"--optimizer_state_dtype=bf16 needs the one-launch AdamW, not the {name} step path")
    opt.attach_grad_stores()  # torch's AdamW steps fp32 masters with fp32 gradients (bf16 ones are widened)
    if name == "device_decided" and not all(u.skips_on_device for u in opt.updates):
        raise ValueError("the device_decided step path needs every update to take a device flag (fused AdamW, "
                         "no Muon)")
    if name == "host_decided":
        return HostDecidedStep(opt)
    return torch_adamw_path(opt)
