"""Each fused kernel agrees with its pure-PyTorch reference, forward and backward; chunked CE is exact."""
import pytest
import torch
import torch.nn.functional as F

from model import kernels
from model.loss import linear_cross_entropy, linear_cross_entropy_ref


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(3))
    (out * g).sum().backward()
    return out, [x.grad for x in xs]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_rmsnorm_fused_matches_reference(dtype, tol):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32).to(dtype)
    w = torch.randn(32)
    a, ga = _grads(lambda x, w: kernels.rms_norm(x, w, 1e-6, fused=True), x, w)
    b, gb = _grads(lambda x, w: kernels.rms_norm_ref(x, w, 1e-6), x, w)
    assert a.dtype == b.dtype
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
    for u, v in zip(ga, gb):
        assert u.dtype == v.dtype and torch.allclose(u.float(), v.float(), atol=tol, rtol=tol)


def test_rope_fused_matches_reference_and_hf_rotate_half():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, 16)  # [B, T, H, D]
    ang = torch.randn(2, 6, 1, 8)
    cos, sin = ang.cos(), ang.sin()
    a, ga = _grads(lambda x: kernels.apply_rope(x, cos, sin, fused=True), x)
    b, gb = _grads(lambda x: kernels.apply_rope(x, cos, sin, fused=False), x)
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(ga[0], gb[0], atol=1e-6)
    # rotation preserves norms per (x_i, x_{i+D/2}) pair
    assert torch.allclose(a.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_swiglu_fused_matches_reference():
    torch.manual_seed(0)
    g, u = torch.randn(4, 7, 24), torch.randn(4, 7, 24)
    a, ga = _grads(lambda g, u: kernels.swiglu(g, u, fused=True), g, u)
    b, gb = _grads(lambda g, u: kernels.swiglu_ref(g, u), g, u)
    assert torch.allclose(a, b, atol=1e-6)
    for p, q in zip(ga, gb):
        assert torch.allclose(p, q, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [5, 64, 1000])
def test_chunked_linear_ce_exact(reduction, chunk):
    torch.manual_seed(0)
    h = torch.randn(3, 31, 16)
    w = torch.randn(50, 16) * 0.5
    y = torch.randint(0, 50, (3, 31))
    y[0, :10] = -100
    y[2, -3:] = -100
    a, ga = _grads(lambda h, w: linear_cross_entropy(h, w, y, reduction, chunk), h, w)
    b, gb = _grads(lambda h, w: linear_cross_entropy_ref(h, w, y, reduction), h, w)
    ref = F.cross_entropy((h @ w.t()).reshape(-1, 50), y.reshape(-1), ignore_index=-100,
                          reduction=reduction).reshape(a.shape)
    assert torch.allclose(b, ref, atol=1e-5)
    assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    for p, q in zip(ga, gb):
        assert torch.allclose(p, q, atol=1e-5, rtol=1e-5)
    if reduction == "none":
        assert (a[0, :10] == 0).all()


def test_chunked_ce_no_grad_all_ignored_and_bf16():
    torch.manual_seed(0)
    h, w = torch.randn(2, 8, 16), torch.randn(40, 16)
    y = torch.full((2, 8), -100)
    assert linear_cross_entropy(h, w, y, "mean").item() == 0.0  # no NaN for zero target tokens
    y = torch.randint(0, 40, (2, 8))
    with torch.no_grad():
        assert torch.allclose(linear_cross_entropy(h, w, y, "sum", 3), linear_cross_entropy_ref(h, w, y, "sum"), atol=1e-4)
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lb = linear_cross_entropy(hr, wr, y, "mean", 5)
        lr = linear_cross_entropy_ref(h, w, y, "mean")
    assert lb.dtype == torch.float32 and abs(lb.item() - lr.item()) < 5e-2 * abs(lr.item())
    lb.backward()
    assert hr.grad.dtype == torch.float32 and wr.grad.dtype == torch.float32


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunked_ce_bf16_gradients_as_accurate_as_reference(reduction):
    """Under bf16 autocast the chunked loss's gradients are no further from the exact fp32 gradients
    (of the bf16-rounded inputs) than the reference's (bf16 logits + F.cross_entropy), within 10%."""
    torch.manual_seed(0)
    h0, w0 = torch.randn(40, 32), torch.randn(300, 32) * 0.3
    y = torch.randint(0, 300, (40,))
    y[:8] = (h0[:8] @ w0.t()).argmax(-1)  # some confident targets (p close to 1)
    y[-3:] = -100
    hb, wb = h0.bfloat16().float().requires_grad_(True), w0.bfloat16().float().requires_grad_(True)
    linear_cross_entropy_ref(hb, wb, y, reduction).sum().backward()
    errs = []
    for fn in (lambda h, w: linear_cross_entropy(h, w, y, reduction, 16), lambda h, w: linear_cross_entropy_ref(h, w, y, reduction)):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fn(h, w).sum().backward()
        errs.append([float((a.grad - b.grad).norm() / b.grad.norm()) for a, b in ((h, hb), (w, wb))])
    assert all(e < 2e-2 for e in errs[0])
    assert errs[0][0] <= 1.1 * errs[1][0] + 1e-4 and errs[0][1] <= 1.1 * errs[1][1] + 1e-4, errs


def test_chunked_ce_reuses_its_cpu_workspace():
    from model import loss as loss_mod
    h, w = torch.randn(12, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    y = torch.randint(0, 20, (12,))
    linear_cross_entropy(h, w, y, "mean", 5).backward()
    ws = loss_mod._CPU_CACHE["ws"]
    g1 = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    linear_cross_entropy(h, w, y, "mean", 5).backward()
    assert loss_mod._CPU_CACHE["ws"] is ws  # same shapes: buffers reused, results unchanged
    assert torch.equal(g1[0], h.grad) and torch.equal(g1[1], w.grad)
    linear_cross_entropy(h, w, y, "mean", 4)  # another chunk size replaces the buffers
    assert loss_mod._CPU_CACHE["ws"] is not ws


def test_adamw_fused_matches_reference():
    torch.manual_seed(0)
    p1 = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in p1]
    o1 = kernels.build_adamw(p1, lr=1e-2, weight_decay=0.1, fused=True)
    o2 = kernels.build_adamw(p2, lr=1e-2, weight_decay=0.1, fused=False)
    for step in range(3):
        for a, b in zip(p1, p2):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for a, b in zip(p1, p2):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_chunked_ce_frozen_head_gives_only_hidden_grad(reduction):
    torch.manual_seed(0)
    h = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(30, 16)  # frozen, as under LoRA
    y = torch.randint(0, 30, (10,))
    linear_cross_entropy(h, w, y, reduction, 4).sum().backward()
    ga = h.grad.clone()
    h.grad = None
    linear_cross_entropy_ref(h, w, y, reduction).sum().backward()
    assert w.grad is None and torch.allclose(ga, h.grad, atol=1e-5)
