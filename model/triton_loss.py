"""Fused linear + cross-entropy as a torch.library custom op with a Triton softmax kernel.

Owns: `linear_cross_entropy_triton(hidden, weight, labels, reduction, chunk_size, z_loss)`, the ops
`myllm::linear_cross_entropy` / `myllm::linear_cross_entropy_backward` behind it, and the Triton
kernel `_ce_chunk_kernel`. The pure-PyTorch reference it must agree with is
`model.loss.linear_cross_entropy_ref`.

How (the design of Liger-Kernel's fused linear cross-entropy, our own code): tokens are processed
`chunk_size` at a time. Per chunk the logits come from one plain matmul (cuBLAS on a GPU) into a
reused [c, V] buffer in the compute dtype; the Triton kernel, one program per token row, runs an
online softmax over the row in BLOCK_V tiles (running max and sum, in fp32), writes the loss and the
logsumexp, then overwrites the row with its gradient (softmax * (1 + 2 z lse) - onehot) * scale.
The next two matmuls turn that buffer into d hidden (grad @ W) and d weight (+= grad^T @ h, fp32
accumulator). The [tokens x vocab] logits never exist at once.

Gradients: for "mean"/"sum" the upstream gradient is a scalar, so both gradients are computed in the
forward pass while each chunk's logits are live and returned as extra (non-differentiable) outputs
of the op; backward only multiplies them by the upstream scalar (in fp16 they are formed at a fixed
scale, not at 1/n_valid, which underflowed fp16, and unscaled there, after the loss scale). d weight
accumulates over the chunks in fp32 and is rounded once. For "none" the upstream gradient is
per token: forward saves hidden and the per-token logsumexp, and backward (the second op) recomputes
each chunk's logits; the kernel then writes (softmax - onehot) * g_token in place.

Why a custom op: `torch.compile(fullgraph=True)` sees one opaque node (with a fake implementation
for shapes and a registered autograd formula) instead of a graph break, so the rest of the model
stays compiled. The autocast dtype is read outside the op (autocast state is not reliably visible
inside a custom op) and passed in as a string; inside, autocast is switched off and every matmul
runs explicitly in that dtype.

Must never: materialise the logits of all tokens at once, import triton with a hard failure (the
module imports without it; `supported()` says whether the op can run), or turn an all-ignored batch
into NaN ("mean" over zero target tokens is 0). A label outside [0, V) that is not IGNORE_INDEX gives
a NaN loss (and NaN gradients) instead of reading out of bounds or being silently skipped.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from model.loss_precision import FP16_GRAD_SCALE, accumulate_fp32_, fp16_grad_factor, fp16_grads, scaled
from utils.constants import IGNORE_INDEX

try:  # optional accelerator: the module must import without it
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:  # ImportError, or a broken install failing at import
    triton = None
    tl = None
    TRITON_AVAILABLE = False

__all__ = ["TRITON_AVAILABLE", "supported", "linear_cross_entropy_triton", "auto_chunk_size", "MAX_BLOCK_V"]

# Largest vocab tile one kernel program holds at a time. Tests lower it to exercise several tiles
# with a masked tail on a small vocab.
MAX_BLOCK_V = 16384

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REDUCTIONS = ("mean", "sum", "none")


def supported(t: torch.Tensor) -> bool:
    """Can the Triton op run on tensors living where `t` lives?"""
    if not TRITON_AVAILABLE:
        return False
    if t.is_cuda:
        return True
    # triton.jit picks the interpreter when it decorates the kernel (at this module's import): the
    # variable must have been set then, not only now
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _INTERPRETED


# ------------------------------------------------------------------------------------------ kernel
if TRITON_AVAILABLE:

    @triton.jit
    def _ce_chunk_kernel(logits_ptr, logits_stride, labels_ptr, scale_ptr, scale_stride,
                         loss_ptr, lse_ptr, n_cols, ignore_index, z_loss,
                         LSE_IN: tl.constexpr, WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
                         BLOCK_V: tl.constexpr):
        """One program per token row of a chunk of logits [rows, n_cols].

        LSE_IN: read the row's logsumexp from lse_ptr (backward of "none"); else compute it with an
        online softmax and store it. WRITE_LOSS: store lse - x[y] + z_loss * lse^2 (0 if ignored).
        WRITE_GRAD: overwrite the row with (softmax * (1 + 2 z_loss lse) - onehot) * scale, scale read
        at scale_ptr + row * scale_stride (stride 0: one scalar for all rows), 0 for ignored rows.
        """
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * logits_stride
        y = tl.load(labels_ptr + row).to(tl.int64)
        valid = y != ignore_index
        in_range = (y >= 0) & (y < n_cols)
        bad = valid & ((y < 0) | (y >= n_cols))  # neither a class nor ignored: NaN, not an OOB read
        safe_y = tl.where(in_range, y, 0)

        # softmax = exp((x - shift) - log_s) with shift = max and log_s = log(sum exp(x - max)) kept apart:
        # lse = shift + log_s rounds at the logits' magnitude (an fp32 ulp at 16 is 2e-6): for confident
        # tokens (p - 1 ~ 1e-6) that was 4x the reference's error in the gradient
        if LSE_IN:
            lse = tl.load(lse_ptr + row).to(tl.float32)
            shift = lse
            log_s = 0.0
        else:
            m = float("-inf")
            s = 0.0
            for off in range(0, n_cols, BLOCK_V):
                cols = off + tl.arange(0, BLOCK_V)
                x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
                m = m_new
            shift = m
            log_s = tl.log(s)
            lse = m + log_s
            tl.store(lse_ptr + row, lse)

        if WRITE_LOSS:
            # read the target logit before the row is overwritten with its gradient
            x_y = tl.load(row_ptr + safe_y).to(tl.float32)
            loss = (shift - x_y) + log_s + z_loss * lse * lse
            loss = tl.where(valid, loss, 0.0)
            loss = tl.where(bad, float("nan"), loss)
            tl.store(loss_ptr + row, loss)

        if WRITE_GRAD:
            scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
            scale = tl.where(valid, scale, 0.0)  # also kills a non-finite upstream grad at ignored rows
            scale = tl.where(bad, float("nan"), scale)
            coef = scale * (1.0 + 2.0 * z_loss * lse)  # d(z lse^2)/dx = 2 z lse softmax
            for off in range(0, n_cols, BLOCK_V):
                cols = off + tl.arange(0, BLOCK_V)
                mask = cols < n_cols
                x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp((x - shift) - log_s) * coef - tl.where(cols == safe_y, scale, 0.0)
                tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


_INTERPRETED = TRITON_AVAILABLE and not isinstance(_ce_chunk_kernel, triton.runtime.jit.JITFunction)


def _num_warps_for(block_v: int) -> int:
    """Warps per program for a vocab tile of block_v elements (at most 32 fp32 values per thread)."""
    return 16 if block_v >= 8192 else (8 if block_v >= 2048 else 4)


def _launch(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, scale_stride: int,
            loss: torch.Tensor, lse: torch.Tensor, z_loss: float, *, lse_in: bool, write_loss: bool,
            write_grad: bool) -> None:
    rows, n_cols = logits.shape
    if rows == 0:
        return
    block = min(MAX_BLOCK_V, triton.next_power_of_2(n_cols))
    num_warps = _num_warps_for(block)
    # Triton launches on the current CUDA device: make it the tensors' one (a rank's second GPU)
    guard = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
    with guard:
        _ce_chunk_kernel[(rows,)](
            logits, logits.stride(0), labels, scale, scale_stride, loss, lse, n_cols, IGNORE_INDEX,
            float(z_loss), LSE_IN=lse_in, WRITE_LOSS=write_loss, WRITE_GRAD=write_grad, BLOCK_V=block,
            num_warps=num_warps)


# ----------------------------------------------------------------------------------- chunk helpers
def _chunk_grads(g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, d_hidden: Optional[torch.Tensor],
                 d_weight: Optional[torch.Tensor], first: bool) -> None:
    """d_hidden = g @ w (written into the given slice) and d_weight (+)= g^T @ h for one chunk.

    g [c, V], h [c, D], w [V, D] all in the compute dtype; d_weight is fp32 and accumulates in fp32
    (`accumulate_fp32_`: one GEMM with an fp32 output on a GPU; no per-chunk product rounded to the
    compute dtype, no [V, D] temporary)."""
    if d_hidden is not None:
        if d_hidden.dtype == g.dtype:
            torch.mm(g, w, out=d_hidden)
        else:
            d_hidden.copy_(torch.mm(g, w))
    if d_weight is not None:
        accumulate_fp32_(d_weight, g.t(), h, first)


def _empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


# --------------------------------------------------------------------------------------- the ops
@torch.library.custom_op("myllm::linear_cross_entropy", mutates_args=())
def _lce_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str,
            chunk_size: int, z_loss: float, compute_dtype: str, need_d_hidden: bool,
            need_d_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, D], weight [V, D], labels [N] -> (loss, lse [N] fp32, d_hidden, d_weight).

    loss: fp32 scalar ("mean"/"sum") or [N] ("none"). For "mean"/"sum" d_hidden [N, D]
    (hidden.dtype) and d_weight [V, D] (weight.dtype, accumulated in fp32) are the gradients for an
    upstream gradient of 1, each empty ([0]) when not asked for; for "none" both are empty. In fp16
    they are the gradients of the sum times FP16_GRAD_SCALE instead (d_weight in fp32; see
    `model.loss_precision.fp16_grads`): formed at 1/n_valid they underflowed fp16 before the loss scale reached
    them. The autograd formula unscales them.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    cdtype = _DTYPES[compute_dtype]
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    f32 = torch.float32
    grads_now = reduction != "none" and (need_d_hidden or need_d_weight)
    with torch.autocast(dev.type, enabled=False):
        labels = labels.contiguous()
        h_c = hidden.to(cdtype).contiguous()
        w_c = weight.to(cdtype).contiguous()  # one cast per call, not one per chunk
        losses = torch.empty(n, dtype=f32, device=dev)
        lse = torch.empty(n, dtype=f32, device=dev)
        n_valid = (labels != IGNORE_INDEX).sum()
        # the per-token gradient factor stays on the device: no sync on the target count. fp16 forms the
        # gradients at FP16_GRAD_SCALE, not at 1/n_valid (which underflowed fp16): backward unscales
        if fp16_grads(reduction, cdtype):
            scale = torch.full((1,), FP16_GRAD_SCALE, dtype=f32, device=dev)
        elif reduction == "mean":
            scale = (1.0 / n_valid.clamp(min=1).to(f32)).reshape(1)
        else:
            scale = torch.ones(1, dtype=f32, device=dev)
        d_hidden = torch.empty(n, d, dtype=hidden.dtype, device=dev) if grads_now and need_d_hidden else None
        d_weight = torch.empty(v, d, dtype=f32, device=dev) if grads_now and need_d_weight else None
        c = max(1, min(int(chunk_size), n))
        buf = torch.empty(c, v, dtype=cdtype, device=dev)  # the only logits that ever exist
        for s in range(0, n, c):
            e = min(s + c, n)
            logits = buf[: e - s]
            torch.mm(h_c[s:e], w_c.t(), out=logits)
            _launch(logits, labels[s:e], scale, 0, losses[s:e], lse[s:e], z_loss,
                    lse_in=False, write_loss=True, write_grad=grads_now)
            if grads_now:
                _chunk_grads(logits, h_c[s:e], w_c, d_hidden[s:e] if d_hidden is not None else None,
                             d_weight, first=s == 0)
        del buf
        if reduction == "none":
            loss = losses
        elif reduction == "sum":
            loss = losses.sum()
        else:
            loss = losses.sum() / n_valid.clamp(min=1)
        if d_weight is not None and n == 0:
            d_weight.zero_()
        d_hidden = d_hidden if d_hidden is not None else _empty(hidden, hidden.dtype)
        dw_dtype = _d_weight_dtype(reduction, cdtype, weight.dtype)
        d_weight = d_weight.to(dw_dtype) if d_weight is not None else _empty(weight, dw_dtype)
    return loss, lse, d_hidden, d_weight


def _d_weight_dtype(reduction: str, cdtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the op's d_weight output: the weight's, except in fp16 where it is scaled
    (`model.loss_precision.fp16_grads`: of the sum, times FP16_GRAD_SCALE, could overflow an fp16 weight) and kept
    in fp32 until backward has unscaled it."""
    return torch.float32 if fp16_grads(reduction, cdtype) else weight_dtype


