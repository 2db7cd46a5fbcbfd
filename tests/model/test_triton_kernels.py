"""Triton kernels (model/triton_norm.py, triton_rope.py, triton_swiglu.py) against the references in model/kernels.py.

On CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported),
at tiny odd sizes; the `gpu` tests run them at real sizes on CUDA.

Tolerances are derived, not tuned: each result is compared with the same math in fp64, and the
Triton error must be at most twice the error of the reference run in the same dtype, plus one unit
in the last place of the output's dtype at the output's scale (the Triton kernels round once, when
they store). In fp32 the allowance is 1e-5 of the scale.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # CPU tensors run in Triton's interpreter, chosen before the kernels are defined (tests/conftest.py
    # does the same); on a GPU machine the kernels compile for real and the CPU tests below skip
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from model import kernels  # noqa: E402
from model import triton_norm, triton_ops, triton_rope, triton_swiglu  # noqa: E402

CPU = torch.device("cpu")
LOW = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32,) + LOW

needs_interpreter = pytest.mark.skipif(
    not triton_ops.supported(torch.empty(0, device=CPU)),
    reason="CPU Triton tests need TRITON_INTERPRET=1 set before the Triton kernel modules are imported "
           "(only on machines without CUDA)")


# ----------------------------------------------------------------------------------------- helpers
def assert_derived_close(name: str, out: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor) -> None:
    """out (Triton) and ref (the reference in the same dtype) against truth (fp64): the Triton error is
    at most 2x the reference's own error + one ulp of out's dtype at the scale (1e-5 of it in fp32)."""
    assert out.shape == truth.shape, f"{name}: shape {tuple(out.shape)} != {tuple(truth.shape)}"
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != reference dtype {ref.dtype}"
    truth = truth.double()
    scale = truth.abs().max().item()
    err = (out.double() - truth).abs().max().item()
    ref_err = (ref.double() - truth).abs().max().item()
    ulp = 1e-5 if out.dtype == torch.float32 else torch.finfo(out.dtype).eps
    bound = 2 * ref_err + ulp * scale
    assert err <= bound, (f"{name} ({out.dtype}): error {err:.3e} > bound {bound:.3e} "
                          f"(reference error {ref_err:.3e}, scale {scale:.3e})")


def leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).requires_grad_(True)


def run_and_grad(fn, inputs: list[torch.Tensor], grads_out: list[torch.Tensor]):
    """fn(*inputs) -> tensor or tuple; backprop grads_out; returns (outputs, input grads)."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads_out)])
    return [o.detach() for o in outs], [i.grad for i in inputs]


