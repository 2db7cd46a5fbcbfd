"""Chunked linear + cross-entropy: the LM head and its loss without full [tokens x vocab] logits.

Owns: `linear_cross_entropy(hidden, weight, labels, reduction, chunk_size)` and its reference
`linear_cross_entropy_ref`. Tokens are processed `chunk_size` at a time: per chunk the logits are
computed, reduced to logsumexp and the target logit, and dropped. Peak extra memory is one chunk of
logits (chunk_size x vocab) plus the fp32 weight-gradient accumulator, instead of the full logits,
their softmax and their gradient.

Gradients: for "mean"/"sum" the upstream gradient is a scalar, so d hidden and d weight are computed
in the forward pass while the chunk's logits are live (3 matmuls in total, like the unfused path) and
only scaled in backward. For "none" the upstream gradient is per token and d weight depends on it, so
backward recomputes each chunk's logits from the saved hidden states and per-token logsumexp.

Precision: under autocast the matmuls run in the autocast dtype; logsumexp, the loss and the
weight-gradient accumulation are fp32.

Must never: materialise logits for all tokens at once, or silently turn an all-ignored batch into
NaN ("mean" of zero target tokens is 0, documented).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from utils.constants import IGNORE_INDEX


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


class _Workspace:
    """Buffers reused by every chunk of one call.

    Why: on CPU a fresh multi-MB tensor costs page faults (a new [c, V] fp32 tensor per chunk measured
    several times slower than copying into an existing one), so logits, their low-precision twin and the
    weight-gradient staging buffers are allocated once per call, not once per chunk.
    """

    def __init__(self, c: int, vocab: int, dim: int, cdtype: torch.dtype, device, need_w: bool):
        f32 = torch.float32
        self.low_precision = cdtype != f32
        self.logits = torch.empty(c, vocab, dtype=f32, device=device)
        self.low = torch.empty(c, vocab, dtype=cdtype, device=device) if self.low_precision else None
        self.w_low = torch.empty(vocab, dim, dtype=cdtype, device=device) if need_w and self.low_precision else None
        self.w_f32 = torch.empty(vocab, dim, dtype=f32, device=device) if need_w and self.low_precision else None

    def logits_fp32(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """fp32 logits h @ w.T of one chunk (matmul in the compute dtype)."""
        out = self.logits[: h.shape[0]]
        if self.low_precision:
            low = self.low[: h.shape[0]]
            torch.mm(h, w.t(), out=low)
            return out.copy_(low)
        return torch.mm(h, w.t(), out=out)

    def to_compute(self, dl: torch.Tensor) -> torch.Tensor:
        if not self.low_precision:
            return dl
        return self.low[: dl.shape[0]].copy_(dl)

    def acc_weight_grad(self, acc: torch.Tensor, dl: torch.Tensor, h: torch.Tensor, first: bool) -> None:
        """acc (fp32) (+)= dl^T @ h."""
        if not self.low_precision:
            if first:
                torch.mm(dl.t(), h, out=acc)
            else:
                acc.addmm_(dl.t(), h)
            return
        torch.mm(dl.t(), h, out=self.w_low)
        if first:
            acc.copy_(self.w_low)
        else:
            acc.add_(self.w_f32.copy_(self.w_low))  # a same-dtype add is ~10x faster than a mixed one


def _softmax_stats(logits: torch.Tensor, y: torch.Tensor, want_probs: bool):
    """Per-token loss (0 where ignored) and logsumexp of one chunk; softmax in place if wanted.

    One exp pass over the chunk's [c, V] logits serves both the logsumexp and the softmax.
    """
    valid = y != IGNORE_INDEX
    safe_y = torch.where(valid, y, torch.zeros_like(y))
    target = logits.gather(1, safe_y[:, None]).squeeze(1)
    m = logits.amax(dim=-1, keepdim=True)
    e = logits.sub_(m).exp_()
    s = e.sum(dim=-1, keepdim=True)
    lse = (m + s.log()).squeeze(1)
    loss = torch.where(valid, lse - target, torch.zeros_like(lse))
    probs = e.div_(s) if want_probs else None
    return probs, lse, loss, valid, safe_y


def _dlogits_(probs: torch.Tensor, valid: torch.Tensor, safe_y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """In place: (softmax - onehot) * scale per row, zero for ignored rows (fp32)."""
    probs.scatter_add_(1, safe_y[:, None], torch.full_like(probs[:, :1], -1.0))
    return probs.mul_((scale * valid)[:, None])


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                reduction: str, chunk_size: int, need_grad: bool, cdtype: torch.dtype, need_w: bool):
        n = hidden.shape[0]
        dev = hidden.device
        h_c = hidden.to(cdtype)
        w_c = weight.to(cdtype)  # one cast of the weight, not one per chunk
        losses = torch.empty(n, dtype=torch.float32, device=dev)
        n_valid = (labels != IGNORE_INDEX).sum()
        grads_now = need_grad and reduction in ("mean", "sum")
        need_w = need_w and grads_now
        ws = _Workspace(min(chunk_size, n), weight.shape[0], weight.shape[1], cdtype, dev, need_w)
        if grads_now:
            d_hidden = torch.empty(n, hidden.shape[1], dtype=hidden.dtype, device=dev)
            # a frozen LM head (e.g. LoRA) skips a third of the head's matmuls
            d_weight = torch.empty(weight.shape, dtype=torch.float32, device=dev) if need_w else None
            # "mean" divides by the target count here; backward multiplies by the upstream scalar
            unit = torch.ones((), dtype=torch.float32, device=dev)
            if reduction == "mean":
                unit = unit / n_valid.clamp(min=1)
        lses = torch.empty(n, dtype=torch.float32, device=dev) if need_grad and not grads_now else None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = ws.logits_fp32(h_c[s:e], w_c)
            probs, lse, loss, valid, safe_y = _softmax_stats(logits, labels[s:e], grads_now)
            losses[s:e] = loss
            if grads_now:
                dl = ws.to_compute(_dlogits_(probs, valid, safe_y, unit))
                d_hidden[s:e] = dl @ w_c
                if need_w:
                    ws.acc_weight_grad(d_weight, dl, h_c[s:e], first=(s == 0))
            elif lses is not None:
                lses[s:e] = lse
        del ws
        ctx.reduction, ctx.chunk_size, ctx.cdtype, ctx.grads_now = reduction, chunk_size, cdtype, grads_now
        ctx.weight_dtype = weight.dtype
        ctx.need_w = need_w if grads_now else bool(weight.requires_grad)
        if grads_now:
            ctx.save_for_backward(d_hidden, d_weight if need_w else None)
        elif need_grad:
            ctx.save_for_backward(hidden, weight, labels, lses)
        if reduction == "none":
            return losses
        total = losses.sum()
        if reduction == "mean":
            return total / n_valid.clamp(min=1)
        return total

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.grads_now:
            # the saved gradients are scaled in place (no second [V, D] buffer), so only once
            if getattr(ctx, "used", False):
                raise RuntimeError("linear_cross_entropy: backward twice (retain_graph) is not supported "
                                   "for 'mean'/'sum'; use reduction='none' and reduce outside")
            ctx.used = True
            d_hidden, d_weight = ctx.saved_tensors
            d_w = d_weight.mul_(g).to(ctx.weight_dtype) if d_weight is not None else None  # in place: no new [V, D]
            return d_hidden.mul_(g.to(d_hidden.dtype)), d_w, None, None, None, None, None, None
        hidden, weight, labels, lses = ctx.saved_tensors
        cdtype, cs = ctx.cdtype, ctx.chunk_size
        h_c, w_c = hidden.to(cdtype), weight.to(cdtype)
        n = hidden.shape[0]
        ws = _Workspace(min(cs, n), weight.shape[0], weight.shape[1], cdtype, hidden.device, ctx.need_w)
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if ctx.need_w else None
        g = g.float()
        for s in range(0, n, cs):
            e = min(s + cs, n)
            y = labels[s:e]
            valid = y != IGNORE_INDEX
            safe_y = torch.where(valid, y, torch.zeros_like(y))
            probs = ws.logits_fp32(h_c[s:e], w_c).sub_(lses[s:e, None]).exp_()
            dl = ws.to_compute(_dlogits_(probs, valid, safe_y, g[s:e]))
            d_hidden[s:e] = dl @ w_c
            if d_weight is not None:
                ws.acc_weight_grad(d_weight, dl, h_c[s:e], first=(s == 0))
        d_w = d_weight.to(ctx.weight_dtype) if d_weight is not None else None
        return d_hidden, d_w, None, None, None, None, None, None


@torch.compiler.disable  # stays eager inside a compiled model: its buffer reuse is the point
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         reduction: str = "mean", chunk_size: int = 512) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `labels` without the full logits.

    hidden [..., D], weight [V, D], labels [...] (already shifted; IGNORE_INDEX = -100 skipped).
    reduction: "mean" over non-ignored tokens (0 if there are none), "sum", or "none" -> loss with the
    shape of `labels`, 0 at ignored positions.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    out = _LinearCrossEntropy.apply(h, weight, y, reduction, int(chunk_size), need_grad,
                                    _compute_dtype(hidden), bool(weight.requires_grad))
    return out.reshape(shape) if reduction == "none" else out


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             reduction: str = "mean") -> torch.Tensor:
    """Reference: full logits in fp32 + F.cross_entropy (what HF Llama does)."""
    logits = F.linear(hidden, weight).float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="none")
    if reduction == "none":
        return loss.reshape(labels.shape)
    if reduction == "sum":
        return loss.sum()
    n_valid = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return loss.sum() / n_valid


def cross_entropy_from_logits(logits: torch.Tensor, labels: torch.Tensor,
                              reduction: str = "mean") -> torch.Tensor:
    """CE for callers that already have logits [..., V] (same reductions as above)."""
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="none")
    if reduction == "none":
        return loss.reshape(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)
