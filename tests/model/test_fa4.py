"""FlashAttention-4 (model/fa4.py, the fa4 / fa4_varlen kinds of model/attention.py).

CPU: the choice with the machine faked by monkeypatching fa4's probes (CPU -> never; compute capability 8 ->
never; not installed / not importable / no FA4 in torch's registry -> the fallback and its reason in the start-up
line; forced where unusable -> a one-line error naming why), activation exactly once per process with "FA4",
the per-batch kinds, and the varlen wrapper's layout and cu_seqlens handling with torch's varlen_attn replaced by
a per-segment reference, compared with attention_ref under the document mask (GQA and not), forward and backward.
GPU (marked gpu; skipped unless CUDA sm90/sm100 with flash_attn.cute and torch's FA4 override): the model's
attention on FA4 against SDPA's math backend in bf16, dense, GQA and varlen, forward and backward, within 2x the
math backend's own bf16 error against fp32 (+ a floor); and a compiled model step with FA4 with zero graph breaks.
"""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer
from model import attention as A
from model import fa4

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, hidden_dim=96)
    base.update(kw)
    return ModelConfig(**base)


def fake_machine(monkeypatch, capability=(9, 0), found=True, impls=("FA3", "FA4"), import_error=None,
                 current=None, varlen_gqa=True):
    """fa4's probes answering as a machine with this GPU and these packages; returns the activation calls."""
    calls = []
    monkeypatch.setattr(fa4, "_STATE", {})
    monkeypatch.setattr(fa4, "accelerator_available", lambda: capability is not None)
    monkeypatch.setattr(fa4, "_registry_impls", lambda: list(impls))
    monkeypatch.setattr(fa4, "_cute_found", lambda: found)
    monkeypatch.setattr(fa4, "_cuda_ready", lambda: True)
    monkeypatch.setattr(fa4, "_capability", lambda: capability)

    def imp():
        if import_error:
            raise ImportError(import_error)
    monkeypatch.setattr(fa4, "_import_cute", imp)
    monkeypatch.setattr(fa4, "_current_impl", lambda: current)
    monkeypatch.setattr(fa4, "_activate", calls.append)
    monkeypatch.setattr(fa4, "_varlen_call", lambda: fa4.VarlenCall(segment_reference, {"window_size": (-1, 0)},
                                                                      varlen_gqa))
    return calls


# ------------------------------------------------------------------------------------- reference
def segment_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
    """torch's varlen_attn computed per cu_seqlens segment by attention_ref (causal; GQA materialised there).
    Asserts the call is what varlen_attn needs: [N, heads, D], int32 boundaries, Python ints, causal."""
    assert q.dim() == 3 and k.dim() == 3 and v.shape == k.shape and q.shape[0] == k.shape[0]
    assert cu_q.dtype == torch.int32 and cu_q is cu_k and isinstance(max_q, int) and max_q == max_k
    assert tuple(window_size) == (-1, 0) and enable_gqa == (q.shape[1] != k.shape[1])
    outs = []
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        assert e - s <= max_q
        qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, D]
        outs.append(A.attention_ref(qs, ks, vs, None)[0].transpose(0, 1))
    return torch.cat(outs)


ROWS = ([5, 4, 3], [7, 5])  # segment lengths per row of T = 12 (a row's padding is a segment of its own)
T = 12


def cu_seqlens() -> torch.Tensor:
    lengths = [n for row in ROWS for n in row]
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


# ------------------------------------------------------------------------------------------ choice
def test_cpu_never_uses_fa4(monkeypatch):
    calls = fake_machine(monkeypatch, capability=None)  # this machine as it is: no CUDA
    cfg = tiny()
    assert fa4.prepare(cfg) == "no CUDA device" and calls == []
    assert fa4.problem(cfg, CPU, torch.bfloat16) == "not a CUDA device (cpu)"
    # even where FA4 is active, a CPU batch never gets it
    calls = fake_machine(monkeypatch)
    assert fa4.prepare(cfg) is None and calls == ["FA4"]
    assert fa4.plan(cfg, CPU, torch.bfloat16, False) is None
    assert fa4.plan(cfg, CUDA, torch.bfloat16, False) is not None
    assert "FlashAttention-4" not in A.describe_attention(CPU, cfg, torch.bfloat16)