def check_against_reference(name, triton_fn, ref_fn, inputs, grads_out, dtypes):
    """Forward and every input gradient of triton_fn vs ref_fn, in the inputs' dtypes (dtypes[i] per
    input) and in fp64 (the truth)."""
    ins = [leaf(x, d) for x, d in zip(inputs, dtypes)]
    outs, grads = run_and_grad(triton_fn, ins, grads_out)
    ref_ins = [leaf(x, d) for x, d in zip(inputs, dtypes)]
    ref_outs, ref_grads = run_and_grad(ref_fn, ref_ins, grads_out)
    t_ins = [leaf(x, torch.float64) for x in inputs]
    t_outs, t_grads = run_and_grad(ref_fn, t_ins, grads_out)
    for i, (o, r, t) in enumerate(zip(outs, ref_outs, t_outs)):
        assert_derived_close(f"{name} output {i}", o, r, t)
    for i, (g, r, t) in enumerate(zip(grads, ref_grads, t_grads)):
        assert g is not None, f"{name}: no gradient for input {i}"
        assert_derived_close(f"{name} grad of input {i}", g, r, t)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0):
    """cos/sin [B, T, 1, D/2] fp32 as model.rotary.RotaryEmbedding builds them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    ang = positions.float()[..., None] * inv_freq
    return ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]


def rope_pair_ref(q, k, cos, sin):
    return kernels.rope_ref(q, cos.to(q.dtype), sin.to(q.dtype)), kernels.rope_ref(k, cos.to(k.dtype), sin.to(k.dtype))


def add_rms_norm_ref(x, residual, weight, eps):
    h = x + residual
    return kernels.rms_norm_ref(h, weight, eps), h


# ------------------------------------------------------------------------------------------ basics
def test_supported_and_missing_triton(monkeypatch):
    assert triton_ops.TRITON_AVAILABLE
    assert triton_ops.supported(torch.empty(1, device=CPU)) == (os.environ.get("TRITON_INTERPRET") == "1" and triton_ops.INTERPRET)
    assert not triton_ops.supported(torch.empty(1, device="meta"))
    monkeypatch.setattr(triton_ops, "TRITON_AVAILABLE", False)
    assert not triton_ops.supported(torch.empty(1, device=CPU))
    with pytest.raises(RuntimeError, match="triton is not installed"):
        triton_norm.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)


@needs_interpreter
def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="weight shape"):
        triton_norm.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6)
    with pytest.raises(ValueError, match="must be even"):
        triton_rope.apply_rope(torch.ones(1, 2, 2, 5), torch.ones(1, 2, 1, 5), torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2))
    with pytest.raises(ValueError, match="same shape"):
        triton_swiglu.swiglu(torch.ones(2, 4), torch.ones(2, 3))


# ----------------------------------------------------------------------------------------- RMSNorm
@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
# D not a power of two, odd row counts; 300 rows: several programs of two 2-D tiles each in the backward, the last
# program's last tile partial
@pytest.mark.parametrize("shape", [(3, 5, 40), (7, 48), (300, 40)])
def test_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3 + 0.5
    w = 1 + 0.2 * torch.randn(shape[-1], generator=g)
    gy = torch.randn(shape, generator=g)
    check_against_reference("rms_norm", lambda x, w: triton_norm.rms_norm(x, w, 1e-6),
                            lambda x, w: kernels.rms_norm_ref(x, w, 1e-6), [x, w], [gy], [dtype, dtype])


@needs_interpreter
@pytest.mark.parametrize("dtype", LOW)
def test_rms_norm_low_precision_input_fp32_weight(dtype):
    """A low-precision activation with an fp32 weight gives an fp32 output, as the reference does."""
    g = torch.Generator().manual_seed(1)
    x, w, gy = torch.randn(5, 40, generator=g), 1 + 0.2 * torch.randn(40, generator=g), torch.randn(5, 40, generator=g)
    y = triton_norm.rms_norm(x.to(dtype), w, 1e-6)
    assert y.dtype == torch.float32
    check_against_reference("rms_norm mixed", lambda x, w: triton_norm.rms_norm(x, w, 1e-6),
                            lambda x, w: kernels.rms_norm_ref(x, w, 1e-6), [x, w], [gy], [dtype, torch.float32])


@needs_interpreter
def test_rms_norm_strided_rows():
    """A row-strided view (a slice of a wider matrix) is read in place, with the right result."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(6, 64, generator=g)
    x = base[:, 8:48]  # row stride 64, D = 40
    w, gy = torch.randn(40, generator=g), torch.randn(6, 40, generator=g)
    check_against_reference("rms_norm strided", lambda x, w: triton_norm.rms_norm(x, w, 1e-5),
                            lambda x, w: kernels.rms_norm_ref(x, w, 1e-5), [x, w], [gy], [None, None])


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(3)
    shape = (3, 5, 40)
    x, r = torch.randn(shape, generator=g), 2 * torch.randn(shape, generator=g)
    w = 1 + 0.2 * torch.randn(40, generator=g)
    gy, gh = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    check_against_reference("add_rms_norm", lambda x, r, w: triton_norm.add_rms_norm(x, r, w, 1e-6),
                            lambda x, r, w: add_rms_norm_ref(x, r, w, 1e-6), [x, r, w], [gy, gh], [dtype] * 3)
    assert_h_is_exact_add(x.to(dtype), r.to(dtype), w.to(dtype))


def assert_h_is_exact_add(x, r, w):
    """h is one fp32 add rounded once to x's dtype: bitwise torch's x + residual. Not checked for bf16
    in the CPU interpreter, whose fp32 -> bf16 cast truncates (compiled Triton rounds to nearest even)."""
    if x.dtype == torch.bfloat16 and not x.is_cuda:
        return
    _, h = triton_norm.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r)


