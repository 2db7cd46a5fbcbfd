"""The one place a torch AdamW is built for the optimizers of this package, and AdamW as an update of our DDP's
optimizers (`BucketAdamW`).

Owns: the two parameter groups (weight decay on the parameters given as decayed, none on the others)
and the choice of torch's implementation: fused, foreach or the single-tensor loop.
Must never: decide which parameters decay (the caller knows: ndim >= 2 of the MODEL parameter, which a
flat ZeRO shard no longer shows), or change a parameter's dtype or device.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from optimizer.base import moment_bytes
from optimizer.fused_step import fused_adamw_step
from optimizer.optimizer_config import OptimizerConfig


def build_adamw(decay: Sequence[torch.Tensor], no_decay: Sequence[torch.Tensor], config: OptimizerConfig,
                device_type: str, *, single_tensor_on_cpu: bool = False) -> torch.optim.AdamW:
    """torch AdamW over `decay` (config.weight_decay) and `no_decay` (0.0); an empty group is left out.

    config.fused: torch's fused kernel, or the foreach one where the device/dtype has no fused kernel;
    otherwise the foreach kernel. single_tensor_on_cpu: on a "cpu" device_type, the reference
    single-tensor loop whatever config.fused says (FSDP's CPU and offloaded DTensor shards).
    """
    groups = [{"params": list(decay), "weight_decay": config.weight_decay},
              {"params": list(no_decay), "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kw = dict(lr=float(config.lr), betas=config.betas, eps=config.eps)
    if single_tensor_on_cpu and device_type == "cpu":
        return torch.optim.AdamW(groups, foreach=False, fused=False, **kw)
    if config.fused:
        try:
            return torch.optim.AdamW(groups, fused=True, foreach=False, **kw)
        except (RuntimeError, ValueError):  # no fused kernel for this device/dtype: foreach is equivalent
            return torch.optim.AdamW(groups, foreach=True, **kw)
    return torch.optim.AdamW(groups, fused=False, foreach=True, **kw)


class BucketAdamW:
    """AdamW as one of a DDP optimizer's updates (optimizer/mixed_precision_optimizer.py), beside Muon's: one torch
    AdamW per bucket over the bucket's pieces (so `--overlap_optim_step` can step a bucket as soon as its gradients
    arrived), every bucket stepped as one batch of fused launches where they can be (optimizer/fused_step.py).

    Owns: the torch AdamW objects, their step (`batched=False`: each bucket's own `step()`, which tests compare with
    the batch bit for bit), and each piece's part of the optimizer state dict. The one-launch AdamW
    (optimizer/one_launch_step.py) keeps these objects for their groups and their state (views of its flat moments)
    and counts the steps itself (`step_count`)."""
    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, pieces_by_bucket: dict, config: OptimizerConfig, device_type: str, *,
                 batched: bool = True) -> None:
        self.optimizers: dict[int, torch.optim.AdamW] = {
            b: build_adamw([pc.main for pc in ps if pc.decay], [pc.main for pc in ps if not pc.decay], config,
                           device_type) for b, ps in pieces_by_bucket.items() if ps}
        self.batched = batched
        self.step_count = None  # the one-launch AdamW's step count (an object with `.steps`), when it steps them
        self._loaded_steps = 0

    @property
    def skips_on_device(self) -> bool:
        """Whether every AdamW is fused: torch's fused kernel reads a device flag (`found_inf`) and skips there."""
        return bool(self.optimizers) and all(opt.defaults.get("fused") for opt in self.optimizers.values())

    def step(self, found_inf: Optional[torch.Tensor] = None) -> None:
        """Every bucket's AdamW: as one batch of fused launches when they are fused and hold state, else one by one
        (the first step, foreach / single-tensor AdamW)."""
        opts = list(self.optimizers.values())
        if self.batched and fused_adamw_step(opts, found_inf):
            return
        for opt in opts:
            opt.found_inf = found_inf  # read by torch's Adam.step and passed to the fused kernel
            try:
                opt.step()
            finally:
                opt.found_inf = None

    def state_bytes(self) -> int:
        return moment_bytes(self.optimizers.values())

    # ------------------------------------------------------------------ a piece's state
    def piece_state(self, pc, own: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        st = self.optimizers[pc.bucket_index].state.get(pc.main, {})
        zeros = torch.zeros(pc.hi - pc.lo, dtype=torch.float32)
        return {"exp_avg": own(st["exp_avg"].reshape(-1)) if st else zeros,
                "exp_avg_sq": own(st["exp_avg_sq"].reshape(-1)) if st else zeros.clone(),
                "step": (float(self.step_count.steps) if self.step_count is not None else
                         float(st["step"]) if st else 0.0)}

    def begin_load(self) -> None:
        self._loaded_steps = 0

    def load_piece(self, pc, parts: dict, step: float) -> None:
        opt = self.optimizers[pc.bucket_index]
        if self.step_count is not None:  # the state is views of the one-launch AdamW's moments: filled in place
            st = opt.state[pc.main]
            for key in self.state_keys:
                st[key].copy_(parts[key].view(pc.main.shape) if step > 0 else torch.zeros_like(st[key]))
            self._loaded_steps = max(self._loaded_steps, int(step))
            return
        opt.state.pop(pc.main, None)
        if step > 0:
            fused = bool(opt.defaults.get("fused"))
            opt.state[pc.main] = {
                "step": torch.tensor(step, dtype=torch.float32, device=pc.main.device if fused else "cpu"),
                "exp_avg": parts["exp_avg"].view(pc.main.shape).clone(),
                "exp_avg_sq": parts["exp_avg_sq"].view(pc.main.shape).clone()}

    def end_load(self) -> None:
        if self.step_count is not None:
            self.step_count.steps = self._loaded_steps
