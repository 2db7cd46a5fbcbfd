"""The one place a torch AdamW is built for the optimizers of this package.

Owns: the two parameter groups (weight decay on the parameters given as decayed, none on the others)
and the choice of torch's implementation: fused, foreach or the single-tensor loop.
Must never: decide which parameters decay (the caller knows: ndim >= 2 of the MODEL parameter, which a
flat ZeRO shard no longer shows), or change a parameter's dtype or device.
"""
from __future__ import annotations

from typing import Sequence

import torch

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