@needs_interpreter
@pytest.mark.parametrize("dtype", LOW)
def test_add_rms_norm_low_precision_branch_fp32_residual(dtype):
    """Under autocast the branch output (x) is low precision and the residual stream fp32: h is the
    promoted fp32 sum, exactly torch's x + residual (the stream is never rounded to the branch's dtype),
    and each input's gradient comes back in that input's dtype."""
    g = torch.Generator().manual_seed(9)
    shape = (3, 5, 40)
    x, r = torch.randn(shape, generator=g), 2 * torch.randn(shape, generator=g)
    w = 1 + 0.2 * torch.randn(40, generator=g)
    gy, gh = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    xl, rf, wf = leaf(x, dtype), leaf(r), leaf(w)
    y, h = triton_norm.add_rms_norm(xl, rf, wf, 1e-6)
    assert h.dtype == y.dtype == torch.float32
    assert torch.equal(h, xl.detach() + r)
    torch.autograd.backward((y, h), (gy, gh))
    assert xl.grad.dtype == dtype and rf.grad.dtype == torch.float32
    check_against_reference("add_rms_norm mixed", lambda x, r, w: triton_norm.add_rms_norm(x, r, w, 1e-6),
                            lambda x, r, w: add_rms_norm_ref(x, r, w, 1e-6), [x, r, w], [gy, gh],
                            [dtype, torch.float32, torch.float32])


@needs_interpreter
@pytest.mark.parametrize("residual", [False, True])
def test_norm_out_dtype_is_the_reference_cast_once(residual):
    """out_dtype stores the reference's fp32 output in fp16 directly (what an autocast matmul would
    cast it to); the gradient arrives in fp16 and the input gradients match the reference's."""
    g = torch.Generator().manual_seed(10)
    x, r = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g)
    w = 1 + 0.2 * torch.randn(40, generator=g)
    gy = torch.randn(6, 40, generator=g).half()
    if residual:
        fn = lambda x, r, w: triton_norm.add_rms_norm(x, r, w, 1e-6, out_dtype=torch.float16)[0]  # noqa: E731
        ref = lambda x, r, w: add_rms_norm_ref(x, r, w, 1e-6)[0].half()  # noqa: E731
        inputs = [x, r, w]
    else:
        fn = lambda x, w: triton_norm.rms_norm(x, w, 1e-6, out_dtype=torch.float16)  # noqa: E731
        ref = lambda x, w: kernels.rms_norm_ref(x, w, 1e-6).half()  # noqa: E731
        inputs = [x, w]
    ins = [leaf(t) for t in inputs]
    out = fn(*ins)
    assert out.dtype == torch.float16
    ref_ins = [leaf(t) for t in inputs]
    ref_out = ref(*ref_ins)
    # the same fp32 values rounded once to fp16: at most one fp16 ulp apart (rstd may differ by an fp32 ulp)
    torch.testing.assert_close(out, ref_out, rtol=2 ** -10, atol=0)
    out.backward(gy)
    ref_out.backward(gy)
    for a, b in zip(ins, ref_ins):
        assert a.grad.dtype == b.grad.dtype
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5 * b.grad.abs().max().item())