def test_compute_capability_8_never(monkeypatch):
    calls = fake_machine(monkeypatch, capability=(8, 0))
    cfg = tiny()
    why = fa4.prepare(cfg)
    assert calls == [] and why == "compute capability 8.0: FA4 runs on Hopper (9.x) and Blackwell (10.x)"
    assert fa4.plan(cfg, CUDA, torch.bfloat16, False) is None
    assert fa4.problem(cfg, CUDA, torch.bfloat16) == why


@pytest.mark.parametrize("machine, why", [
    (dict(found=False), "flash_attn.cute is not installed (the flash-attn-4 wheel: scripts/gpu_wheels.py)"),
    (dict(import_error="no module named cutlass"), "flash_attn.cute does not import: no module named cutlass"),
    (dict(impls=("FA3",)), f"torch {torch.__version__} has no FA4 in torch.nn.attention's flash-attention registry"),
])
def test_unusable_falls_back_and_the_start_up_line_says_why(monkeypatch, machine, why):
    calls = fake_machine(monkeypatch, **machine)
    cfg = tiny()
    assert fa4.prepare(cfg) == why and calls == []
    line = A.describe_attention(CUDA, cfg, torch.bfloat16)
    assert line.startswith("unmasked SDPA (is_causal, enable_gqa); packed/padded FlexAttention")
    assert line.endswith(f"(FlashAttention-4 not used: {why})")
    # turned off: no reason given, nothing activated
    assert "FlashAttention-4" not in A.describe_attention(CUDA, tiny(fa4="false"), torch.bfloat16)


def test_describe_names_fa4_when_in_use(monkeypatch):
    fake_machine(monkeypatch)
    cfg = tiny()
    fa4.prepare(cfg)
    line = A.describe_attention(CUDA, cfg, torch.bfloat16)
    assert line.startswith("unmasked FlashAttention-4 (SDPA, flash backend only); packed/padded FlexAttention")
    assert line.endswith("; packed batches with cu_seqlens: FlashAttention-4 (varlen_attn)")
    assert "FlashAttention-4" not in A.describe_attention(CUDA, cfg, torch.float32).split(";")[0]
    fake_machine(monkeypatch, varlen_gqa=False)  # a torch whose varlen_attn has no enable_gqa: GQA falls back
    fa4.prepare(cfg)
    assert A.describe_attention(CUDA, cfg, torch.bfloat16).endswith(
        "; packed batches with cu_seqlens: as packed/padded (FA4 varlen: this torch's varlen_attn has no enable_gqa)")


def test_forced_where_unusable_is_an_error_naming_why(monkeypatch):
    fake_machine(monkeypatch, capability=None)
    m = Transformer(tiny(fa4="true"))  # building never raises: the device and dtype are not known yet
    with pytest.raises(ValueError, match=r"^fa4=true \(--fa4=true\) but FlashAttention-4 cannot run here: "
                                         r"not a CUDA device \(cpu\)$"):
        m(torch.zeros(1, 4, dtype=torch.long))
    fake_machine(monkeypatch, capability=(8, 9))
    cfg = tiny(fa4="true")
    fa4.prepare(cfg)
    assert fa4.forced_error(cfg, CUDA, torch.bfloat16).endswith("cannot run here: compute capability 8.9: FA4 runs "
                                                               "on Hopper (9.x) and Blackwell (10.x)")
    fake_machine(monkeypatch)
    fa4.prepare(cfg)
    assert fa4.forced_error(cfg, CUDA, torch.bfloat16) is None
    assert fa4.forced_error(cfg, CUDA, torch.float32).endswith("cannot run here: float32 compute (FA4 runs fp16/bf16)")
    assert fa4.forced_error(tiny(), CUDA, torch.float32) is None  # auto falls back quietly
    with pytest.raises(ValueError, match="fa4 must be auto, true or false, got 'yes'"):
        tiny(fa4="yes")


