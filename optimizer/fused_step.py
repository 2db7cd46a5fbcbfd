"""One AdamW update over every bucket's optimizer: torch's fused AdamW kernel called once per
hyper-parameter group for all of them, instead of once per (bucket, group) through each optimizer's
`step()`.

Why: our DDP optimizers keep one torch AdamW per bucket (so `--overlap_optim_step` can step a bucket as
soon as its gradients arrive). Stepped one by one, a 124M model's ~19 buckets cost 19 `step()` calls of
Python set-up and 19 x (step-counter add, fused kernel per group, found-inf subtract) launches; the H100
profile of a compiled 124M step showed the GPU waiting on that host time (issue "GPU speed, third
pass", item 4). Here the step counters of every bucket move with one foreach add (and one subtract of
the overflow flag), and each group's tensors of every bucket go to ONE `torch._fused_adamw_`.

Exact: the kernel is elementwise, so batching more tensors into one call changes no bit; the sequence
(counters + 1, update, counters - found_inf) is torch's own `_fused_adam` (torch/optim/adam.py).
`tests/optimizer/test_step_launches.py` compares both ways bit for bit and counts the launches.

Owns: the batched step only. The optimizers, their state and its format stay torch's AdamW's; the
first step of an optimizer (no state yet), a non-fused AdamW, AMSGrad or a tensor learning rate go
through each optimizer's own `step()` (returns False: the caller does that).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.optim import Optimizer


def _group_key(group: dict) -> Optional[tuple]:
    """The hyper-parameters one fused call shares; None where this path does not apply."""
    lr = group["lr"]
    if (not group.get("fused") or group.get("amsgrad") or group.get("differentiable")
            or isinstance(lr, torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"])):
        return None
    return (float(lr), float(group["betas"][0]), float(group["betas"][1]), float(group["weight_decay"]),
            float(group["eps"]), bool(group.get("maximize", False)),
            bool(group.get("decoupled_weight_decay", True)))


def fused_adamw_step(optimizers: Sequence[torch.optim.Optimizer], found_inf: Optional[torch.Tensor] = None) -> bool:
    """Step every optimizer in `optimizers` (torch AdamW/Adam with fused=True) as one batch; where a
    step is skipped on the device, `found_inf` is a 0-d float tensor (1.0: leave parameters, moments and
    step counters as they are). Returns False, having changed nothing, when some optimizer cannot be
    batched (the caller then steps each one)."""
    batches: dict[tuple, list[list[torch.Tensor]]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            key = _group_key(group)
            if key is None:
                return False
            lists = batches.setdefault(key, [[], [], [], [], []])
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = opt.state.get(p)
                if not st or "exp_avg" not in st or not isinstance(st.get("step"), torch.Tensor):
                    return False  # the first step creates the state: torch's own step() does that
                for lst, t in zip(lists, (p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"])):
                    lst.append(t)
    steps_all = [t for lists in batches.values() for t in lists[4]]
    if not steps_all:
        return True
    torch._foreach_add_(steps_all, 1)
    for (lr, beta1, beta2, wd, eps, maximize, decoupled), lists in batches.items():
        if not lists[0]:
            continue
        grouped = Optimizer._group_tensors_by_device_and_dtype(lists)
        for (device, _), ((params, grads, exp_avgs, exp_avg_sqs, steps), _) in grouped.items():
            func = torch._fused_adamw_ if decoupled else torch._fused_adam_
            func(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=lr, beta1=beta1,
                 beta2=beta2, weight_decay=wd, eps=eps, maximize=maximize, grad_scale=None,
                 found_inf=None if found_inf is None else found_inf.to(device))
    if found_inf is not None:
        torch._foreach_sub_(steps_all, [found_inf] * len(steps_all))
    return True