@needs_interpreter
def test_add_rms_norm_only_normed_output_used():
    """When h gets no gradient, the backward still gives the norm's gradients (x and residual alike)."""
    g = torch.Generator().manual_seed(4)
    x, r = leaf(torch.randn(5, 48, generator=g)), leaf(torch.randn(5, 48, generator=g))
    w = leaf(torch.randn(48, generator=g))
    gy = torch.randn(5, 48, generator=g)
    y, _ = triton_norm.add_rms_norm(x, r, w, 1e-6)
    y.backward(gy)
    x2, r2, w2 = leaf(x), leaf(r), leaf(w)
    kernels.rms_norm_ref(x2 + r2, w2, 1e-6).backward(gy)
    for a, b in ((x.grad, x2.grad), (r.grad, r2.grad), (w.grad, w2.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


# -------------------------------------------------------------------------------------------- RoPE
def _rope_inputs(B, T, H, Hkv, D, per_sample: bool, device=CPU, seed=5):
    g = torch.Generator(device=device).manual_seed(seed)
    # q and k as views of one fused qkv matmul output: non-contiguous, row stride (H + 2 Hkv) * D
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g, device=device)
    if per_sample:  # packed samples: positions restart inside a row, differently per sample
        positions = torch.stack([torch.arange(T, device=device) % (3 + b) for b in range(B)])
    else:
        positions = torch.arange(T, device=device)[None] + 7
    cos, sin = rope_tables(positions, D)
    gq = torch.randn(B, T, H, D, generator=g, device=device)
    gk = torch.randn(B, T, Hkv, D, generator=g, device=device)
    return qkv, cos, sin, gq, gk


def _rope_check(name, B, T, H, Hkv, D, per_sample, dtype, device=CPU):
    qkv, cos, sin, gq, gk = _rope_inputs(B, T, H, Hkv, D, per_sample, device)

    def split(qkv):
        q, k, _ = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
        return q.view(B, T, H, D), k.view(B, T, Hkv, D)

    q0, k0 = split(qkv)
    assert not q0.is_contiguous() and not k0.is_contiguous()
    check_against_reference(name, lambda qkv: triton_rope.apply_rope(*split(qkv), cos, sin),
                            lambda qkv: rope_pair_ref(*split(qkv), cos, sin), [qkv], [gq, gk], [dtype])


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_sample", [False, True], ids=["broadcast_cos", "per_sample_cos"])
def test_rope_gqa_strided(dtype, per_sample):
    _rope_check("rope", B=2, T=5, H=4, Hkv=2, D=12, per_sample=per_sample, dtype=dtype)  # D/2 = 6: masked


@needs_interpreter
def test_rope_contiguous_inputs_and_strided_grads():
    """Contiguous leaf q/k, H = Hkv, and gradients arriving through a transpose (non-contiguous)."""
    g = torch.Generator().manual_seed(6)
    B, T, H, D = 1, 3, 3, 16
    q, k = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, D, generator=g)
    cos, sin = rope_tables(torch.arange(T)[None], D)
    gq = torch.randn(B, H, T, D, generator=g)

    def use(fn):
        def f(q, k):
            qo, ko = fn(q, k, cos, sin)
            return qo.transpose(1, 2), ko.transpose(1, 2)  # as attention consumes them
        return f

    check_against_reference("rope transposed", use(triton_rope.apply_rope), use(rope_pair_ref), [q, k], [gq, gq.flip(0)],
                            [None, None])


@needs_interpreter
def test_rope_is_a_rotation():
    """Forward then inverse (the backward op) gives the input back; norms of pairs are kept."""
    qkv, cos, sin, _, _ = _rope_inputs(2, 4, 2, 1, 8, per_sample=True)
    q, k = qkv[..., :16].reshape(2, 4, 2, 8), qkv[..., 16:24].reshape(2, 4, 1, 8)
    qo, ko = torch.ops.myllm.rope(q, k, cos, sin, False)
    qb, kb = torch.ops.myllm.rope(qo, ko, cos, sin, True)
    torch.testing.assert_close(qb, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kb, k, rtol=1e-5, atol=1e-5)
    pair_norm = lambda x: x[..., :4] ** 2 + x[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(qo), pair_norm(q), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ SwiGLU
@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 40), (2, 700)])  # 2 x 700: two blocks, the second masked
def test_swiglu(dtype, shape):
    g = torch.Generator().manual_seed(7)
    gate, up, gy = 3 * torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    check_against_reference("swiglu", triton_swiglu.swiglu, kernels.swiglu_ref, [gate, up], [gy], [dtype, dtype])