def test_activated_exactly_once_and_never_when_off(monkeypatch):
    calls = fake_machine(monkeypatch)
    Transformer(tiny(fa4="false"))
    Transformer(tiny(attn_dropout=0.1))  # FA4 has no dropout: this model would not use it
    assert calls == []
    Transformer(tiny())
    Transformer(tiny(fa4="true"))
    assert calls == ["FA4"]
    calls = fake_machine(monkeypatch, current="FA4")  # already active (the user or another library did it)
    Transformer(tiny())
    assert calls == [] and fa4.problem(tiny(), CUDA, torch.bfloat16) is None


def test_checked_when_the_model_reaches_the_gpu(monkeypatch):
    """A model built on the CPU of a GPU machine queries nothing (CUDA stays uninitialised); moving it (any
    `_apply`: .to, .cuda, to_empty) asks again, and then FA4 is activated."""
    calls = fake_machine(monkeypatch)
    ready = [False]
    monkeypatch.setattr(fa4, "_cuda_ready", lambda: ready[0])
    monkeypatch.setattr(fa4, "_capability", lambda: pytest.fail("the GPU was queried before CUDA was initialised"))
    m = Transformer(tiny())
    assert calls == [] and fa4.prepare(m.cfg).startswith("CUDA not initialised")
    assert fa4.plan(m.cfg, CUDA, torch.bfloat16, False) is None
    ready[0] = True
    monkeypatch.setattr(fa4, "_capability", lambda: (10, 0))
    m.to(torch.float32)  # stands for .to("cuda") here
    assert calls == ["FA4"] and fa4.problem(m.cfg, CUDA, torch.bfloat16) is None
    m.float()
    assert calls == ["FA4"]
    # the trainer's start and the start-up line ask for a model that will run on the GPU: checked right away
    calls = fake_machine(monkeypatch)
    monkeypatch.setattr(fa4, "_cuda_ready", lambda: False)
    assert fa4.problem(tiny(), CUDA, torch.bfloat16) is None and calls == ["FA4"]


def test_head_dims_fa4_compiles(monkeypatch):
    fake_machine(monkeypatch, capability=(10, 0))
    assert fa4.prepare(tiny()) is None  # head_dim 16
    assert fa4.model_problem(192, 0.0) == "head_dim 192 (FA4 on sm10x: multiples of 8 up to 128)"
    assert fa4.model_problem(256, 0.0) is None and fa4.model_problem(128, 0.0) is None
    fake_machine(monkeypatch, capability=(9, 0))
    fa4.prepare(tiny())
    assert fa4.model_problem(192, 0.0) is None and fa4.model_problem(100, 0.0) is not None


def test_batch_kinds_with_fa4_active():
    B = 2
    pos = torch.arange(T)[None].expand(B, T)
    am = torch.ones(B, T, dtype=torch.long)
    cu = cu_seqlens()
    call = fa4.VarlenCall(segment_reference, {"window_size": (-1, 0)}, True)
    plan = fa4.FA4Plan(call)
    flash = (lambda *a, **k: None, lambda *a, **k: None)

    def kind(**kw):
        return A.build_spec(B, T, pos, **kw).kind
    assert kind(fa4=plan) == "fa4"
    assert kind(fa4=plan, flash=flash) == "fa4"  # FA4 wins over flash-attn 2
    spec = A.build_spec(B, T, pos, fa4=plan, cu_seqlens=cu, max_seqlen=7, gqa=True)
    assert spec.kind == "fa4_varlen" and spec.varlen is call and spec.max_seqlen == 7
    assert spec.cu_seqlens.dtype == torch.int32
    assert kind(fa4=plan, position_ids_given=True) == "sdpa_masked"  # documents without cu_seqlens: the masks
    assert kind(fa4=plan, attention_mask=am) == "sdpa_masked"
    assert kind(fa4=plan, past=0) == "sdpa"  # the KV cache keeps SDPA
    assert kind(fa4=plan, backend="sdpa") == "sdpa"
    with pytest.raises(ValueError, match="max_seqlen"):
        kind(fa4=plan, cu_seqlens=cu)
    # a varlen_attn without enable_gqa: a GQA model's packed batches take flash-attn 2 varlen, else the masks
    nogqa = fa4.FA4Plan(fa4.VarlenCall(segment_reference, {"is_causal": True}, False))
    assert kind(fa4=nogqa, cu_seqlens=cu, max_seqlen=7, gqa=False) == "fa4_varlen"
    assert kind(fa4=nogqa, cu_seqlens=cu, max_seqlen=7, gqa=True, flash=flash) == "flash_varlen"
    assert kind(fa4=nogqa, cu_seqlens=cu, max_seqlen=7, gqa=True) == "sdpa_masked"
    assert kind(fa4=fa4.FA4Plan(None), cu_seqlens=cu, max_seqlen=7) == "sdpa_masked"  # no varlen_attn in torch


