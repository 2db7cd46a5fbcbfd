"""Logit soft-capping (Gemma 2's): z -> cap * tanh(z / cap), which keeps every logit inside (-cap, cap) and is z itself
near 0. Gemma 2 caps its attention scores (`attn_logit_softcapping`, 50) and its final logits
(`final_logit_softcapping`, 30); model/config.py's `attn_softcap` and `final_softcap`.

Owns: `softcap` (the autograd formula, transformers' own order of operations: z / cap, tanh, x cap), `softcap_` (in
place, for the chunked heads that form their gradients by hand - model/loss.py, model/token_logprobs.py,
model/vocab_parallel_loss.py, model/distill_head.py: it returns d cap(z) / d z = 1 - tanh(z / cap)^2) and `cap_value`
(the heads' check of a cap argument).

Must never: change a tensor when `cap` is None (every model without soft-capping takes these calls unchanged).
"""
from __future__ import annotations

from typing import Optional

import torch


def softcap(z: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(z / cap) (a new tensor; autograd differentiates it), or z itself where cap is None."""
    if cap is None:
        return z
    return torch.tanh(z / cap) * cap


def softcap_(z: torch.Tensor, cap: Optional[float], want_deriv: bool = True,
             out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """z <- cap * tanh(z / cap) in place; returns the derivative 1 - tanh(z / cap)^2 (in `out` where given, else a new
    tensor of z's shape), by which a gradient with respect to the capped logits becomes one with respect to z; None
    where `want_deriv` is off, or (z unchanged) where cap is None."""
    if cap is None:
        return None
    t = z.div_(cap).tanh_()
    d = torch.mul(t, t, out=out).neg_().add_(1.0) if want_deriv else None  # 1 - tanh^2
    t.mul_(cap)
    return d


def cap_value(softcap: Optional[float]) -> Optional[float]:
    """A head's `softcap` argument as a float (None: no cap); ValueError unless it is > 0."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap!r}")
    return None if softcap is None else float(softcap)