@_lce_op.register_fake
def _lce_fake(hidden, weight, labels, reduction, chunk_size, z_loss, compute_dtype, need_d_hidden,
              need_d_weight):
    n = hidden.shape[0]
    f32 = torch.float32
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=f32)
    lse = hidden.new_empty((n,), dtype=f32)
    grads_now = reduction != "none" and (need_d_hidden or need_d_weight)
    d_hidden = hidden.new_empty(hidden.shape if grads_now and need_d_hidden else (0,))
    dw_dtype = _d_weight_dtype(reduction, _DTYPES[compute_dtype], weight.dtype)
    d_weight = weight.new_empty(weight.shape if grads_now and need_d_weight else (0,), dtype=dw_dtype)
    return loss, lse, d_hidden, d_weight


@torch.library.custom_op("myllm::linear_cross_entropy_backward", mutates_args=())
def _lce_backward_op(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                     labels: torch.Tensor, lse: torch.Tensor, chunk_size: int, z_loss: float,
                     compute_dtype: str, need_d_hidden: bool,
                     need_d_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of reduction "none": per-token upstream grad [N] -> (d_hidden, d_weight), each empty
    ([0]) when not asked for. Recomputes each chunk's logits from hidden and the saved lse."""
    cdtype = _DTYPES[compute_dtype]
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    f32 = torch.float32
    with torch.autocast(dev.type, enabled=False):
        g = grad.to(f32).contiguous()
        labels = labels.contiguous()
        lse = lse.to(f32).contiguous()
        h_c = hidden.to(cdtype).contiguous()
        w_c = weight.to(cdtype).contiguous()
        d_hidden = torch.empty(n, d, dtype=hidden.dtype, device=dev) if need_d_hidden else None
        d_weight = torch.empty(v, d, dtype=f32, device=dev) if need_d_weight else None
        if need_d_hidden or need_d_weight:
            c = max(1, min(int(chunk_size), n))
            buf = torch.empty(c, v, dtype=cdtype, device=dev)
            for s in range(0, n, c):
                e = min(s + c, n)
                logits = buf[: e - s]
                torch.mm(h_c[s:e], w_c.t(), out=logits)
                _launch(logits, labels[s:e], g[s:e], 1, lse[s:e], lse[s:e], z_loss,
                        lse_in=True, write_loss=False, write_grad=True)
                _chunk_grads(logits, h_c[s:e], w_c, d_hidden[s:e] if d_hidden is not None else None,
                             d_weight, first=s == 0)
            del buf
        if d_weight is not None and n == 0:
            d_weight.zero_()
        d_hidden = d_hidden if d_hidden is not None else _empty(hidden, hidden.dtype)
        d_weight = d_weight.to(weight.dtype) if d_weight is not None else _empty(weight, weight.dtype)
    return d_hidden, d_weight


@_lce_backward_op.register_fake
def _lce_backward_fake(grad, hidden, weight, labels, lse, chunk_size, z_loss, compute_dtype,
                       need_d_hidden, need_d_weight):
    d_hidden = hidden.new_empty(hidden.shape if need_d_hidden else (0,))
    d_weight = weight.new_empty(weight.shape if need_d_weight else (0,))
    return d_hidden, d_weight


def _lce_setup_context(ctx, inputs, output):
    hidden, weight, labels, reduction, chunk_size, z_loss, compute_dtype, need_dh, need_dw = inputs
    loss, lse, d_hidden, d_weight = output
    # lse and the precomputed gradients are side outputs: no gradient flows into them, and with
    # materialisation off autograd does not build [N, D] / [V, D] zero tensors for them in backward
    ctx.mark_non_differentiable(lse, d_hidden, d_weight)
    ctx.set_materialize_grads(False)
    ctx.reduction, ctx.chunk_size, ctx.z_loss = reduction, chunk_size, z_loss
    ctx.compute_dtype, ctx.need_dh, ctx.need_dw = compute_dtype, need_dh, need_dw
    ctx.fp16, ctx.weight_dtype = fp16_grads(reduction, _DTYPES[compute_dtype]), weight.dtype
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, labels, lse)
    else:
        ctx.save_for_backward(d_hidden, d_weight, labels)


