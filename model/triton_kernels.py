"""Triton kernels (forward and backward) for RMSNorm, add+RMSNorm, RoPE and SwiGLU, as torch.library ops.

Owns: the Triton kernels, their `myllm::*` custom ops (each forward and each backward is an op, with
autograd registered on the forward), and thin public wrappers: `rms_norm`, `add_rms_norm`,
`apply_rope`, `swiglu`. The math follows the references in model/kernels.py (rms_norm_ref, rope_ref,
swiglu_ref); every kernel loads and stores in the tensors' dtype and computes in fp32.

Ops are `torch.library.triton_op`s on a GPU, so torch.compile (Inductor) sees the Triton kernels
themselves. Under the Triton CPU interpreter (TRITON_INTERPRET=1, used by the tests) `wrap_triton`
cannot be traced, so the same bodies are registered as opaque `torch.library.custom_op`s with
explicit fake (shape) functions instead; the choice is made once, at import.

Must never: import triton with a hard failure (TRITON_AVAILABLE says whether it is there), decide
whether a kernel is worth using (model/kernels.py dispatches), or create parameters.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

try:  # optional accelerator: the module must import without it
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:  # ImportError, or a broken install
    triton = None
    tl = None
    TRITON_AVAILABLE = False

# Whether the kernels below run in Triton's CPU interpreter. triton.jit decides that when it decorates
# a kernel (TRITON_INTERPRET=1 in the environment at that moment, i.e. when this module is imported),
# so it is read from the kernels themselves, after they are defined (end of the `if` below).
_INTERPRET = False


def supported(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on t's device: a GPU, or the CPU when TRITON_INTERPRET=1
    (and was already set when this module was imported, so that the kernels are interpreted)."""
    if not TRITON_AVAILABLE:
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _INTERPRET


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("model.triton_kernels: triton is not installed (pip install triton); "
                           "use the pure-PyTorch kernels in model/kernels.py instead")


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


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
    # ------------------------------------------------------------------------------------ kernels
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

    @triton.jit
    def _rope_kernel(Q, K, COS, SIN, QO, KO, T, H, HKV,
                     q_sb, q_st, q_sh, k_sb, k_st, k_sh, c_sb, c_st,
                     qo_sb, qo_st, qo_sh, ko_sb, ko_st, ko_sh, HALF,
                     INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
                     BLOCK_HALF: tl.constexpr):
        """One program per (b, t): all q heads and all k heads of that token, rotated by the same
        cos/sin row (loaded once). Half-split layout: the pair is (x[i], x[i + HALF]).
        INVERSE rotates by -theta (the backward of a rotation)."""
        pid = tl.program_id(0).to(tl.int64)
        b = pid // T
        t = pid % T
        cols = tl.arange(0, BLOCK_HALF)
        cmask = cols < HALF
        c = tl.load(COS + b * c_sb + t * c_st + cols, mask=cmask, other=0.0).to(tl.float32)
        s = tl.load(SIN + b * c_sb + t * c_st + cols, mask=cmask, other=0.0).to(tl.float32)
        if INVERSE:
            s = -s
        c = c[None, :]
        s = s[None, :]

        heads = tl.arange(0, BLOCK_H)
        m = (heads[:, None] < H) & cmask[None, :]
        src = Q + b * q_sb + t * q_st + heads[:, None] * q_sh + cols[None, :]
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        dst = QO + b * qo_sb + t * qo_st + heads[:, None] * qo_sh + cols[None, :]
        tl.store(dst, (x1 * c - x2 * s).to(QO.dtype.element_ty), mask=m)
        tl.store(dst + HALF, (x2 * c + x1 * s).to(QO.dtype.element_ty), mask=m)

        kheads = tl.arange(0, BLOCK_HKV)
        km = (kheads[:, None] < HKV) & cmask[None, :]
        ksrc = K + b * k_sb + t * k_st + kheads[:, None] * k_sh + cols[None, :]
        y1 = tl.load(ksrc, mask=km, other=0.0).to(tl.float32)
        y2 = tl.load(ksrc + HALF, mask=km, other=0.0).to(tl.float32)
        kdst = KO + b * ko_sb + t * ko_st + kheads[:, None] * ko_sh + cols[None, :]
        tl.store(kdst, (y1 * c - y2 * s).to(KO.dtype.element_ty), mask=km)
        tl.store(kdst + HALF, (y2 * c + y1 * s).to(KO.dtype.element_ty), mask=km)

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

    # ------------------------------------------------------------------------------------- op helpers
    _INTERPRET = not isinstance(_rms_norm_fwd_kernel, triton.runtime.jit.JITFunction)

    def _launch(kernel):
        """`kernel[grid](...)`, through wrap_triton so that triton_op bodies trace on a GPU."""
        return torch.library.wrap_triton(kernel) if not _INTERPRET else kernel

    def _define(name: str, fake=None):
        """Register fn as op `myllm::<name>`: a triton_op on a GPU; under the interpreter (where
        wrap_triton cannot be traced) a custom_op with an explicit fake function. The plain function is
        kept in _RAW for eager calls (`_EagerOp`)."""
        def deco(fn):
            _RAW[name] = fn
            if _INTERPRET:
                op = torch.library.custom_op(f"myllm::{name}", mutates_args=())(fn)
                op.register_fake(fake)
            else:
                op = torch.library.triton_op(f"myllm::{name}", mutates_args=())(fn)
            return op
        return deco

    _RAW: dict = {}       # op name -> its Python body (launches the kernel directly)
    _AUTOGRAD: dict = {}  # op name -> (setup_context, backward), as registered with the op

    def _autograd(op, name: str, backward, setup_context) -> None:
        op.register_autograd(backward, setup_context=setup_context)
        _AUTOGRAD[name] = (setup_context, backward)

    try:  # a triton_op's body launches through wrap_triton, which dispatches a higher-order op per launch
        # unless told not to (~1 ms each in eager, torch's note); the op's own eager kernel turns it off
        from torch._library.triton import set_wrap_triton_enabled as _set_wrap_triton_enabled
    except ImportError:  # an older torch: the launches go through the higher-order op (slower, the same result)
        _set_wrap_triton_enabled = None

    def _run_raw(name: str, *args):
        """Op `name`'s Python body with plain kernel launches (as the registered op runs it in eager)."""
        if _set_wrap_triton_enabled is None or _INTERPRET:
            return _RAW[name](*args)
        with _set_wrap_triton_enabled(False):
            return _RAW[name](*args)

    def _bwd(ctx, name: str):
        """The backward op `name`: its Python body under `_EagerOp`, else the registered op (traced by
        torch.compile)."""
        if getattr(ctx, "eager", False):
            return lambda *args: _run_raw(name, *args)
        return getattr(torch.ops.myllm, name)

    class _EagerOp(torch.autograd.Function):
        """An op's body, setup_context and backward as a plain autograd.Function: what an eager call runs.
        The custom-op dispatch around the same code cost ~0.2 ms of host time per forward + backward of
        each op in eager on an H100 (edf4898's profile), ~60 op calls per 124M step; torch.compile keeps
        the registered ops (`_call`)."""

        @staticmethod
        def forward(ctx, name, *args):
            out = _run_raw(name, *args)
            setup_context, _ = _AUTOGRAD[name]
            ctx.eager, ctx.op_name = True, name
            ctx.set_materialize_grads(False)
            setup_context(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx, *grads):
            _, backward = _AUTOGRAD[ctx.op_name]
            return (None, *backward(ctx, *grads))

    def _call(name: str, *args):
        """Op `name` on args: the registered op while compiling (or for tensor subclasses), else _EagerOp."""
        if torch.compiler.is_compiling() or any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN
                                                for a in args):
            return getattr(torch.ops.myllm, name)(*args)
        return _EagerOp.apply(name, *args)

    _PLAIN = (torch.Tensor, torch.nn.Parameter)

    def _rows(x: torch.Tensor) -> torch.Tensor:
        """x as a [rows, D] matrix with unit column stride (a copy only when x is not row-major)."""
        x2 = x.reshape(-1, x.shape[-1])
        return x2 if x2.stride(-1) == 1 else x2.contiguous()

    # ------------------------------------------------------------------------------------ RMSNorm
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
        x2 = _rows(x)
        n = x2.shape[0]
        y = torch.empty((n, D), dtype=_y_dtype(x, residual, weight, out_dtype), device=x.device)
        rstd = torch.empty((n,), dtype=torch.float32, device=x.device)
        h = torch.empty((n, D), dtype=_h_dtype(x, residual), device=x.device) if residual is not None else x2
        r2 = _rows(residual) if residual is not None else x2
        BLOCK = triton.next_power_of_2(D)
        _launch(_rms_norm_fwd_kernel)[(n,)](
            x2, r2, weight.contiguous(), y, h, rstd, x2.stride(0), r2.stride(0), y.stride(0), h.stride(0),
            D, eps, HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=_num_warps(BLOCK))
        return y.view(x.shape), h.view(x.shape), rstd

    @_define("rms_norm", fake=lambda x, weight, eps, out_dtype=None: _rms_norm_fake(x, None, weight, eps, out_dtype))
    def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, rstd): y = rms_norm_ref(x, weight, eps) (stored in out_dtype when given); rstd [rows]
        fp32 is kept for the backward."""
        y, _, rstd = _rms_norm_fwd(x, None, weight, eps, out_dtype)
        return y, rstd

    def _add_rms_norm_fake(x, residual, weight, eps, out_dtype=None):
        y, rstd = _rms_norm_fake(x, residual, weight, eps, out_dtype)
        return y, x.new_empty(x.shape, dtype=_h_dtype(x, residual)), rstd

    @_define("add_rms_norm", fake=_add_rms_norm_fake)
    def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y, h, rstd) with h = x + residual (torch's dtype promotion) and y = rms_norm_ref(h, weight, eps)."""
        return _rms_norm_fwd(x, residual, weight, eps, out_dtype)

    def _rms_norm_bwd_fake(g, gh, x, weight, rstd):
        return x.new_empty(x.shape), weight.new_empty(weight.shape)

    @_define("rms_norm_backward", fake=_rms_norm_bwd_fake)
    def _rms_norm_bwd_op(g: torch.Tensor, gh: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx, dweight) of y = rms_norm(x); gh, when given, is a gradient arriving at x directly
        (the h output of add_rms_norm) and is added to dx. dx has x's dtype, dweight weight's."""
        D = x.shape[-1]
        x2, g2 = _rows(x), _rows(g)
        n = x2.shape[0]
        gh2 = _rows(gh) if gh is not None else g2
        dx = torch.empty((n, D), dtype=x.dtype, device=x.device)
        BLOCK = triton.next_power_of_2(D)
        block_rows = _bwd_block_rows(BLOCK)
        # enough programs to keep every SM busy with several tiles in flight, each looping over whole tiles
        programs = max(1, min(triton.cdiv(n, block_rows), _BWD_PROGRAMS_PER_SM * _num_sms(x.device)))
        rows_per_program = triton.cdiv(triton.cdiv(n, programs), block_rows) * block_rows
        programs = max(1, triton.cdiv(n, rows_per_program))
        dw_partial = torch.empty((programs, D), dtype=torch.float32, device=x.device)
        _launch(_rms_norm_bwd_kernel)[(programs,)](
            g2, gh2, x2, weight.contiguous(), rstd, dx, dw_partial, g2.stride(0), gh2.stride(0),
            x2.stride(0), dx.stride(0), n, D, rows_per_program,
            HAS_GH=gh is not None, BLOCK=BLOCK, BLOCK_ROWS=block_rows,
            num_warps=_num_warps(BLOCK * block_rows))
        return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)

    def _rms_norm_setup(ctx, inputs, output):
        x, weight = inputs[:2]
        ctx.save_for_backward(x, weight, output[1])

    def _rms_norm_backward(ctx, g, _g_rstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _bwd(ctx, "rms_norm_backward")(g, None, x, weight, rstd)
        return dx, dw, None, None

    _autograd(_rms_norm_op, "rms_norm", _rms_norm_backward, _rms_norm_setup)

    def _add_rms_norm_setup(ctx, inputs, output):
        x, residual, weight = inputs[:3]
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        ctx.save_for_backward(output[1], weight, output[2])

    def _add_rms_norm_backward(ctx, g, gh, _g_rstd):
        h, weight, rstd = ctx.saved_tensors
        if g is None:
            g = torch.zeros_like(h)
        dh, dw = _bwd(ctx, "rms_norm_backward")(g, gh, h, weight, rstd)  # dh in h's dtype
        return dh.to(ctx.x_dtype), dh.to(ctx.residual_dtype), dw, None, None

    _autograd(_add_rms_norm_op, "add_rms_norm", _add_rms_norm_backward, _add_rms_norm_setup)

    # --------------------------------------------------------------------------------------- RoPE
    def _rope_fake(q, k, cos, sin, inverse=False):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @_define("rope", fake=_rope_fake)
    def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(rope(q), rope(k)) in one launch; inverse=True rotates by -theta (the backward).
        q [B, T, H, D] and k [B, T, Hkv, D] may be strided views (unit stride on D); cos/sin
        [B or 1, T, 1, D/2]. Outputs are new contiguous tensors of q's and k's dtype."""
        B, T, H, D = q.shape
        Hkv = k.shape[2]
        half = D // 2
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k.stride(-1) != 1:
            k = k.contiguous()
        cos = cos.reshape(cos.shape[0], T, half)
        sin = sin.reshape(sin.shape[0], T, half)
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        c_sb = 0 if cos.shape[0] == 1 else cos.stride(0)  # one table broadcast over the batch
        qo = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
        ko = torch.empty((B, T, Hkv, D), dtype=k.dtype, device=k.device)
        BLOCK_H, BLOCK_HKV = triton.next_power_of_2(H), triton.next_power_of_2(Hkv)
        BLOCK_HALF = triton.next_power_of_2(half)
        _launch(_rope_kernel)[(B * T,)](
            q, k, cos, sin, qo, ko, T, H, Hkv,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), c_sb, cos.stride(1),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2), half,
            INVERSE=inverse, BLOCK_H=BLOCK_H, BLOCK_HKV=BLOCK_HKV, BLOCK_HALF=BLOCK_HALF,
            num_warps=_num_warps(BLOCK_H * BLOCK_HALF))
        return qo, ko

    def _rope_setup(ctx, inputs, output):
        q, k, cos, sin, inverse = inputs
        ctx.inverse = inverse
        ctx.q_shape, ctx.q_dtype, ctx.k_shape, ctx.k_dtype = q.shape, q.dtype, k.shape, k.dtype
        ctx.save_for_backward(cos, sin)

    def _rope_backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        # a gradient is None only when that output was not used; the kernel needs a tensor
        gq = torch.zeros(ctx.q_shape, dtype=ctx.q_dtype, device=cos.device) if gq is None else gq
        gk = torch.zeros(ctx.k_shape, dtype=ctx.k_dtype, device=cos.device) if gk is None else gk
        dq, dk = _bwd(ctx, "rope")(gq, gk, cos, sin, not ctx.inverse)  # a rotation's adjoint is its inverse
        return dq, dk, None, None, None

    _autograd(_rope_op, "rope", _rope_backward, _rope_setup)

    # ------------------------------------------------------------------------------------- SwiGLU
    _SWIGLU_BLOCK = 1024  # columns per program (a row of the 124M/1B MLP is 2048/5632 wide)

    def _swiglu_block(n_cols: int) -> int:
        return min(_SWIGLU_BLOCK, triton.next_power_of_2(max(1, n_cols)))

    @_define("swiglu", fake=lambda gate, up: gate.new_empty(gate.shape))
    def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, computed in fp32, stored in gate's dtype (a new contiguous tensor). gate and up
        may be strided views (the halves of one matmul output): the kernel reads them in place."""
        H = gate.shape[-1]
        g2, u2 = _rows(gate), _rows(up)
        rows = g2.shape[0]
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        if rows and H:
            block = _swiglu_block(H)
            _launch(_swiglu_fwd_kernel)[(rows, triton.cdiv(H, block))](
                g2, u2, y, H, g2.stride(0), u2.stride(0), H, BLOCK=block)
        return y

    @_define("swiglu_backward", fake=lambda dy, gate, up: (gate.new_empty(gate.shape), up.new_empty(up.shape)))
    def _swiglu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d gate, d up) of silu(gate) * up, silu recomputed; inputs read in place through their strides,
        outputs new contiguous tensors."""
        H = gate.shape[-1]
        dy2, g2, u2 = _rows(dy), _rows(gate), _rows(up)
        rows = g2.shape[0]
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        if rows and H:
            block = _swiglu_block(H)
            _launch(_swiglu_bwd_kernel)[(rows, triton.cdiv(H, block))](
                dy2, g2, u2, dgate, dup, H, dy2.stride(0), g2.stride(0), u2.stride(0), H, H, BLOCK=block)
        return dgate, dup

    def _swiglu_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)  # gate and up only; silu is recomputed

    def _swiglu_backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return _bwd(ctx, "swiglu_backward")(dy, gate, up)

    _autograd(_swiglu_op, "swiglu", _swiglu_backward, _swiglu_setup)

    # the packed layout: gate_up [..., 2H] = cat(gate, up), the fused gate/up matmul's output. Its backward
    # writes d gate_up [..., 2H] directly: with two gradients, autograd's chunk backward concatenated them
    # (a copy of 2H per token per layer: 1.6 GB per step at 124M)
    @_define("swiglu_packed", fake=lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)))
    def _swiglu_packed_op(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate_up[..., :H]) * gate_up[..., H:], both halves read in place (the swiglu body takes strided
        halves); a new contiguous [..., H]."""
        H = gate_up.shape[-1] // 2
        return _RAW["swiglu"](gate_up[..., :H], gate_up[..., H:])

    @_define("swiglu_packed_backward", fake=lambda dy, gate_up: gate_up.new_empty(gate_up.shape))
    def _swiglu_packed_bwd_op(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """d gate_up [..., 2H] of swiglu_packed, one new contiguous tensor (both halves written in place)."""
        H = gate_up.shape[-1] // 2
        dy2, gu = _rows(dy), _rows(gate_up)
        rows = gu.shape[0]
        dgu = torch.empty(gu.shape, dtype=gate_up.dtype, device=gate_up.device)
        if rows and H:
            block = _swiglu_block(H)
            _launch(_swiglu_packed_bwd_kernel)[(rows, triton.cdiv(H, block))](
                dy2, gu, dgu, H, dy2.stride(0), gu.stride(0), dgu.stride(0), BLOCK=block)
        return dgu.view(gate_up.shape)

    def _swiglu_packed_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def _swiglu_packed_backward(ctx, dy):
        gate_up, = ctx.saved_tensors
        return (_bwd(ctx, "swiglu_packed_backward")(dy, gate_up),)

    _autograd(_swiglu_packed_op, "swiglu_packed", _swiglu_packed_backward, _swiglu_packed_setup)


# ------------------------------------------------------------------------------------ public API
def _check_rows(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Triton RMSNorm with rms_norm_ref's math: normalise in fp32, round to x's dtype, scale by weight.
    Output dtype: torch.result_type(x, weight) as the reference, or `out_dtype` when given: the
    reference's output cast to out_dtype, rounded once (under autocast the next matmul would cast the
    fp32 output to the autocast dtype anyway; storing that dtype directly saves the round trip)."""
    _require_triton()
    _check_rows("rms_norm", x, weight)
    return _call("rms_norm", x, weight, float(eps), out_dtype)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h), h) with h = x + residual in torch's promoted dtype (a bf16 branch output added to
    an fp32 residual stream stays fp32), one launch forward, one backward. out_dtype: as `rms_norm`."""
    _require_triton()
    _check_rows("add_rms_norm", x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    y, h, _ = _call("add_rms_norm", x, residual, weight, float(eps), out_dtype)
    return y, h


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [B, T, H, D] and k [B, T, Hkv, D] (half-split layout, as rope_ref) in one launch.
    cos/sin: [B or 1, T, 1, D/2] (fp32). Returns new contiguous tensors in q's / k's dtype."""
    _require_triton()
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, T, heads, D] "
                         "with the same B, T and D")
    B, T, _, D = q.shape
    if D % 2:
        raise ValueError(f"apply_rope: head_dim {D} must be even")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.numel() != c.shape[0] * T * (D // 2) or c.shape[0] not in (1, B) or c.shape[-1] != D // 2:
            raise ValueError(f"apply_rope: {name} shape {tuple(c.shape)} is not [B or 1, T, 1, D/2] "
                             f"for B={B}, T={T}, D={D}")
    return _call("rope", q, k, cos, sin, False)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (fp32 math, gate's dtype out); the backward recomputes silu from gate and up."""
    _require_triton()
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have the same shape and dtype")
    return _call("swiglu", gate, up)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = cat(gate, up) [..., 2H] (the fused gate/up matmul's output), read in place;
    the backward returns one [..., 2H] gradient (no concatenation of two)."""
    _require_triton()
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: the last dim {gate_up.shape[-1]} is not 2 x hidden")
    return _call("swiglu_packed", gate_up)
