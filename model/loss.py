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
    """Buffers for the chunks of one call, in the vocab-major layout ([V, c]: logits transposed).

    Why vocab-major: on CPU the three big matmuls run as W @ h^T, G @ h and G^T @ W with the [V, c]
    operand contiguous, which oneDNN's bf16 (AMX) kernels run up to ~2x faster than the token-major
    h @ W^T / G^T @ h (measured at V 32000, D 512, c 512-1024); fp32 is about equal either way.
    Why reused: a fresh multi-MB tensor costs page faults on CPU (a new [V, c] fp32 tensor per chunk
    measured several times slower than writing into an existing one), so on CPU the buffers are kept
    between calls (`_CPU_CACHE`, one set, replaced when the shape changes); elsewhere the caching
    allocator already does this.
    """

    def __init__(self, c: int, vocab: int, dim: int, cdtype: torch.dtype, device, need_w: bool):
        f32 = torch.float32
        self.vocab = vocab
        self.low_precision = cdtype != f32
        self.logits = torch.empty(vocab * c, dtype=f32, device=device)
        self.low = torch.empty(vocab * c, dtype=cdtype, device=device) if self.low_precision else None
        self.w_c = torch.empty(vocab, dim, dtype=cdtype, device=device) if self.low_precision else None
        self.w_low = torch.empty(vocab, dim, dtype=cdtype, device=device) if need_w and self.low_precision else None
        self.w_f32 = torch.empty(vocab, dim, dtype=f32, device=device) if need_w and self.low_precision else None

    @staticmethod
    def get(c: int, vocab: int, dim: int, cdtype: torch.dtype, device, need_w: bool) -> "_Workspace":
        if torch.device(device).type != "cpu":
            return _Workspace(c, vocab, dim, cdtype, device, need_w)
        key = (c, vocab, dim, cdtype, need_w)
        if _CPU_CACHE.get("key") != key:
            _CPU_CACHE.clear()  # free the old buffers before allocating the new ones
            _CPU_CACHE["ws"], _CPU_CACHE["key"] = _Workspace(c, vocab, dim, cdtype, device, need_w), key
        return _CPU_CACHE["ws"]

    def weight(self, w: torch.Tensor, cdtype: torch.dtype) -> torch.Tensor:
        """The weight in the compute dtype (one cast per call, into a reused buffer)."""
        if w.dtype == cdtype:
            return w
        if self.w_c is not None and w.shape == self.w_c.shape:
            return self.w_c.copy_(w)
        return w.to(cdtype)

    def logits_t(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """fp32 logits^T = w @ h^T of one chunk, [V, c] contiguous (matmul in the compute dtype)."""
        c = h.shape[0]
        out = self.logits[: self.vocab * c].view(self.vocab, c)
        if self.low_precision:
            low = self.low[: self.vocab * c].view(self.vocab, c)
            torch.mm(w, h.t(), out=low)
            return out.copy_(low)
        return torch.mm(w, h.t(), out=out)

    def to_compute(self, g: torch.Tensor) -> torch.Tensor:
        if not self.low_precision:
            return g
        return self.low[: g.numel()].view(g.shape).copy_(g)

    def acc_weight_grad(self, acc: torch.Tensor, g_t: torch.Tensor, h: torch.Tensor, first: bool) -> None:
        """acc (fp32) (+)= g_t @ h, g_t [V, c]."""
        if not self.low_precision:
            if first:
                torch.mm(g_t, h, out=acc)
            else:
                acc.addmm_(g_t, h)
            return
        torch.mm(g_t, h, out=self.w_low)
        if first:
            acc.copy_(self.w_low)
        else:
            acc.add_(self.w_f32.copy_(self.w_low))  # a same-dtype add is ~10x faster than a mixed one


_CPU_CACHE: dict = {}


def _softmax_stats_t(logits_t: torch.Tensor, y: torch.Tensor, want_grad: bool):
    """Per-token loss (0 where ignored), logsumexp, and (if wanted) the unnormalised gradient of one
    chunk of logits^T [V, c], in place.

    One exp pass serves logsumexp and the gradient. The gradient is left as G = exp(z - m) - s * onehot
    with s = sum exp(z - m) per token, i.e. s * (softmax - onehot): the per-token factor 1/s (and the
    reduction's scale) is applied to the [c, D] side of the matmuls instead of to the [V, c] matrix.
    """
    c = logits_t.shape[1]
    valid = y != IGNORE_INDEX
    safe_y = torch.where(valid, y, torch.zeros_like(y))
    cols = torch.arange(c, device=y.device)
    target = logits_t[safe_y, cols]
    m = logits_t.amax(dim=0)
    e = logits_t.sub_(m).exp_()
    s = e.sum(dim=0)
    lse = m + s.log()
    loss = torch.where(valid, lse - target, torch.zeros_like(lse))
    if want_grad:
        e[safe_y, cols] = e[safe_y, cols] - s  # (p - 1) * s at the target, in fp32 before any rounding
    return e, s, lse, loss, valid


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                reduction: str, chunk_size: int, need_grad: bool, cdtype: torch.dtype, need_w: bool):
        n = hidden.shape[0]
        dev = hidden.device
        grads_now = need_grad and reduction in ("mean", "sum")
        need_w = need_w and grads_now
        ws = _Workspace.get(min(chunk_size, n), weight.shape[0], weight.shape[1], cdtype, dev, need_w)
        h_c = hidden.to(cdtype)
        w_c = ws.weight(weight, cdtype)  # one cast of the weight, not one per chunk
        losses = torch.empty(n, dtype=torch.float32, device=dev)
        n_valid = (labels != IGNORE_INDEX).sum()
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
            g_t, sums, lse, loss, valid = _softmax_stats_t(ws.logits_t(h_c[s:e], w_c), labels[s:e], grads_now)
            losses[s:e] = loss
            if grads_now:
                _chunk_grads(ws, g_t, (unit * valid) / sums, h_c[s:e], w_c, d_hidden[s:e], d_weight, s == 0)
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
            # the usual upstream gradient is exactly 1 (loss.backward()): skip a pass over [V, D] then
            # (checked only on CPU, where reading the scalar costs no device sync)
            unit = g.device.type == "cpu" and g.item() == 1.0
            if d_weight is not None:
                d_w = (d_weight if unit else d_weight.mul_(g)).to(ctx.weight_dtype)  # in place: no new [V, D]
            else:
                d_w = None
            return (d_hidden if unit else d_hidden.mul_(g.to(d_hidden.dtype))), d_w, None, None, None, None, None, None
        hidden, weight, labels, lses = ctx.saved_tensors
        cdtype, cs = ctx.cdtype, ctx.chunk_size
        n = hidden.shape[0]
        ws = _Workspace.get(min(cs, n), weight.shape[0], weight.shape[1], cdtype, hidden.device, ctx.need_w)
        h_c, w_c = hidden.to(cdtype), ws.weight(weight, cdtype)
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if ctx.need_w else None
        g = g.float()
        for s in range(0, n, cs):
            e = min(s + cs, n)
            y = labels[s:e]
            valid = y != IGNORE_INDEX
            safe_y = torch.where(valid, y, torch.zeros_like(y))
            cols = torch.arange(e - s, device=y.device)
            p_t = ws.logits_t(h_c[s:e], w_c).sub_(lses[s:e]).exp_()  # softmax^T (s = 1)
            p_t[safe_y, cols] = p_t[safe_y, cols] - 1.0
            _chunk_grads(ws, p_t, g[s:e] * valid, h_c[s:e], w_c, d_hidden[s:e], d_weight, s == 0)
        del ws
        d_w = d_weight.to(ctx.weight_dtype) if d_weight is not None else None
        return d_hidden, d_w, None, None, None, None, None, None