def _lce_backward(ctx, grad_loss, grad_lse, grad_dh, grad_dw):
    n_inputs = 9
    if grad_loss is None:
        return (None,) * n_inputs
    # a gradient is returned only where the forward was told it is needed (need_* decided outside
    # the op from requires_grad and grad mode)
    if ctx.reduction == "none":
        hidden, weight, labels, lse = ctx.saved_tensors
        d_h, d_w = torch.ops.myllm.linear_cross_entropy_backward(
            grad_loss, hidden, weight, labels, lse, ctx.chunk_size, ctx.z_loss, ctx.compute_dtype,
            ctx.need_dh, ctx.need_dw)
    else:
        d_hidden, d_weight, labels = ctx.saved_tensors
        # fp16: the saved gradients are scaled (`model.loss_precision.fp16_grads`); unscaled after the upstream
        # (loss) scale. Products in fp32: in fp16 a loss scale of 65536 is inf. Out of place: the saved
        # gradients stay valid for a second backward (retain_graph)
        f = (fp16_grad_factor(grad_loss, ctx.reduction, (labels != IGNORE_INDEX).sum()) if ctx.fp16
             else grad_loss.float())
        d_h = scaled(d_hidden, f, d_hidden.dtype) if ctx.need_dh else None
        d_w = scaled(d_weight, f, ctx.weight_dtype) if ctx.need_dw else None
    return (d_h if ctx.need_dh else None, d_w if ctx.need_dw else None) + (None,) * (n_inputs - 2)