def test_trainer_flag(tmp_path, tiny_pretrain_run_args):
    """--fa4 reaches the new model's config; =true where FA4 cannot run is exit 2 with one line naming why; a value
    outside auto|true|false is the pre-check's exit 2."""
    from tests.conftest import run_trainer, train_cmd
    from trainer.config import TrainConfig
    from trainer.start import new_model_config
    assert new_model_config(TrainConfig(fa4="false"), {"vocab_size": 128}).fa4 == "false"
    assert new_model_config(TrainConfig(), {"vocab_size": 128}).fa4 == "auto"
    for i, (flag, msg) in enumerate([
            ("--fa4=true", "fa4=true (--fa4=true) but FlashAttention-4 cannot run here: not a CUDA device (cpu)"),
            ("--fa4=maybe", "--fa4='maybe' (auto | true | false)")]):
        proc = run_trainer(train_cmd([*tiny_pretrain_run_args, flag, "--max_iters=1", f"--out_dir={tmp_path / str(i)}"]))
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and msg in err[0], proc.stderr[-2000:]


# --------------------------------------------------------------------------------- varlen wrapper
@pytest.mark.parametrize("hkv", [4, 2])
def test_varlen_wrapper_equals_document_masked_reference(hkv):
    """attention.flash_attention's fa4_varlen path (model layout [B, T, H, D] flattened to [B*T, H, D]) with the
    kernel replaced by the per-segment reference equals attention_ref under the dense document mask, forward and
    backward (the reshapes, the boundaries and the GQA flag are what is checked)."""
    B, H, D = 2, 4, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (H, hkv, hkv))
    cu = cu_seqlens()
    spec = A.build_spec(B, T, torch.zeros(B, T), cu_seqlens=cu, max_seqlen=max(max(r) for r in ROWS), gqa=hkv != H,
                        fa4=fa4.FA4Plan(fa4.VarlenCall(segment_reference, {"window_size": (-1, 0)}, True)))
    assert spec.kind == "fa4_varlen"
    y = A.flash_attention(q, k, v, spec)
    docs = A.documents_from_cu_seqlens(cu, B, T)
    ref = A.attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          A.dense_mask(T, 0, CPU, docs)).transpose(1, 2)
    assert y.shape == (B, T, H, D)
    assert torch.allclose(y, ref, atol=1e-12)
    go = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(y, (q, k, v), go)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-12)


