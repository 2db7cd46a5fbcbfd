"""Triton RoPE of q and k in one launch (half-split layout, model/kernels.py's rope_ref), as `myllm::rope`, its
backward the inverse rotation (model/triton_ops.py registers it), and the public wrapper `apply_rope`. Computes in
fp32, loads and stores in the tensors' dtype.
"""
from __future__ import annotations


import torch

from model.triton_ops import (TRITON_AVAILABLE, backward_op, call_op, define_op, launch, num_warps, register_autograd,
                              require_triton)

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl


if TRITON_AVAILABLE:
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

    def _rope_fake(q, k, cos, sin, inverse=False):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @define_op("rope", fake=_rope_fake)
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
        launch(_rope_kernel)[(B * T,)](
            q, k, cos, sin, qo, ko, T, H, Hkv,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), c_sb, cos.stride(1),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2), half,
            INVERSE=inverse, BLOCK_H=BLOCK_H, BLOCK_HKV=BLOCK_HKV, BLOCK_HALF=BLOCK_HALF,
            num_warps=num_warps(BLOCK_H * BLOCK_HALF))
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
        dq, dk = backward_op(ctx, "rope")(gq, gk, cos, sin, not ctx.inverse)  # a rotation's adjoint is its inverse
        return dq, dk, None, None, None

    register_autograd(_rope_op, "rope", _rope_backward, _rope_setup)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [B, T, H, D] and k [B, T, Hkv, D] (half-split layout, as rope_ref) in one launch.
    cos/sin: [B or 1, T, 1, D/2] (fp32). Returns new contiguous tensors in q's / k's dtype."""
    require_triton()
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
    return call_op("rope", q, k, cos, sin, False)