class _LaunchSpy:
    """Stands in for a Triton kernel (`kernel[grid](*args)`): records each launch's tensor arguments
    (data_ptr, strides) and integer arguments, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append([(a.data_ptr(), a.stride()) if isinstance(a, torch.Tensor) else a for a in args])
            return launch(*args, **kwargs)
        return run


def _copies_of(fn) -> int:
    """How many aten::contiguous / aten::clone calls fn() makes (the interpreter's own argument copies
    are aten::copy_ calls, not counted)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in ("aten::contiguous", "aten::clone") for e in prof.events())


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_reads_strided_gate_and_up_in_place(monkeypatch, dtype):
    """gate and up are the halves of one [B, T, 2H] matmul output (row stride 2H): the kernels read them
    where they are, forward and backward, with no copy (the launcher made 4 per layer with .contiguous())."""
    fwd, bwd = _LaunchSpy(triton_swiglu._swiglu_fwd_kernel), _LaunchSpy(triton_swiglu._swiglu_bwd_kernel)
    monkeypatch.setattr(triton_swiglu, "_swiglu_fwd_kernel", fwd)
    monkeypatch.setattr(triton_swiglu, "_swiglu_bwd_kernel", bwd)
    g = torch.Generator().manual_seed(12)
    B, T, H = 2, 3, 40
    fused, gy = 3 * torch.randn(B, T, 2 * H, generator=g), torch.randn(B, T, H, generator=g)
    x = leaf(fused, dtype)
    gate, up = x.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    out = {}

    def step():
        out["y"] = triton_swiglu.swiglu(gate, up)
        out["y"].backward(gy.to(dtype))
    assert _copies_of(step) == 0
    (g_arg, g_stride), (u_arg, u_stride) = fwd.launches[0][0], fwd.launches[0][1]
    assert (g_arg, u_arg) == (gate.data_ptr(), up.data_ptr()) and g_stride[0] == u_stride[0] == 2 * H
    (bg_arg, _), (bu_arg, _) = bwd.launches[0][1], bwd.launches[0][2]
    assert (bg_arg, bu_arg) == (gate.data_ptr(), up.data_ptr())
    # numerics: the output and the gradient of the fused tensor, against the reference and fp64
    ref_x = leaf(fused, dtype)
    ref_y = kernels.swiglu_ref(*ref_x.chunk(2, dim=-1))
    ref_y.backward(gy.to(dtype))
    t_x = leaf(fused, torch.float64)
    t_y = kernels.swiglu_ref(*t_x.chunk(2, dim=-1))
    t_y.backward(gy.double())
    assert_derived_close("swiglu strided output", out["y"], ref_y.detach(), t_y.detach())
    assert_derived_close("swiglu strided grad", x.grad, ref_x.grad, t_x.grad)


