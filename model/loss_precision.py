"""How the chunked linear + cross-entropy losses (model/loss.py, model/triton_loss.py) keep their precision: the
compute dtype (autocast's, else the tensors'), the weight gradient summed in fp32 across chunks
(`accumulate_fp32_`: no per-chunk product rounded to the low precision), and fp16's gradient scale
(`FP16_GRAD_SCALE`, `fp16_grads`, `fp16_grad_factor`: gradients formed in the forward at 1/n_valid underflowed
fp16), with the fp32 products that apply it (`scale_`, `scaled`). Numerics only: no chunking, no autograd.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("model.loss")  # its warning reads as the loss's, where it was always logged


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


_MIXED_ADDMM: dict = {}


def _mixed_addmm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Does `torch.addmm(acc_fp32, a, b, out_dtype=float32, out=acc_fp32)` with a, b in `dtype` work on
    `device` (cuBLAS with an fp32 output: the `out_dtype` overload of recent torch on CUDA)? Probed once
    per (device type, dtype) on small integer matrices (exact in every dtype): beta=0 over a NaN-filled
    accumulator, then beta=1."""
    key = (device.type, dtype)
    if key not in _MIXED_ADDMM:
        ok = False
        if device.type != "cpu":
            try:
                a = (torch.arange(48 * 32, device=device).reshape(48, 32) % 7 - 3).to(dtype)
                b = (torch.arange(32 * 16, device=device).reshape(32, 16) % 5 - 2).to(dtype)
                want = a.double() @ b.double()
                acc = torch.full((48, 16), float("nan"), device=device)
                torch.addmm(acc, a, b, out_dtype=torch.float32, beta=0, out=acc)
                ok = torch.equal(acc.double(), want)
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                ok = ok and torch.equal(acc.double(), 2 * want)
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
            if not ok:
                log.warning("addmm with an fp32 output from %s inputs is unavailable on %s: the linear+CE weight "
                            "gradient adds each chunk's %s product to its fp32 accumulator", dtype, device.type, dtype)
        _MIXED_ADDMM[key] = ok
    return _MIXED_ADDMM[key]


def accumulate_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc (fp32) = a @ b (first) or acc += a @ b, with a and b in one dtype.

    Low-precision a, b: the products are summed in fp32 and never rounded to the low precision (per chunk,
    that rounding and a [V, D] temporary written, read and added were the cost of a plain `mm`): on an
    accelerator one GEMM with an fp32 output accumulating in place (Liger's addmm into an fp32 buffer);
    on CPU, where no such kernel exists, an fp32 GEMM of the widened operands (exact: every bf16/fp16
    value is an fp32 value). Where the accelerator's mixed GEMM is missing, the old way, logged once."""
    if a.dtype == torch.float32 or a.device.type == "cpu":
        a, b = a.float(), b.float()
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
        return
    if _mixed_addmm_works(a.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, beta=0 if first else 1, out=acc)
        return
    prod = torch.mm(a, b)
    if first:
        acc.copy_(prod)
    else:
        acc.add_(prod)


FP16_GRAD_SCALE = 256.0  # a power of two: scaling and unscaling are exact


def fp16_grads(reduction: str, cdtype: torch.dtype) -> bool:
    """fp16 "mean"/"sum": the gradients formed in the forward are scaled by FP16_GRAD_SCALE (not by
    1/n_valid, not 1) and unscaled in backward, in fp32, together with the upstream (loss-scaled)
    gradient (`fp16_grad_factor`). Formed at 1/n_valid they underflowed fp16 (softmax ~1/V times 1/n,
    before any loss scale could help); at 1, the gradients of confident predictions (p - 1 ~ 1e-5) are
    fp16 subnormals. The scaled d hidden stays finite unless a head weight exceeds 65504 / (2 * 256).
    bf16 and fp32 have fp32's exponent range: no scaling there."""
    return cdtype == torch.float16 and reduction in ("mean", "sum")


def fp16_grad_factor(g: torch.Tensor, reduction: str, n_valid: torch.Tensor) -> torch.Tensor:
    """The fp32 factor that turns the fp16 path's saved gradients into the gradients for upstream g."""
    f = g.float() / FP16_GRAD_SCALE
    return f / n_valid.clamp(min=1) if reduction == "mean" else f


def scale_(t: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """t *= f (an fp32 scalar tensor) in place, the product formed in fp32: in fp16 the factor itself
    may not exist (a loss scale of 65536 is inf in fp16, 1/n_valid a subnormal)."""
    return t.mul_(f) if t.dtype == torch.float32 else t.copy_(t.float().mul_(f))


def scaled(t: torch.Tensor, f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(t * f).to(dtype) out of place, the product formed in fp32 (see `scale_`)."""
    return (t * f if t.dtype == torch.float32 else t.float() * f).to(dtype)
