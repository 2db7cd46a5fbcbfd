"""Each fused kernel agrees with its pure-PyTorch reference, forward and backward; chunked CE is exact."""
import pytest
import torch
import torch.nn.functional as F

from model import kernels
from model.loss import linear_cross_entropy, linear_cross_entropy_ref


def concat_linear_ref(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x @ cat(weights).T in one matmul, by plain autograd (which keeps the concatenated copy from forward to
    backward): the reference `kernels.concat_linear` is checked against."""
    return F.linear(x, torch.cat(weights))


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


def _concat_linear_case(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=g).to(dtype)
    ws = [torch.randn(n, 32, generator=g) * 0.2 for n in (32, 16, 16)]  # q, k, v of a GQA block
    return x, ws


@pytest.mark.parametrize("autocast", [False, True])
def test_concat_linear_matches_reference_forward_and_backward(autocast):
    """The one-matmul projection with its own backward agrees with autograd through cat + linear, fp32
    and under CPU bf16 autocast: the error against the fp64 truth is at most 2x the reference's own
    plus 8 ulps of the value's scale, and every gradient comes back in its input's dtype."""
    x, ws = _concat_linear_case()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        a, ga = _grads(lambda x, *w: kernels.concat_linear(x, w), x, *ws)
        b, gb = _grads(lambda x, *w: concat_linear_ref(x, w), x, *ws)
    t, gt = _grads(lambda x, *w: concat_linear_ref(x, w), x.double(), *[w.double() for w in ws])
    if autocast:  # the truth of autocast's math: the bf16-rounded inputs, exactly
        t, gt = _grads(lambda x, *w: concat_linear_ref(x, w),
                       x.bfloat16().double(), *[w.bfloat16().double() for w in ws])
    assert a.dtype == b.dtype and a.shape == (2, 5, 64)
    eps = torch.finfo(a.dtype).eps
    for got, ref, truth, inp in zip([a, *ga], [b, *gb], [t, *gt], [a, x, *ws]):
        assert got.dtype == ref.dtype == inp.dtype and got.shape == ref.shape
        err = float((got.detach().double() - truth).abs().max())
        ref_err = float((ref.detach().double() - truth).abs().max())
        assert err <= 2 * ref_err + 8 * eps * float(truth.abs().max()), (err, ref_err)


def test_concat_linear_frozen_weight_gets_no_gradient():
    x, ws = _concat_linear_case()
    x.requires_grad_(True)
    ws = [w.requires_grad_(i != 1) for i, w in enumerate(ws)]
    kernels.concat_linear(x, tuple(ws)).square().sum().backward()
    assert ws[1].grad is None and ws[0].grad is not None and ws[2].grad is not None and x.grad is not None
    ref = [w.detach().clone().requires_grad_(True) for w in ws]
    concat_linear_ref(x.detach(), tuple(ref)).square().sum().backward()
    assert torch.allclose(ws[2].grad, ref[2].grad, atol=1e-5)


def _saved_activation_bytes(fused_qkv: bool) -> int:
    """Bytes autograd saves for backward in one forward of a 2-block model, parameters not counted
    (each storage once)."""
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=8,
                                multiple_of=64, fused_qkv=fused_qkv, fused_cross_entropy=False))
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, labels=x)
    return sum(saved.values())


def test_fused_projections_save_no_more_than_separate_ones():
    """fused_qkv runs one matmul for q/k/v and one for gate/up but keeps no copy of the concatenated
    weights (2/3 of a block's parameters, per block) and no pre-RoPE q/k behind v until backward: it
    saves no more than the three separate projections do."""
    assert _saved_activation_bytes(True) <= _saved_activation_bytes(False)


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


# ------------------------------------------------------------------- precision of the chunked linear+CE
def _truth(h, w, y, reduction):
    """fp64 logits + cross-entropy: the exact loss of the given inputs."""
    return F.cross_entropy(h.double() @ w.double().t(), y, ignore_index=-100, reduction=reduction)


def _loss_grads(fn, h, w, y, reduction, upstream, dtype=None, autocast=None):
    h = h.detach().to(dtype or h.dtype).clone().requires_grad_(True)
    w = w.detach().to(dtype or w.dtype).clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = fn(h, w, y, reduction)
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), h.grad, w.grad


def _rel(got, truth):
    return ((got.double() - truth.double()).norm() / truth.double().norm()).item()


def _confident(n=64, v=64, alpha=14.0, seed=3):
    """A confident model: logits = h (weight = identity), each target `alpha` above the rest: every
    other class's softmax and p - 1 at the target are ~1e-6 (late training, small loss)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, v, (n,), generator=g)
    y[: n // 8] = -100
    h = 0.1 * torch.randn(n, v, generator=g)
    h[torch.arange(n), y.clamp(min=0)] += alpha
    return h, torch.eye(v), y


@pytest.mark.parametrize("reduction,scale", [("mean", 65536.0), ("mean", 1024.0), ("sum", 65536.0)])
def test_chunked_ce_fp16_gradients_do_not_underflow(reduction, scale):
    """fp16 with a loss scale (the upstream gradient): "mean" formed its gradients at 1/n_valid in the
    forward, below fp16's subnormals for a confident model (relative error 1.3e-1 vs the fp16 reference's
    2e-3), and the upstream 65536 was cast to fp16 (inf: NaN gradients). Now at most 1.5x the fp16
    reference's error against fp64."""
    h, w, y = _confident()
    up = torch.tensor(scale)
    chunked = lambda h, w, y, r: linear_cross_entropy(h, w, y, r, 16)  # noqa: E731
    ours = _loss_grads(chunked, h, w, y, reduction, up, dtype=torch.float16)
    ref = _loss_grads(linear_cross_entropy_ref, h, w, y, reduction, up, dtype=torch.float16)
    truth = _loss_grads(_truth, h, w, y, reduction, up.double(), dtype=torch.float64)
    for i, name in ((1, "d_hidden"), (2, "d_weight")):
        e_ours, e_ref = _rel(ours[i], truth[i]), _rel(ref[i], truth[i])
        assert e_ours <= 1.5 * e_ref, f"{name}: ours {e_ours:.3g} vs fp16 reference {e_ref:.3g}"


def test_chunked_ce_weight_grad_accumulates_in_fp32():
    """bf16 autocast, 16 chunks: d weight is summed in fp32 from the fp32 softmax gradient, so its error
    (against the exact gradient of the bf16-rounded inputs) is below that of rounding the exact gradient
    once to bf16; before, each chunk's product was rounded to bf16 (1.25x that)."""
    g = torch.Generator().manual_seed(0)
    n, v, d = 256, 128, 64
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / d ** 0.5
    y = torch.randint(0, v, (n,), generator=g)
    up = torch.tensor(1.5)
    got = _loss_grads(lambda *a: linear_cross_entropy(*a, 16), h, w, y, "sum", up, autocast=torch.bfloat16)[2]
    truth = _loss_grads(_truth, h.bfloat16(), w.bfloat16(), y, "sum", up.double(), dtype=torch.float64)[2]
    once = _rel(truth.bfloat16(), truth)
    assert got.dtype == torch.float32 and _rel(got, truth) <= 0.5 * once, (_rel(got, truth), once)


def test_accumulate_fp32_exact_on_cpu_and_gpu_call_valid(monkeypatch):
    """accumulate_fp32_: on CPU the fp32 sum of exact products; the GPU call (addmm with an fp32 output
    accumulating in place) is checked for its signature and dtypes on meta tensors, which run torch's own
    shape/dtype checks of that overload without a GPU."""
    from model import loss_precision as loss_mod
    g = torch.Generator().manual_seed(5)
    a = [torch.randn(48, 32, generator=g).bfloat16() for _ in range(4)]
    b = [torch.randn(32, 16, generator=g).bfloat16() for _ in range(4)]
    acc = torch.full((48, 16), float("nan"))
    for k in range(4):
        loss_mod.accumulate_fp32_(acc, a[k], b[k], first=k == 0)
    exact = sum(x.double() @ z.double() for x, z in zip(a, b))
    assert acc.dtype == torch.float32 and torch.allclose(acc.double(), exact, rtol=1e-6, atol=1e-6)
    assert not loss_mod._mixed_addmm_works(torch.device("cpu"), torch.bfloat16)
    for dt in (torch.bfloat16, torch.float16):
        monkeypatch.setitem(loss_mod._MIXED_ADDMM, ("meta", dt), True)
        acc = torch.empty(48, 16, device="meta")
        a_t = torch.empty(32, 48, dtype=dt, device="meta").t()  # a transposed view, as triton_loss passes g.t()
        for first in (True, False):
            loss_mod.accumulate_fp32_(acc, a_t, torch.empty(32, 16, dtype=dt, device="meta"), first)
        assert acc.dtype == torch.float32 and acc.shape == (48, 16)


# ---------------------------------------------------------------------- the compiled path (custom op)
@pytest.mark.parametrize("reduction,dtype", [("mean", torch.float32), ("sum", torch.float32),
                                             ("none", torch.float32), ("mean", torch.float16)])
def test_chunked_ce_compiles_fullgraph_and_matches_eager(reduction, dtype):
    """Under torch.compile the chunked loss is the custom op myllm::chunked_linear_cross_entropy (it was
    a torch.compiler.disable'd function: a graph break): fullgraph=True holds, and loss and gradients
    equal the eager autograd Function's (the same code runs inside the op)."""
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(2, 13, 16, generator=g), torch.randn(50, 16, generator=g) / 2
    y = torch.randint(0, 50, (2, 13), generator=g)
    y[0, :4] = -100

    def step(h, w, y):
        return linear_cross_entropy(torch.tanh(h) * 2, w, y, reduction, 5)

    up = torch.randn(2, 13, generator=g) if reduction == "none" else torch.tensor(3.0)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = _loss_grads(lambda h, w, y, r: compiled(h, w, y), h, w, y, reduction, up, dtype=dtype)
    want = _loss_grads(lambda h, w, y, r: step(h, w, y), h, w, y, reduction, up, dtype=dtype)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_chunked_ce_opcheck():
    from utils.constants import IGNORE_INDEX
    g = torch.Generator().manual_seed(4)
    n, v, d = 5, 37, 8
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    y = torch.randint(0, v, (n,), generator=g)
    y[1] = IGNORE_INDEX
    for reduction, need_w in (("mean", True), ("sum", False), ("none", True)):
        torch.library.opcheck(torch.ops.myllm.chunked_linear_cross_entropy.default,
                              (h, w, y, reduction, 3, torch.float32, True, need_w))
    lse = torch.logsumexp(h.detach() @ w.detach().t(), dim=-1)
    torch.library.opcheck(torch.ops.myllm.chunked_linear_cross_entropy_backward.default,
                          (torch.randn(n, generator=g), h.detach(), w.detach(), y, lse, 3, torch.float32, True))


def test_rope_frequencies_stay_fp32_when_the_model_is_cast_to_bf16():
    """model.to(bf16) used to cast the non-persistent inv_freq buffer too: 8 bits of mantissa made the
    angle position x inv_freq wrong by whole radians at positions in the thousands. The cast model's
    cos/sin must be those of the fp32 model, bit for bit (also after meta -> to_empty)."""
    from model import ModelConfig, Transformer
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, max_seq_len=4096)
    ref = Transformer(cfg)
    positions = torch.arange(4096)[None]
    cos_ref, sin_ref = ref.rotary(positions)
    bf = Transformer(cfg).to(torch.bfloat16)
    assert bf.rotary.inv_freq.dtype == torch.float32
    cos, sin = bf.rotary(positions)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    # what the bf16 buffer gave: far off at long positions (the bug this guards against)
    bad = positions[..., None].float() * ref.rotary.inv_freq.to(torch.bfloat16).float()
    assert (bad.cos()[:, :, None, :] - cos_ref).abs().max() > 0.5
    empty = Transformer(cfg).to("meta").to_empty(device="cpu")
    assert torch.equal(empty.rotary(positions)[0], cos_ref)


def test_the_compiled_forward_reads_rope_tables_instead_of_computing_them():
    """Without position_ids the model slices the cached cos/sin tables: the graph torch.compile captures
    holds no cos/sin op (Inductor fused their computation into every layer's RoPE kernel, forward and
    backward); with position_ids (packed samples) they are computed, and both give the same logits."""
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32))
    x = torch.randint(0, 64, (2, 16))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=capture, fullgraph=True)(x)
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_method" or n.op == "call_function"}
    assert graphs and not any("cos" in o or "sin" in o for o in ops), ops
    with_positions = model(x, position_ids=torch.arange(16)[None].expand(2, 16))
    torch.testing.assert_close(out, with_positions, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
