"""Triton SwiGLU, silu(gate) * up, forward and backward (silu recomputed), on separate gate / up tensors and on the
packed gate_up [..., 2H] output of the fused gate/up matmul, as `myllm::swiglu*` ops (model/triton_ops.py registers
them), and the public wrappers `swiglu`, `swiglu_packed`. Follows model/kernels.py's swiglu_ref; computes in fp32.
"""
from __future__ import annotations


import torch

from model.triton_ops import (TRITON_AVAILABLE, as_rows, backward_op, call_op, define_op, launch, raw_body,
                              register_autograd, require_triton)

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl


if TRITON_AVAILABLE:
    @triton.jit
    def _swiglu_fwd_kernel(GATE, UP, Y, n_cols, g_stride, u_stride, y_stride, BLOCK: tl.constexpr):
        """Program (row, column block). Rows are read through their strides: gate and up are usually
        the two halves of one [rows, 2 * hidden] matmul output (row stride 2 * hidden), read in place."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(GATE + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(UP + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
        silu = g * tl.sigmoid(g)
        tl.store(Y + row * y_stride + cols, (silu * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(DY, GATE, UP, DGATE, DUP, n_cols, dy_stride, g_stride, u_stride, dg_stride, du_stride,
                           BLOCK: tl.constexpr):
        """silu is recomputed from gate: d gate = dy * up * sig * (1 + g * (1 - sig)), d up = dy * silu.
        Every operand is read or written through its row stride (no copy of a strided gate/up)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dy = tl.load(DY + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(GATE + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(UP + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        tl.store(DGATE + row * dg_stride + cols, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DGATE.dtype.element_ty),
                 mask=mask)
        tl.store(DUP + row * du_stride + cols, (dy * silu).to(DUP.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_packed_bwd_kernel(DY, GU, DGU, n_cols, dy_stride, gu_stride, dgu_stride, BLOCK: tl.constexpr):
        """_swiglu_bwd_kernel on the packed layout: row r of GU is [gate | up] (2 * n_cols), and d gate / d up
        are written to the two halves of the same row of DGU (one tensor: no views of an output are handed
        to the kernel, which torch.compile's functionalization of a triton_op would have to follow)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dy = tl.load(DY + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(GU + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * gu_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        dst = DGU + row * dgu_stride + cols
        tl.store(dst, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DGU.dtype.element_ty), mask=mask)
        tl.store(dst + n_cols, (dy * silu).to(DGU.dtype.element_ty), mask=mask)

    _SWIGLU_BLOCK = 1024  # columns per program (a row of the 124M/1B MLP is 2048/5632 wide)

    def _swiglu_block(n_cols: int) -> int:
        return min(_SWIGLU_BLOCK, triton.next_power_of_2(max(1, n_cols)))

    @define_op("swiglu", fake=lambda gate, up: gate.new_empty(gate.shape))
    def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, computed in fp32, stored in gate's dtype (a new contiguous tensor). gate and up
        may be strided views (the halves of one matmul output): the kernel reads them in place."""
        H = gate.shape[-1]
        g2, u2 = as_rows(gate), as_rows(up)
        rows = g2.shape[0]
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        if rows and H:
            block = _swiglu_block(H)
            launch(_swiglu_fwd_kernel)[(rows, triton.cdiv(H, block))](
                g2, u2, y, H, g2.stride(0), u2.stride(0), H, BLOCK=block)
        return y

    @define_op("swiglu_backward", fake=lambda dy, gate, up: (gate.new_empty(gate.shape), up.new_empty(up.shape)))
    def _swiglu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d gate, d up) of silu(gate) * up, silu recomputed; inputs read in place through their strides,
        outputs new contiguous tensors."""
        H = gate.shape[-1]
        dy2, g2, u2 = as_rows(dy), as_rows(gate), as_rows(up)
        rows = g2.shape[0]
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        if rows and H:
            block = _swiglu_block(H)
            launch(_swiglu_bwd_kernel)[(rows, triton.cdiv(H, block))](
                dy2, g2, u2, dgate, dup, H, dy2.stride(0), g2.stride(0), u2.stride(0), H, H, BLOCK=block)
        return dgate, dup

    def _swiglu_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)  # gate and up only; silu is recomputed

    def _swiglu_backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return backward_op(ctx, "swiglu_backward")(dy, gate, up)

    register_autograd(_swiglu_op, "swiglu", _swiglu_backward, _swiglu_setup)

    # the packed layout: gate_up [..., 2H] = cat(gate, up), the fused gate/up matmul's output. Its backward
    # writes d gate_up [..., 2H] directly: with two gradients, autograd's chunk backward concatenated them
    # (a copy of 2H per token per layer: 1.6 GB per step at 124M)
    @define_op("swiglu_packed", fake=lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)))
    def _swiglu_packed_op(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate_up[..., :H]) * gate_up[..., H:], both halves read in place (the swiglu body takes strided
        halves); a new contiguous [..., H]."""
        H = gate_up.shape[-1] // 2
        return raw_body("swiglu")(gate_up[..., :H], gate_up[..., H:])

    @define_op("swiglu_packed_backward", fake=lambda dy, gate_up: gate_up.new_empty(gate_up.shape))
    def _swiglu_packed_bwd_op(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """d gate_up [..., 2H] of swiglu_packed, one new contiguous tensor (both halves written in place)."""
        H = gate_up.shape[-1] // 2
        dy2, gu = as_rows(dy), as_rows(gate_up)
        rows = gu.shape[0]
        dgu = torch.empty(gu.shape, dtype=gate_up.dtype, device=gate_up.device)
        if rows and H:
            block = _swiglu_block(H)
            launch(_swiglu_packed_bwd_kernel)[(rows, triton.cdiv(H, block))](
                dy2, gu, dgu, H, dy2.stride(0), gu.stride(0), dgu.stride(0), BLOCK=block)
        return dgu.view(gate_up.shape)

    def _swiglu_packed_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def _swiglu_packed_backward(ctx, dy):
        gate_up, = ctx.saved_tensors
        return (backward_op(ctx, "swiglu_packed_backward")(dy, gate_up),)

    register_autograd(_swiglu_packed_op, "swiglu_packed", _swiglu_packed_backward, _swiglu_packed_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (fp32 math, gate's dtype out); the backward recomputes silu from gate and up."""
    require_triton()
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have the same shape and dtype")
    return call_op("swiglu", gate, up)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = cat(gate, up) [..., 2H] (the fused gate/up matmul's output), read in place;
    the backward returns one [..., 2H] gradient (no concatenation of two)."""
    require_triton()
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: the last dim {gate_up.shape[-1]} is not 2 x hidden")
    return call_op("swiglu_packed", gate_up)
