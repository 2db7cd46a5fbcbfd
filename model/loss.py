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
weight-gradient accumulation are fp32: each chunk's d weight product is summed in fp32 and the
accumulator is rounded once, at the end (`accumulate_fp32_`; on CPU the product is an fp32 matmul of
the fp32 softmax gradient, also the fast one on CPUs without native bf16 matmuls). In fp16 the
gradients formed in the forward are scaled by FP16_GRAD_SCALE, not by 1/n_valid ("mean"), and
unscaled in backward after the upstream (loss-scaled) gradient: at 1/n_valid they underflowed fp16.

Soft-capped logits (Gemma 2's final_softcap, model/softcap.py): with `softcap` each chunk's logits are capped in
place, cap * tanh(z / cap), before the softmax statistics, and the gradient with respect to the capped logits is
multiplied by the cap's derivative 1 - tanh^2 (one more [V, c] buffer per call); the Triton op has no cap, so
`lm_head_loss` takes the chunked path for a capped model.

Under torch.compile the same code runs as one opaque custom op (`myllm::chunked_linear_cross_entropy`,
with a fake implementation and a registered autograd formula), so `fullgraph=True` holds and the
chunking and buffer reuse stay as they are; eagerly it is a plain autograd.Function.

Must never: materialise logits for all tokens at once, or silently turn an all-ignored batch into
NaN ("mean" of zero target tokens is 0, documented).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from model.kernels import REFERENCE_LOSS_MAX_LOGITS_BYTES, choose, load_triton
from model.loss_precision import (FP16_GRAD_SCALE, accumulate_fp32_, compute_dtype, fp16_grad_factor,
                                  fp16_grads, scale_, scaled)
from model.softcap import cap_value, softcap_
from model.softcap import softcap as softcap_logits
from utils.constants import IGNORE_INDEX

log = logging.getLogger(__name__)


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

    def __init__(self, c: int, vocab: int, dim: int, cdtype: torch.dtype, device):
        f32 = torch.float32
        self.vocab = vocab
        self.low_precision = cdtype != f32
        self.logits = torch.empty(vocab * c, dtype=f32, device=device)
        self.low = torch.empty(vocab * c, dtype=cdtype, device=device) if self.low_precision else None
        self.w_c = torch.empty(vocab, dim, dtype=cdtype, device=device) if self.low_precision else None
        self.deriv = None  # the soft-cap's derivative, [V, c] fp32: allocated on the first capped chunk

    @staticmethod
    def get(c: int, vocab: int, dim: int, cdtype: torch.dtype, device) -> "_Workspace":
        if torch.device(device).type != "cpu":
            return _Workspace(c, vocab, dim, cdtype, device)
        key = (c, vocab, dim, cdtype)
        if _CPU_CACHE.get("key") != key:
            _CPU_CACHE.clear()  # free the old buffers before allocating the new ones
            _CPU_CACHE["ws"], _CPU_CACHE["key"] = _Workspace(c, vocab, dim, cdtype, device), key
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

    def softcap_t_(self, logits_t: torch.Tensor, cap: Optional[float], want_deriv: bool) -> Optional[torch.Tensor]:
        """logits_t <- cap * tanh(logits_t / cap) in place (model/softcap.py's order of operations); returns the
        derivative 1 - tanh^2 [V, c] (in a reused buffer) if wanted, else None. Nothing happens without a cap."""
        if cap is not None and want_deriv and self.deriv is None:
            self.deriv = torch.empty_like(self.logits)
        out = self.deriv[: logits_t.numel()].view(logits_t.shape) if cap is not None and want_deriv else None
        return softcap_(logits_t, cap, want_deriv, out)


_CPU_CACHE: dict = {}

def _softmax_stats_t(logits_t: torch.Tensor, y: torch.Tensor, want_grad: bool, ws: Optional[_Workspace] = None,
                     cap: Optional[float] = None):
    """Per-token loss (0 where ignored), logsumexp, and (if wanted) the unnormalised gradient of one
    chunk of logits^T [V, c], in place.

    One exp pass serves logsumexp and the gradient. The gradient is left as G = exp(z - m) - s * onehot
    with s = sum exp(z - m) per token, i.e. s * (softmax - onehot): the per-token factor 1/s (and the
    reduction's scale) is applied to the [c, D] side of the matmuls instead of to the [V, c] matrix.
    With a soft-cap (`cap`, `ws` holding the derivative's buffer) the logits are capped first and G is
    multiplied by the cap's derivative: the gradient with respect to the uncapped logits.
    """
    deriv = ws.softcap_t_(logits_t, cap, want_grad) if cap is not None else None
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
        if deriv is not None:
            e.mul_(deriv)
    return e, s, lse, loss, valid


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
            # on CPU from the fp32 G itself (no widening pass over [V, c]); elsewhere the rounded G in one
            # GEMM with an fp32 output. Either way the chunk's product is never rounded to cdtype.
            accumulate_fp32_(d_weight, g_t if g_t.device.type == "cpu" else gc, h_c, first)
        return
    r = row_scale[:, None]
    torch.mm(g_t.t(), w_c, out=d_hidden_out)
    d_hidden_out.mul_(r)
    if d_weight is not None:
        accumulate_fp32_(d_weight, g_t, h_c * r, first)


def _forward_chunks(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str,
                    chunk_size: int, need_grad: bool, cdtype: torch.dtype, need_w: bool,
                    cap: Optional[float] = None):
    """The forward of the chunked linear+CE, shared by the autograd Function (eager) and the custom op
    (compiled). hidden [N, D], weight [V, D], labels [N].

    Returns (loss, lses, d_hidden, d_weight, n_valid). For "mean"/"sum" with gradients: d_hidden [N, D]
    (hidden's dtype) and d_weight [V, D] fp32 (None for a frozen head) are the gradients for an upstream
    gradient of 1 (in fp16: of the sum, times FP16_GRAD_SCALE, see `fp16_grads`), lses None. For "none"
    with gradients: lses [N] fp32 (backward recomputes each chunk), d_* None. Without gradients all
    three are None. `cap`: the logits' soft-cap (None: none)."""
    n = hidden.shape[0]
    dev = hidden.device
    grads_now = need_grad and reduction in ("mean", "sum")
    need_w = need_w and grads_now
    d_hidden = d_weight = lses = None
    with torch.autocast(dev.type, enabled=False):  # every matmul runs in cdtype, chosen by the caller
        ws = _Workspace.get(min(chunk_size, n), weight.shape[0], weight.shape[1], cdtype, dev)
        h_c = hidden.to(cdtype)
        w_c = ws.weight(weight, cdtype)  # one cast of the weight, not one per chunk
        losses = torch.empty(n, dtype=torch.float32, device=dev)
        n_valid = (labels != IGNORE_INDEX).sum()
        if grads_now:
            d_hidden = torch.empty(n, hidden.shape[1], dtype=hidden.dtype, device=dev)
            # a frozen LM head (e.g. LoRA) skips a third of the head's matmuls
            d_weight = torch.empty(weight.shape, dtype=torch.float32, device=dev) if need_w else None
            # "mean" divides by the target count here (fp16: in backward); backward multiplies by the
            # upstream scalar
            unit = torch.ones((), dtype=torch.float32, device=dev)
            if fp16_grads(reduction, cdtype):
                unit = unit * FP16_GRAD_SCALE
            elif reduction == "mean":
                unit = unit / n_valid.clamp(min=1)
        elif need_grad:
            lses = torch.empty(n, dtype=torch.float32, device=dev)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            g_t, sums, lse, loss, valid = _softmax_stats_t(ws.logits_t(h_c[s:e], w_c), labels[s:e], grads_now, ws, cap)
            losses[s:e] = loss
            if grads_now:
                _chunk_grads(ws, g_t, (unit * valid) / sums, h_c[s:e], w_c, d_hidden[s:e], d_weight, s == 0)
            elif lses is not None:
                lses[s:e] = lse
        if d_weight is not None and n == 0:
            d_weight.zero_()
        del ws
        if reduction == "none":
            out = losses
        elif reduction == "mean":
            out = losses.sum() / n_valid.clamp(min=1)
        else:
            out = losses.sum()
    return out, lses, d_hidden, d_weight, n_valid


def _backward_chunks(g: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     lses: torch.Tensor, chunk_size: int, cdtype: torch.dtype, need_w: bool,
                     cap: Optional[float] = None):
    """Backward of "none": per-token upstream gradient g [N] -> (d_hidden [N, D] in hidden's dtype,
    d_weight [V, D] fp32 or None), each chunk's logits recomputed from hidden (and soft-capped by `cap`)
    and the saved lses."""
    n = hidden.shape[0]
    with torch.autocast(hidden.device.type, enabled=False):
        ws = _Workspace.get(min(chunk_size, n), weight.shape[0], weight.shape[1], cdtype, hidden.device)
        h_c, w_c = hidden.to(cdtype), ws.weight(weight, cdtype)
        d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        d_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g = g.float()
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            y = labels[s:e]
            valid = y != IGNORE_INDEX
            safe_y = torch.where(valid, y, torch.zeros_like(y))
            cols = torch.arange(e - s, device=y.device)
            p_t = ws.logits_t(h_c[s:e], w_c)
            deriv = ws.softcap_t_(p_t, cap, True)
            p_t = p_t.sub_(lses[s:e]).exp_()  # softmax^T (s = 1)
            p_t[safe_y, cols] = p_t[safe_y, cols] - 1.0
            if deriv is not None:
                p_t.mul_(deriv)
            _chunk_grads(ws, p_t, g[s:e] * valid, h_c[s:e], w_c, d_hidden[s:e], d_weight, s == 0)
        if d_weight is not None and n == 0:
            d_weight.zero_()
        del ws
    return d_hidden, d_weight


class _LinearCrossEntropy(torch.autograd.Function):
    """The eager path: in backward the saved gradients are scaled in place (no new [V, D] tensor)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str,
                chunk_size: int, need_grad: bool, cdtype: torch.dtype, need_w: bool, cap: Optional[float]):
        out, lses, d_hidden, d_weight, n_valid = _forward_chunks(hidden, weight, labels, reduction, chunk_size,
                                                                 need_grad, cdtype, need_w, cap)
        grads_now = d_hidden is not None
        ctx.reduction, ctx.chunk_size, ctx.cdtype, ctx.grads_now = reduction, chunk_size, cdtype, grads_now
        ctx.cap = cap
        ctx.weight_dtype = weight.dtype
        ctx.fp16 = fp16_grads(reduction, cdtype)
        ctx.need_w = d_weight is not None if grads_now else bool(weight.requires_grad)
        if grads_now:
            ctx.save_for_backward(d_hidden, d_weight, n_valid)
        elif need_grad:
            ctx.save_for_backward(hidden, weight, labels, lses)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        nones = (None,) * 7  # (the non-tensor arguments')
        if ctx.grads_now:
            # the saved gradients are scaled in place (no second [V, D] buffer), so only once
            if getattr(ctx, "used", False):
                raise RuntimeError("linear_cross_entropy: backward twice (retain_graph) is not supported "
                                   "for 'mean'/'sum'; use reduction='none' and reduce outside")
            ctx.used = True
            d_hidden, d_weight, n_valid = ctx.saved_tensors
            if ctx.fp16:  # unscaled after the upstream (loss) scale, in fp32
                f = fp16_grad_factor(g, ctx.reduction, n_valid)
            else:
                # the usual upstream gradient is exactly 1 (loss.backward()): skip a pass over [V, D] then
                # (checked only on CPU, where reading the scalar costs no device sync)
                if g.device.type == "cpu" and g.item() == 1.0:
                    return d_hidden, d_weight.to(ctx.weight_dtype) if d_weight is not None else None, *nones
                f = g.float()
            d_w = scale_(d_weight, f).to(ctx.weight_dtype) if d_weight is not None else None  # in place
            return scale_(d_hidden, f), d_w, *nones
        hidden, weight, labels, lses = ctx.saved_tensors
        d_hidden, d_weight = _backward_chunks(g, hidden, weight, labels, lses, ctx.chunk_size, ctx.cdtype, ctx.need_w,
                                              ctx.cap)
        d_w = d_weight.to(ctx.weight_dtype) if d_weight is not None else None
        return d_hidden, d_w, *nones


# ------------------------------------------------------------------------------ the compiled path
# The same forward and backward as opaque custom ops: torch.compile(fullgraph=True) sees one node with a
# fake implementation and an autograd formula, and the chunk loop, its out= matmuls and the CPU buffer
# reuse run eagerly inside it (Dynamo could trace none of them without a graph break). `softcap` is the
# logits' soft-cap, 0.0 (the default) for none.
@torch.library.custom_op("myllm::chunked_linear_cross_entropy", mutates_args=())
def _chunked_lce_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str,
                    chunk_size: int, compute_dtype: torch.dtype, need_grad: bool, need_w: bool,
                    softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lses, d_hidden, d_weight) of `_forward_chunks`, each absent one as an empty ([0]) tensor;
    d_weight fp32."""
    out, lses, d_hidden, d_weight, _ = _forward_chunks(hidden, weight, labels, reduction, chunk_size, need_grad,
                                                       compute_dtype, need_w, softcap or None)
    f32 = torch.float32
    return (out, lses if lses is not None else hidden.new_empty(0, dtype=f32),
            d_hidden if d_hidden is not None else hidden.new_empty(0),
            d_weight if d_weight is not None else weight.new_empty(0, dtype=f32))


@_chunked_lce_op.register_fake
def _chunked_lce_fake(hidden, weight, labels, reduction, chunk_size, compute_dtype, need_grad, need_w, softcap=0.0):
    n = hidden.shape[0]
    f32 = torch.float32
    grads_now = need_grad and reduction != "none"
    return (hidden.new_empty((n,) if reduction == "none" else (), dtype=f32),
            hidden.new_empty((n,) if need_grad and reduction == "none" else (0,), dtype=f32),
            hidden.new_empty(hidden.shape if grads_now else (0,)),
            weight.new_empty(weight.shape if grads_now and need_w else (0,), dtype=f32))


@torch.library.custom_op("myllm::chunked_linear_cross_entropy_backward", mutates_args=())
def _chunked_lce_backward_op(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             lses: torch.Tensor, chunk_size: int, compute_dtype: torch.dtype, need_w: bool,
                             softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_hidden, d_weight fp32 or empty) of `_backward_chunks` (reduction "none"; softcap 0.0: none)."""
    d_hidden, d_weight = _backward_chunks(grad, hidden, weight, labels, lses, chunk_size, compute_dtype, need_w,
                                          softcap or None)
    return d_hidden, d_weight if d_weight is not None else weight.new_empty(0, dtype=torch.float32)


@_chunked_lce_backward_op.register_fake
def _chunked_lce_backward_fake(grad, hidden, weight, labels, lses, chunk_size, compute_dtype, need_w, softcap=0.0):
    return (hidden.new_empty(hidden.shape),
            weight.new_empty(weight.shape if need_w else (0,), dtype=torch.float32))


def _chunked_lce_setup(ctx, inputs, output):
    hidden, weight, labels, reduction, chunk_size, cdtype, need_grad, need_w, cap = inputs
    _, lses, d_hidden, d_weight = output
    ctx.mark_non_differentiable(lses, d_hidden, d_weight)
    ctx.set_materialize_grads(False)
    ctx.reduction, ctx.chunk_size, ctx.cdtype, ctx.cap = reduction, chunk_size, cdtype, cap
    ctx.need_w, ctx.weight_dtype, ctx.fp16 = need_w, weight.dtype, fp16_grads(reduction, cdtype)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, labels, lses)
    else:
        ctx.save_for_backward(d_hidden, d_weight, labels)


def _chunked_lce_backward(ctx, g, _g_lses, _g_dh, _g_dw):
    nones = (None,) * 7  # (the non-tensor arguments')
    if g is None:
        return None, None, *nones
    if ctx.reduction == "none":
        hidden, weight, labels, lses = ctx.saved_tensors
        d_h, d_w = torch.ops.myllm.chunked_linear_cross_entropy_backward(g, hidden, weight, labels, lses,
                                                                         ctx.chunk_size, ctx.cdtype, ctx.need_w,
                                                                         ctx.cap)
    else:  # out of place: the saved gradients stay valid for a second backward (retain_graph)
        d_hidden, d_w, labels = ctx.saved_tensors
        f = fp16_grad_factor(g, ctx.reduction, (labels != IGNORE_INDEX).sum()) if ctx.fp16 else g.float()
        d_h = scaled(d_hidden, f, d_hidden.dtype)
        d_w = d_w * f
    d_w = d_w.to(ctx.weight_dtype) if ctx.need_w else None
    return (d_h if ctx.needs_input_grad[0] else None), (d_w if ctx.needs_input_grad[1] else None), *nones


_chunked_lce_op.register_autograd(_chunked_lce_backward, setup_context=_chunked_lce_setup)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         reduction: str = "mean", chunk_size: int = 512,
                         softcap: Optional[float] = None) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `labels` without the full logits.

    hidden [..., D], weight [V, D], labels [...] (already shifted; IGNORE_INDEX = -100 skipped).
    reduction: "mean" over non-ignored tokens (0 if there are none), "sum", or "none" -> loss with the
    shape of `labels`, 0 at ignored positions. softcap: the logits are cap * tanh(logits / cap) (Gemma
    2's final_softcap; None: not capped). Eagerly an autograd.Function; under torch.compile the custom
    op `myllm::chunked_linear_cross_entropy` (no graph break, the same numbers).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    cap = cap_value(softcap)
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    cdtype = compute_dtype(hidden)
    if torch.compiler.is_compiling():
        out = torch.ops.myllm.chunked_linear_cross_entropy(h, weight, y, reduction, int(chunk_size), cdtype,
                                                           need_grad, bool(weight.requires_grad), cap or 0.0)[0]
    else:
        out = _LinearCrossEntropy.apply(h, weight, y, reduction, int(chunk_size), need_grad, cdtype,
                                        bool(weight.requires_grad), cap)
    return out.reshape(shape) if reduction == "none" else out


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str,
                 cfg) -> torch.Tensor:
    """The model's loss head: the implementation `cfg` (a ModelConfig) and the device select
    (model/kernels.py `choose`): the Triton linear+CE custom op, the chunked autograd Function, or the
    full-logits reference; a weight sharded on the vocabulary (a DTensor: tensor parallelism) takes the
    vocabulary-parallel chunked loss (model/vocab_parallel_loss.py), which never gathers the logits.
    `cfg.final_softcap` (absent or None: none) soft-caps the logits in each; the Triton op has no cap, so a
    capped model takes the chunked path instead."""
    cap = getattr(cfg, "final_softcap", None)
    if _is_dtensor(weight):
        from model.vocab_parallel_loss import vocab_parallel_lm_head_loss
        return vocab_parallel_lm_head_loss(hidden, weight, labels, reduction, cfg.loss_chunk_size, softcap=cap)
    if not cfg.fused_cross_entropy:
        return linear_cross_entropy_ref(hidden, weight, labels, reduction, softcap=cap)
    impl = choose("cross_entropy", hidden, cfg.kernel_backend)
    if impl == "reference":  # auto, compiled on CUDA: the full logits while they fit (model/kernels.py)
        if hidden.numel() // hidden.shape[-1] * weight.shape[0] * 4 <= REFERENCE_LOSS_MAX_LOGITS_BYTES:
            return linear_cross_entropy_ref(hidden, weight, labels, reduction, softcap=cap)
        impl = "triton"
    if impl == "triton" and cap is None:
        # on a GPU the op sizes its chunks from (tokens, vocab, dim) (auto_chunk_size); loss_chunk_size is
        # the CPU path's knob (and the interpreter's, where small chunks keep the tests fast)
        chunk = None if hidden.is_cuda else cfg.loss_chunk_size
        return load_triton("triton_loss").linear_cross_entropy_triton(hidden, weight, labels, reduction, chunk)
    return linear_cross_entropy(hidden, weight, labels, reduction, cfg.loss_chunk_size, softcap=cap)


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             reduction: str = "mean", softcap: Optional[float] = None) -> torch.Tensor:
    """Reference: full logits in fp32 (soft-capped by `softcap`, None: not) + F.cross_entropy (what HF
    Llama / Gemma 2 do)."""
    logits = softcap_logits(F.linear(hidden, weight).float(), softcap)
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
