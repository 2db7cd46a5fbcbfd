"""Triton RMSNorm and add+RMSNorm, forward and backward, as `myllm::rms_norm`, `myllm::add_rms_norm` and
`myllm::rms_norm_backward` (model/triton_ops.py registers them), and their public wrappers `rms_norm`, `add_rms_norm`.
The math follows model/kernels.py's rms_norm_ref; every kernel loads and stores in the tensors' dtype and computes
in fp32. Must never create parameters or decide whether the kernel is worth using (model/kernels.py dispatches).
"""
from __future__ import annotations

from typing import Optional

import torch

from model.triton_ops import (TRITON_AVAILABLE, as_rows, backward_op, call_op, check_rows, define_op, launch,
                              num_warps, register_autograd, require_triton)

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

# RMSNorm backward: a tile of BLOCK_ROWS rows x the padded row, at most _BWD_TILE elements (4 rows of 1024;
# 8 rows at 16 warps spilled at 128 registers a thread: scripts/check_triton_cuda.py),
# and up to _BWD_PROGRAMS_PER_SM programs per SM (their fp32 dw partials are summed by one small reduction)
_BWD_TILE = 4096
_BWD_PROGRAMS_PER_SM = 4


def _bwd_block_rows(block: int) -> int:
    return max(1, min(16, _BWD_TILE // block))


def _num_sms(device: torch.device) -> int:
    """How many programs the reduction kernels (RMSNorm backward) use: enough to fill the GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter runs programs one after the other: few programs, long loops


if TRITON_AVAILABLE:
    @triton.jit
    def _rms_norm_fwd_kernel(X, R, W, Y, H, RSTD, x_stride, r_stride, y_stride, h_stride, D, eps,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """One row per program. With HAS_RESIDUAL: h = x + r (one fp32 add rounded to H's dtype, the
        promotion of x's and r's, stored to H); without, h = x (H is X). Then y = w * (h * rstd) with
        h * rstd rounded to h's dtype first (as the reference), stored in Y's dtype; RSTD gets 1/rms
        in fp32 for the backward."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + row * r_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
            tl.store(H + row * h_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
        tl.store(RSTD + row, rstd)
        xhat = (xf * rstd).to(H.dtype.element_ty)  # the reference rounds before scaling
        w = tl.load(W + cols, mask=mask, other=0.0)
        y = w.to(tl.float32) * xhat.to(tl.float32)
        tl.store(Y + row * y_stride + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_bwd_kernel(G, GH, X, W, RSTD, DX, DW, g_stride, gh_stride, x_stride, dx_stride,
                             n_rows, D, rows_per_program,
                             HAS_GH: tl.constexpr, BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr):
        """Program p handles rows [p*rows_per_program, (p+1)*rows_per_program), BLOCK_ROWS rows at a time
        as one 2-D tile (several rows' loads in flight per iteration, not one row's reduction after
        another: the one-row loop ran at ~0.66 TB/s on an H100); dx of each row, and its partial sum of
        dw (fp32) written to DW[p]. With HAS_GH, GH (the gradient of h = x + residual) is added to dx."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols < D
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_ROWS, BLOCK], dtype=tl.float32)
        start = pid.to(tl.int64) * rows_per_program  # int64 row indices: no overflow of row * stride
        end = tl.minimum(start + rows_per_program, n_rows)
        for first in range(start, end, BLOCK_ROWS):
            rows = first + tl.arange(0, BLOCK_ROWS)
            rmask = rows < end
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(X + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
            g = tl.load(G + rows[:, None] * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            xhat = x.to(tl.float32) * rstd[:, None]
            gw = g * w[None, :]
            # d/dx of x * rstd(x): rstd * (gw - xhat * mean(gw * xhat)), per row
            dx = rstd[:, None] * (gw - xhat * (tl.sum(gw * xhat, axis=1) / D)[:, None])
            if HAS_GH:
                dx += tl.load(GH + rows[:, None] * gh_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows[:, None] * dx_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            # the reference multiplies g by the xhat rounded to x's dtype (rows past the end add zeros)
            dw += g * xhat.to(X.dtype.element_ty).to(tl.float32)
        tl.store(DW + pid * D + cols, tl.sum(dw, axis=0), mask=cmask)


    def _h_dtype(x, residual) -> torch.dtype:
        """The dtype of h = x + residual: torch's promotion (an fp32 residual stream stays fp32)."""
        return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)

    def _y_dtype(x, residual, weight, out_dtype) -> torch.dtype:
        """The norm's output dtype: out_dtype when given, else the reference's weight * h promotion."""
        return out_dtype if out_dtype is not None else torch.promote_types(_h_dtype(x, residual), weight.dtype)

    def _rms_norm_fake(x, residual, weight, eps, out_dtype=None):
        y = x.new_empty(x.shape, dtype=_y_dtype(x, residual, weight, out_dtype))
        rstd = x.new_empty(x.shape[:-1].numel(), dtype=torch.float32)
        return y, rstd

    def _rms_norm_fwd(x, residual, weight, eps, out_dtype):
        D = x.shape[-1]
        x2 = as_rows(x)
        n = x2.shape[0]
        y = torch.empty((n, D), dtype=_y_dtype(x, residual, weight, out_dtype), device=x.device)
        rstd = torch.empty((n,), dtype=torch.float32, device=x.device)
        h = torch.empty((n, D), dtype=_h_dtype(x, residual), device=x.device) if residual is not None else x2
        r2 = as_rows(residual) if residual is not None else x2
        BLOCK = triton.next_power_of_2(D)
        launch(_rms_norm_fwd_kernel)[(n,)](
            x2, r2, weight.contiguous(), y, h, rstd, x2.stride(0), r2.stride(0), y.stride(0), h.stride(0),
            D, eps, HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps(BLOCK))
        return y.view(x.shape), h.view(x.shape), rstd

    @define_op("rms_norm", fake=lambda x, weight, eps, out_dtype=None: _rms_norm_fake(x, None, weight, eps, out_dtype))
    def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, rstd): y = rms_norm_ref(x, weight, eps) (stored in out_dtype when given); rstd [rows]
        fp32 is kept for the backward."""
        y, _, rstd = _rms_norm_fwd(x, None, weight, eps, out_dtype)
        return y, rstd

    def _add_rms_norm_fake(x, residual, weight, eps, out_dtype=None):
        y, rstd = _rms_norm_fake(x, residual, weight, eps, out_dtype)
        return y, x.new_empty(x.shape, dtype=_h_dtype(x, residual)), rstd

    @define_op("add_rms_norm", fake=_add_rms_norm_fake)
    def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y, h, rstd) with h = x + residual (torch's dtype promotion) and y = rms_norm_ref(h, weight, eps)."""
        return _rms_norm_fwd(x, residual, weight, eps, out_dtype)

    def _rms_norm_bwd_fake(g, gh, x, weight, rstd):
        return x.new_empty(x.shape), weight.new_empty(weight.shape)

    @define_op("rms_norm_backward", fake=_rms_norm_bwd_fake)
    def _rms_norm_bwd_op(g: torch.Tensor, gh: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx, dweight) of y = rms_norm(x); gh, when given, is a gradient arriving at x directly
        (the h output of add_rms_norm) and is added to dx. dx has x's dtype, dweight weight's."""
        D = x.shape[-1]
        x2, g2 = as_rows(x), as_rows(g)
        n = x2.shape[0]
        gh2 = as_rows(gh) if gh is not None else g2
        dx = torch.empty((n, D), dtype=x.dtype, device=x.device)
        BLOCK = triton.next_power_of_2(D)
        block_rows = _bwd_block_rows(BLOCK)
        # enough programs to keep every SM busy with several tiles in flight, each looping over whole tiles
        programs = max(1, min(triton.cdiv(n, block_rows), _BWD_PROGRAMS_PER_SM * _num_sms(x.device)))
        rows_per_program = triton.cdiv(triton.cdiv(n, programs), block_rows) * block_rows
        programs = max(1, triton.cdiv(n, rows_per_program))
        dw_partial = torch.empty((programs, D), dtype=torch.float32, device=x.device)
        launch(_rms_norm_bwd_kernel)[(programs,)](
            g2, gh2, x2, weight.contiguous(), rstd, dx, dw_partial, g2.stride(0), gh2.stride(0),
            x2.stride(0), dx.stride(0), n, D, rows_per_program,
            HAS_GH=gh is not None, BLOCK=BLOCK, BLOCK_ROWS=block_rows,
            num_warps=num_warps(BLOCK * block_rows))
        return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)

    def _rms_norm_setup(ctx, inputs, output):
        x, weight = inputs[:2]
        ctx.save_for_backward(x, weight, output[1])

    def _rms_norm_backward(ctx, g, _g_rstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = backward_op(ctx, "rms_norm_backward")(g, None, x, weight, rstd)
        return dx, dw, None, None

    register_autograd(_rms_norm_op, "rms_norm", _rms_norm_backward, _rms_norm_setup)

    def _add_rms_norm_setup(ctx, inputs, output):
        x, residual, weight = inputs[:3]
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        ctx.save_for_backward(output[1], weight, output[2])

    def _add_rms_norm_backward(ctx, g, gh, _g_rstd):
        h, weight, rstd = ctx.saved_tensors
        if g is None:
            g = torch.zeros_like(h)
        dh, dw = backward_op(ctx, "rms_norm_backward")(g, gh, h, weight, rstd)  # dh in h's dtype
        return dh.to(ctx.x_dtype), dh.to(ctx.residual_dtype), dw, None, None

    register_autograd(_add_rms_norm_op, "add_rms_norm", _add_rms_norm_backward, _add_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Triton RMSNorm with rms_norm_ref's math: normalise in fp32, round to x's dtype, scale by weight.
    Output dtype: torch.result_type(x, weight) as the reference, or `out_dtype` when given: the
    reference's output cast to out_dtype, rounded once (under autocast the next matmul would cast the
    fp32 output to the autocast dtype anyway; storing that dtype directly saves the round trip)."""
    require_triton()
    check_rows("rms_norm", x, weight)
    return call_op("rms_norm", x, weight, float(eps), out_dtype)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h), h) with h = x + residual in torch's promoted dtype (a bf16 branch output added to
    an fp32 residual stream stays fp32), one launch forward, one backward. out_dtype: as `rms_norm`."""
    require_triton()
    check_rows("add_rms_norm", x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    y, h, _ = call_op("add_rms_norm", x, residual, weight, float(eps), out_dtype)
    return y, h