@needs_interpreter
def test_model_swiglu_gets_the_fused_gate_up_matmul_output_in_place(monkeypatch):
    """In the model (fused_qkv: one matmul for gate and up), every SwiGLU launch reads the matmul's
    output through its row stride 2 * hidden_dim: no copy of gate or up anywhere, forward or backward."""
    from model import ModelConfig, Transformer
    fwd, bwd = _LaunchSpy(triton_swiglu._swiglu_fwd_kernel), _LaunchSpy(triton_swiglu._swiglu_packed_bwd_kernel)
    monkeypatch.setattr(triton_swiglu, "_swiglu_fwd_kernel", fwd)
    monkeypatch.setattr(triton_swiglu, "_swiglu_packed_bwd_kernel", bwd)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=8, multiple_of=16,
                      kernel_backend="triton", loss_chunk_size=8)
    model = Transformer(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    model(x, labels=x).backward()
    assert len(fwd.launches) == len(bwd.launches) == cfg.n_layers
    for launch in fwd.launches:  # GATE, UP, Y, n_cols, g_stride, u_stride, y_stride
        assert launch[4] == launch[5] == 2 * cfg.hidden_dim and launch[1][0] - launch[0][0] == cfg.hidden_dim * 4
    for launch in bwd.launches:  # DY, GU, DGU, n_cols, dy_stride, gu_stride, dgu_stride: the packed backward
        # reads the matmul's output in place and writes both gradients into one [rows, 2H] buffer (no concatenation)
        assert launch[3] == cfg.hidden_dim and launch[5] == launch[6] == 2 * cfg.hidden_dim


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_packed_equals_the_halves_and_copies_nothing(dtype):
    """swiglu_packed(gate_up) == swiglu(*gate_up.chunk(2)) forward and backward (the gradient of the packed
    tensor), with no aten copy or concatenation: its backward writes the one [.., 2H] gradient."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(13)
    fused, gy = 3 * torch.randn(2, 3, 2 * 40, generator=g), torch.randn(2, 3, 40, generator=g)
    check_against_reference("swiglu packed", triton_swiglu.swiglu_packed, lambda gu: kernels.swiglu_ref(*gu.chunk(2, dim=-1)),
                            [fused], [gy], [dtype])
    x = leaf(fused, dtype)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        triton_swiglu.swiglu_packed(x).backward(gy.to(dtype))
    names = [e.name for e in prof.events()]
    assert not any(n in ("aten::cat", "aten::contiguous", "aten::clone") for n in names), names
    with pytest.raises(ValueError, match="2 x hidden"):
        triton_swiglu.swiglu_packed(torch.ones(2, 5))


# ----------------------------------------------------------------------------- torch.library checks
def _opcheck_cases(device=CPU):
    g = torch.Generator(device=device).manual_seed(8)
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    x, res, w = r(3, 40), r(3, 40), r(40)
    _, rstd = torch.ops.myllm.rms_norm(x, w, 1e-6)
    q, k = r(2, 3, 4, 8), r(2, 3, 2, 8)
    cos, sin = rope_tables(torch.arange(3, device=device)[None].expand(2, 3), 8)
    return [
        (torch.ops.myllm.rms_norm.default, (leaf(x), leaf(w), 1e-6)),
        (torch.ops.myllm.add_rms_norm.default, (leaf(x), leaf(res), leaf(w), 1e-6)),
        # autocast's layout: a half branch output on an fp32 residual stream, the norm stored in half
        (torch.ops.myllm.rms_norm.default, (leaf(x.half()), leaf(w), 1e-6, torch.float16)),
        (torch.ops.myllm.add_rms_norm.default, (leaf(x.half()), leaf(res), leaf(w), 1e-6, torch.float16)),
        (torch.ops.myllm.rms_norm_backward.default, (r(3, 40), None, x, w, rstd)),
        (torch.ops.myllm.rms_norm_backward.default, (r(3, 40), r(3, 40), x, w, rstd)),
        (torch.ops.myllm.rope.default, (leaf(q), leaf(k), cos, sin, False)),
        (torch.ops.myllm.rope.default, (leaf(q), leaf(k), cos[:1], sin[:1], True)),
        (torch.ops.myllm.swiglu.default, (leaf(r(3, 40)), leaf(r(3, 40)))),
        (torch.ops.myllm.swiglu.default, tuple(leaf(r(3, 80)).chunk(2, dim=-1))),  # strided: the model's layout
        (torch.ops.myllm.swiglu_backward.default, (r(3, 40), r(3, 40), r(3, 40))),
        (torch.ops.myllm.swiglu_backward.default, (r(3, 40), *r(3, 80).chunk(2, dim=-1))),
        (torch.ops.myllm.swiglu_packed.default, (leaf(r(3, 80)),)),
        (torch.ops.myllm.swiglu_packed_backward.default, (r(3, 40), r(3, 80))),
    ]


@needs_interpreter
def test_opcheck_every_op():
    cases = _opcheck_cases()
    assert {op._schema.name for op, _ in cases} == {
        "myllm::rms_norm", "myllm::add_rms_norm", "myllm::rms_norm_backward", "myllm::rope",
        "myllm::swiglu", "myllm::swiglu_backward", "myllm::swiglu_packed", "myllm::swiglu_packed_backward"}
    for op, args in cases:
        torch.library.opcheck(op, args)


def _all_ops(x, res, w, q, k, cos, sin, gate, up):
    y = triton_norm.rms_norm(x, w, 1e-6)
    y2, h = triton_norm.add_rms_norm(y, res, w, 1e-6)
    qo, ko = triton_rope.apply_rope(q, k, cos, sin)
    s = triton_swiglu.swiglu(gate, up)
    return y2.sum() + h.pow(2).sum() + (qo * qo.detach().sin()).sum() + ko.pow(2).sum() + s.pow(2).sum()


def _compile_matches_eager(backend: str, device=CPU):
    g = torch.Generator(device=device).manual_seed(9)
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    B, T, H, Hkv, D = 2, 3, 4, 2, 8
    cos, sin = rope_tables(torch.arange(T, device=device)[None], D)
    inputs = [r(B, T, 24), r(B, T, 24), r(24), r(B, T, H, D), r(B, T, Hkv, D), cos, sin, r(B, T, 40), r(B, T, 40)]
    differentiable = [0, 1, 2, 3, 4, 7, 8]
    eager_in = [leaf(t) if i in differentiable else t for i, t in enumerate(inputs)]
    loss = _all_ops(*eager_in)
    loss.backward()
    comp_in = [leaf(t) if i in differentiable else t for i, t in enumerate(inputs)]
    torch._dynamo.reset()
    compiled = torch.compile(_all_ops, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    closs = compiled(*comp_in)
    closs.backward()
    torch.testing.assert_close(closs, loss)
    for i in differentiable:
        torch.testing.assert_close(comp_in[i].grad, eager_in[i].grad)


@needs_interpreter
def test_torch_compile_fullgraph_matches_eager():
    _compile_matches_eager("aot_eager")


# --------------------------------------------------------------------------------------------- GPU
GPU = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_rms_norm_and_add(dtype):
    g = torch.Generator(device=GPU).manual_seed(10)
    shape = (8 * 1024, 2048)
    x, r = torch.randn(shape, generator=g, device=GPU), torch.randn(shape, generator=g, device=GPU)
    w = 1 + 0.2 * torch.randn(shape[-1], generator=g, device=GPU)
    gy, gh = torch.randn(shape, generator=g, device=GPU), torch.randn(shape, generator=g, device=GPU)
    check_against_reference("rms_norm", lambda x, w: triton_norm.rms_norm(x, w, 1e-6),
                            lambda x, w: kernels.rms_norm_ref(x, w, 1e-6), [x, w], [gy], [dtype, dtype])
    check_against_reference("add_rms_norm", lambda x, r, w: triton_norm.add_rms_norm(x, r, w, 1e-6),
                            lambda x, r, w: add_rms_norm_ref(x, r, w, 1e-6), [x, r, w], [gy, gh], [dtype] * 3)
    assert_h_is_exact_add(x.to(dtype), r.to(dtype), w.to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_sample", [False, True], ids=["broadcast_cos", "per_sample_cos"])
def test_gpu_rope(dtype, per_sample):
    _rope_check("rope", B=4, T=1024, H=16, Hkv=8, D=128, per_sample=per_sample, dtype=dtype, device=GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_swiglu(dtype):
    g = torch.Generator(device=GPU).manual_seed(11)
    shape = (4, 1024, 5504)
    gate, up, gy = (3 * torch.randn(shape, generator=g, device=GPU), torch.randn(shape, generator=g, device=GPU),
                    torch.randn(shape, generator=g, device=GPU))
    check_against_reference("swiglu", triton_swiglu.swiglu, kernels.swiglu_ref, [gate, up], [gy], [dtype, dtype])


@pytest.mark.gpu
def test_gpu_opcheck_every_op():
    for op, args in _opcheck_cases(GPU):
        torch.library.opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_gpu_torch_compile_fullgraph_matches_eager(backend):
    _compile_matches_eager(backend, GPU)


@needs_interpreter
def test_eager_calls_launch_kernels_directly_not_through_the_higher_order_op(monkeypatch):
    """On a GPU, an op body's launches go through torch.library.wrap_triton, which dispatches a higher-order
    op per launch (~1 ms in eager) unless wrap_triton is switched off, as the registered op does for itself.
    The eager path (_EagerOp) must switch it off too, forward and backward. The interpreter launches directly,
    so the GPU's launcher is stood in for: it records the switch at every launch."""
    from torch._library.triton import is_wrap_triton_enabled
    seen = []

    def launcher(kernel):
        seen.append(is_wrap_triton_enabled())
        return kernel
    monkeypatch.setattr(triton_ops, "INTERPRET", False)
    for mod in (triton_norm, triton_swiglu):  # the launcher each kernel module calls
        monkeypatch.setattr(mod, "launch", launcher)
    g = torch.Generator().manual_seed(14)
    x, w = leaf(torch.randn(6, 40, generator=g)), leaf(torch.randn(40, generator=g))
    y, h = triton_norm.add_rms_norm(x, leaf(torch.randn(6, 40, generator=g)), w, 1e-6)
    (triton_norm.rms_norm(y, w, 1e-6).sum() + triton_swiglu.swiglu_packed(leaf(torch.randn(6, 80, generator=g))).sum()
     + h.sum()).backward()
    assert len(seen) == 6 and not any(seen), seen  # 3 forward and 3 backward launches, none through the HOP