def _chunk_grads(ws: _Workspace, g_t: torch.Tensor, row_scale: torch.Tensor, h_c: torch.Tensor,
                 w_c: torch.Tensor, d_hidden_out: torch.Tensor, d_weight: Optional[torch.Tensor],
                 first: bool) -> None:
    """d hidden = (G diag(r))^T W and d weight (+)= G diag(r) h for one chunk, G = g_t [V, c] (fp32),
    r = row_scale [c] (fp32). In fp32 the per-token scale multiplies the [c, D] operands (one pass over
    G fewer); in low precision it is applied to G before the cast."""
    if ws.low_precision:
        # scale G in fp32 before rounding it to the compute dtype (rounding G and h first, then scaling,
        # measured ~1.5x the reference's error for d weight in bf16)
        gc = ws.to_compute(g_t.mul_(row_scale))
        torch.mm(gc.t(), w_c, out=d_hidden_out) if d_hidden_out.dtype == gc.dtype else d_hidden_out.copy_(gc.t() @ w_c)
        if d_weight is not None:
            ws.acc_weight_grad(d_weight, gc, h_c, first)
        return
    r = row_scale[:, None]
    torch.mm(g_t.t(), w_c, out=d_hidden_out)
    d_hidden_out.mul_(r)
    if d_weight is not None:
        ws.acc_weight_grad(d_weight, g_t, h_c * r, first)


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


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str,
                 cfg) -> torch.Tensor:
    """The model's loss head: the implementation `cfg` (a ModelConfig) and the device select
    (model/kernels.py `choose`): the Triton linear+CE custom op, the chunked autograd Function, or the
    full-logits reference."""
    if not cfg.fused_cross_entropy:
        return linear_cross_entropy_ref(hidden, weight, labels, reduction)
    from model.kernels import _load_triton, choose
    if choose("cross_entropy", hidden, cfg.kernel_backend) == "triton":
        # on a GPU the op sizes its chunks from (tokens, vocab, dim) (auto_chunk_size); loss_chunk_size is
        # the CPU path's knob (and the interpreter's, where small chunks keep the tests fast)
        chunk = None if hidden.is_cuda else cfg.loss_chunk_size
        return _load_triton("triton_loss").linear_cross_entropy_triton(hidden, weight, labels, reduction, chunk)
    return linear_cross_entropy(hidden, weight, labels, reduction, cfg.loss_chunk_size)


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