def test_model_runs_fa4_kinds_and_matches_sdpa(monkeypatch):
    """The model with FA4's plan faked on CPU: plain batches run SDPA restricted to the flash backend (the CPU's
    flash kernel stands in for FA4's), packed batches with cu_seqlens the varlen wrapper (the per-segment
    reference); logits and gradients equal the model's own SDPA paths, and the plain path traces without a break."""
    torch.manual_seed(0)
    m = Transformer(tiny())
    x = torch.randint(0, 128, (2, T))
    cu = cu_seqlens()
    pos = torch.cat([torch.cat([torch.arange(n) for n in row]) for row in ROWS]).view(2, T)
    calls = []

    def ref(*a, **k):
        calls.append("varlen")
        return segment_reference(*a, **k)
    kinds = []
    build = A.build_spec
    monkeypatch.setattr(A, "build_spec", lambda *a, **k: kinds.append(build(*a, **k).kind) or build(*a, **k))

    def run(**kw):
        m.zero_grad(set_to_none=True)
        out = m(x, **kw)
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}
    base_plain, g_plain = run()
    base_packed, g_packed = run(position_ids=pos)
    monkeypatch.setattr(fa4, "plan", lambda cfg, device, dtype, dropout: fa4.FA4Plan(
        fa4.VarlenCall(ref, {"window_size": (-1, 0)}, True)))
    plain, g2_plain = run()
    packed, g2_packed = run(position_ids=pos, cu_seqlens=cu, max_seqlen=7)
    assert kinds == ["sdpa", "sdpa_masked", "fa4", "fa4_varlen"] and calls == ["varlen"] * 2
    assert torch.allclose(plain, base_plain, atol=1e-5) and torch.allclose(packed, base_packed, atol=1e-5)
    for n in g_plain:
        assert torch.allclose(g2_plain[n], g_plain[n], atol=1e-5, rtol=1e-4), n
        assert torch.allclose(g2_packed[n], g_packed[n], atol=1e-5, rtol=1e-4), n
    torch._dynamo.reset()
    explain = torch._dynamo.explain(m)(x)
    assert explain.graph_break_count == 0, explain.break_reasons


# ---------------------------------------------------------------------------------------------- GPU
def _fa4_runs() -> bool:
    """FA4 can run in this process (probed once, as the model does)."""
    return torch.cuda.is_available() and fa4.machine_problem(on_gpu=True) is None


# evaluated when a test is set up, never at collection (the CPU suite queries no device)
needs_fa4 = pytest.mark.skipif("not _fa4_runs()", reason="needs CUDA sm90/sm100 with flash-attn-4 and torch's FA4 "
                               "override (model/fa4.py machine_problem)")


class _CountFA4:
    """Counts calls of torch's FA4 override (torch/nn/attention/_fa4.py looks its runners up at call time; a torch
    whose override is laid out otherwise counts nothing and `ran` relies on the registry's word alone)."""

    def __init__(self, monkeypatch):
        from torch.nn.attention import _fa4, current_flash_attention_impl
        assert current_flash_attention_impl() == "FA4"
        self.fwd = self.bwd = 0
        self.counting = hasattr(_fa4, "_fa4_run_forward") and hasattr(_fa4, "_fa4_run_backward")
        if not self.counting:
            return
        run_fwd, run_bwd = _fa4._fa4_run_forward, _fa4._fa4_run_backward

        def fwd(*a, **k):
            self.fwd += 1
            return run_fwd(*a, **k)

        def bwd(*a, **k):
            self.bwd += 1
            return run_bwd(*a, **k)
        monkeypatch.setattr(_fa4, "_fa4_run_forward", fwd)
        monkeypatch.setattr(_fa4, "_fa4_run_backward", bwd)

    def ran(self, n: int = 1) -> bool:
        return not self.counting or (self.fwd >= n and self.bwd >= n)