_lce_op.register_autograd(_lce_backward, setup_context=_lce_setup_context)


# ------------------------------------------------------------------------------------- public API
def _compute_dtype_name(hidden: torch.Tensor, weight: torch.Tensor) -> str:
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise TypeError(f"linear_cross_entropy_triton: unsupported compute dtype {dtype}")


# the fp32 logits of one chunk ([V, c]) may take this much; the chunk loop reads and writes the fp32 [V, D]
# weight-gradient accumulator once per chunk, so fewer, larger chunks move less memory
LOSS_CHUNK_BUDGET_BYTES = 512 * 2 ** 20


def auto_chunk_size(n_tokens: int, vocab: int, dim: int) -> int:
    """Tokens per chunk: the most whose fp32 logits fit LOSS_CHUNK_BUDGET_BYTES, a power of two in
    [1024, 16384]. Why a memory budget and not Liger's N / ceil(V / D) (which gave 1,024 at 124M and 1B):
    each chunk re-reads and rewrites the fp32 weight-gradient accumulator (V x D x 8 bytes: 196 MB at
    124M, 524 MB at 1B), which at 1,024 tokens moved more bytes per chunk than the chunk's matmul took
    time (3-4 GB per step at those sizes, H100 report of edf4898). `dim` is kept for callers: the
    accumulator's size does not change how many chunks fit the budget."""
    del n_tokens, dim  # the op allocates min(chunk, tokens)
    c = max(1, LOSS_CHUNK_BUDGET_BYTES // (4 * max(1, vocab)))
    return int(min(16384, max(1024, 1 << (c.bit_length() - 1))))


def linear_cross_entropy_triton(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                reduction: str = "mean", chunk_size: Optional[int] = 4096,
                                z_loss: float = 0.0) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `labels` without the full logits.

    hidden [..., D], weight [V, D], labels [...] (already shifted; IGNORE_INDEX = -100 skipped).
    reduction: "mean" over non-ignored tokens (0 if there are none), "sum", or "none" -> fp32 loss
    with the shape of `labels`, 0 at ignored positions. z_loss > 0 adds z_loss * logsumexp^2 per
    non-ignored token (PaLM's z-loss), gradient included. chunk_size: tokens per chunk of logits
    (None: `auto_chunk_size`). Under autocast the matmuls run in the autocast dtype, else in the
    inputs' dtype; softmax statistics, the loss and the weight-gradient accumulation are fp32.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not TRITON_AVAILABLE:
        raise RuntimeError("linear_cross_entropy_triton needs triton; use model.loss.linear_cross_entropy")
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but labels has {y.shape[0]}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"weight must be [V, {h.shape[1]}], got {tuple(weight.shape)}")
    grad_on = torch.is_grad_enabled()
    need_dh = bool(grad_on and hidden.requires_grad)
    need_dw = bool(grad_on and weight.requires_grad)
    if chunk_size is None:
        chunk_size = auto_chunk_size(h.shape[0], weight.shape[0], weight.shape[1])
    loss, _, _, _ = torch.ops.myllm.linear_cross_entropy(
        h, weight, y, reduction, int(chunk_size), float(z_loss), _compute_dtype_name(hidden, weight),
        need_dh, need_dw)
    return loss.reshape(shape) if reduction == "none" else loss