def _math(q, k, v, mask=None):
    """SDPA's math backend on [B, T, H, D] tensors (GQA by enable_gqa), the bf16 baseline and the fp32 reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        y = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            enable_gqa=q.shape[2] != k.shape[2])
    return y.transpose(1, 2)


def _check_against_math(fn, shape_q, hkv, mask=None):
    """fn(q, k, v) in bf16 [B, T, H, D] vs SDPA math: output and q/k/v gradients within 2x the math backend's own
    bf16 error against the fp32 math result, + a floor of half a bf16 ulp of each tensor's scale (2^-8 of its
    largest value) per rounding the kernel may add: one for the output and dq; for dk and dv one per query head of
    a kv group (H / hkv: a kernel may round each head's part before summing them; torch's CPU flash kernel does,
    and at the GQA shape its dv lands at 0.096 where math's error is 0.030 and the tensor's largest value 9.5)."""
    B, Tq, H, D = shape_q
    g = torch.Generator(device=CUDA).manual_seed(0)
    x32 = [torch.randn(B, Tq, h, D, generator=g, device=CUDA) for h in (H, hkv, hkv)]
    go32 = torch.randn(B, Tq, H, D, generator=g, device=CUDA)

    def run(f, dtype):
        xs = [t.to(dtype).requires_grad_() for t in x32]
        y = f(*xs)
        grads = torch.autograd.grad(y, xs, go32.to(dtype))
        return [t.float() for t in (y, *grads)]
    ref = run(lambda *a: _math(*a, mask), torch.float32)
    base = run(lambda *a: _math(*a, mask), torch.bfloat16)
    got = run(fn, torch.bfloat16)
    for name, r, b, o in zip(("out", "dq", "dk", "dv"), ref, base, got):
        err_base, err = (b - r).abs().max().item(), (o - r).abs().max().item()
        roundings = H // hkv if name in ("dk", "dv") else 1
        assert err <= 2 * err_base + roundings * 2.0 ** -8 * r.abs().max().item(), (name, err, err_base)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("shape_q, hkv", [((2, 1024, 12, 64), 12), ((2, 1024, 16, 128), 4)])
def test_gpu_fa4_dense_matches_sdpa_math(monkeypatch, shape_q, hkv):
    fa4.prepare(tiny(dim=shape_q[2] * shape_q[3], n_heads=shape_q[2], n_kv_heads=hkv))
    counted = _CountFA4(monkeypatch)
    spec = A.AttnSpec("fa4")
    _check_against_math(lambda q, k, v: A.sdpa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         spec).transpose(1, 2), shape_q, hkv)
    assert counted.ran(), (counted.fwd, counted.bwd)  # FA4 ran, not flash-attn 2 / cuDNN


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("hkv", [12, 4])
def test_gpu_fa4_varlen_matches_sdpa_math_with_document_mask(monkeypatch, hkv):
    fa4.prepare(tiny(dim=768, n_heads=12, n_kv_heads=hkv))
    plan = fa4.plan(tiny(dim=768, n_heads=12, n_kv_heads=hkv), CUDA, torch.bfloat16, False)
    assert plan is not None
    call = plan.varlen
    if call is None or (hkv != 12 and not call.gqa):
        pytest.skip(f"this torch's varlen_attn cannot take this batch ({call})")
    counted = _CountFA4(monkeypatch)
    B, Tr = 2, 1024
    lengths = [[300, 500, 224], [1000, 24]]
    cu = torch.tensor([0] + torch.tensor([n for r in lengths for n in r]).cumsum(0).tolist(), dtype=torch.int32,
                      device=CUDA)
    spec = A.AttnSpec("fa4_varlen", cu_seqlens=cu, max_seqlen=1000, varlen=call)
    mask = A.dense_mask(Tr, 0, CUDA, A.documents_from_cu_seqlens(cu, B, Tr))
    _check_against_math(lambda q, k, v: A.flash_attention(q, k, v, spec), (B, Tr, 12, 64), hkv, mask)
    assert counted.ran(), (counted.fwd, counted.bwd)


@pytest.mark.gpu
@needs_fa4
def test_gpu_compiled_step_with_fa4_has_no_graph_break(monkeypatch):
    cfg = ModelConfig(vocab_size=32000, dim=512, n_layers=2, n_heads=8, n_kv_heads=4, max_seq_len=512)
    torch.manual_seed(0)
    model = Transformer(cfg).to(CUDA)
    assert fa4.problem(cfg, CUDA, torch.bfloat16) is None
    counted = _CountFA4(monkeypatch)
    x = torch.randint(0, cfg.vocab_size, (2, 512), device=CUDA)
    y = torch.cat((x[:, 1:], torch.full((2, 1), -100, device=CUDA)), dim=1)
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explain = torch._dynamo.explain(model)(x, labels=y)
        assert explain.graph_break_count == 0, explain.break_reasons
        compiled = torch.compile(model, fullgraph=True)
        loss = compiled(x, labels=y)
        loss.backward()
        eager = model(x, labels=y)
    assert counted.ran(2), (counted.fwd, counted.bwd)
    assert torch.isfinite(loss) and abs(loss.item() - eager.item()) <= 2.0 ** -6 * abs(eager.item())
