"""The model with its Triton kernels (kernel_backend="triton", run here in Triton's CPU interpreter)
agrees with the all-reference model, compiles with fullgraph=True (no graph break anywhere: norms,
RoPE, SwiGLU and the linear+CE are torch.library ops), and the per-device choice is what the docs say."""
import os

import pytest
import torch

pytest.importorskip("triton")

from model import ModelConfig, Transformer  # noqa: E402
from model import kernels  # noqa: E402

CPU = torch.device("cpu")
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="CPU Triton needs TRITON_INTERPRET=1 before triton is imported")
KW = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, multiple_of=16)
REF = dict(fused_rmsnorm=False, fused_rope=False, fused_swiglu=False, fused_qkv=False, fused_cross_entropy=False)


def _pair(**extra):
    torch.manual_seed(0)
    ref = Transformer(ModelConfig(**KW, **REF))
    tri = Transformer(ModelConfig(**KW, kernel_backend="triton", loss_chunk_size=8, **extra))
    tri.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, KW["vocab_size"], (2, 12), generator=g)
    y = torch.randint(0, KW["vocab_size"], (2, 12), generator=g)
    y[0, :3] = -100
    return ref, tri, x, y


def _loss_and_grads(model, x, y, params_of=None, **kw):
    params_of = params_of or model
    params_of.zero_grad(set_to_none=True)
    loss = model(x, labels=y, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in params_of.named_parameters()}


@needs_interpreter
def test_triton_model_matches_reference_model_fp32():
    ref, tri, x, y = _pair()
    assert kernels.choose("rms_norm", x.float(), "triton") == "triton"
    l_ref, g_ref = _loss_and_grads(ref, x, y)
    l_tri, g_tri = _loss_and_grads(tri, x, y)
    # fp32 both ways: differences are summation order only (a few ulps of the values involved)
    assert torch.allclose(l_tri, l_ref, rtol=1e-6, atol=1e-6)
    assert g_ref.keys() == g_tri.keys()  # a kernel switch never renames a parameter
    for n in g_ref:
        assert torch.allclose(g_tri[n], g_ref[n], rtol=1e-4, atol=1e-6), n


@needs_interpreter
def test_triton_model_packed_positions_match_reference():
    """Packed samples (position_ids restarting): RoPE reads per-sample cos/sin."""
    ref, tri, x, y = _pair()
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(12))])
    l_ref, g_ref = _loss_and_grads(ref, x, y, position_ids=pos)
    l_tri, g_tri = _loss_and_grads(tri, x, y, position_ids=pos)
    assert torch.allclose(l_tri, l_ref, rtol=1e-6, atol=1e-6)
    for n in g_ref:
        assert torch.allclose(g_tri[n], g_ref[n], rtol=1e-4, atol=1e-6), n


@needs_interpreter
def test_triton_model_under_half_autocast_matches_reference_model():
    """fp16 autocast over fp32 parameters (fp16, not bf16: the interpreter truncates fp32 -> bf16): the
    norms store their output in fp16 for the next matmul and the residual stream stays fp32. The Triton
    model's error against the fp32 reference may be at most 2x the reference model's own fp16 error
    (+ a floor of a few fp16 ulps of the value's scale)."""
    ref, tri, x, y = _pair()
    l32, g32 = _loss_and_grads(ref, x, y)
    with torch.autocast("cpu", dtype=torch.float16):
        l_ref, g_ref = _loss_and_grads(ref, x, y)
        l_tri, g_tri = _loss_and_grads(tri, x, y)
    floor = 4 * 2.0 ** -10
    assert abs(l_tri - l32) <= 2 * abs(l_ref - l32) + floor * abs(l32)
    for n in g32:
        scale = g32[n].abs().max().item()
        err_ref, err_tri = (g_ref[n] - g32[n]).abs().max().item(), (g_tri[n] - g32[n]).abs().max().item()
        assert err_tri <= 2 * err_ref + floor * scale, (n, err_tri, err_ref)


@needs_interpreter
def test_triton_model_compiles_fullgraph_and_matches_eager():
    """fullgraph=True raises on any graph break: the whole forward + loss is one graph."""
    _, tri, x, y = _pair()
    l_eager, g_eager = _loss_and_grads(tri, x, y)
    torch._dynamo.reset()
    compiled = torch.compile(tri, fullgraph=True, backend="aot_eager")
    l_comp, g_comp = _loss_and_grads(compiled, x, y, params_of=tri)
    assert torch.allclose(l_comp, l_eager, rtol=1e-6, atol=1e-6)
    for n in g_eager:
        assert torch.allclose(g_comp[n], g_eager[n], rtol=1e-5, atol=1e-7), n


def test_auto_choice_per_device():
    t = torch.empty(0, device=CPU)
    for op in ("rms_norm", "rope", "swiglu", "cross_entropy"):
        assert kernels.choose(op, t, "auto") == "torch"   # CPU: the hand-written autograd Functions
        assert kernels.choose(op, t, "torch") == "torch"
    with pytest.raises(ValueError, match="kernel_backend"):
        kernels.choose("rms_norm", t, "cuda-magic")
    line = kernels.describe_choice(CPU, "auto", compiled=False)
    assert "rms_norm autograd Function" in line and "cross_entropy chunked" in line
    assert kernels.describe_choice(CPU, "auto", compiled=False, fused=False).startswith("reference")


def test_model_config_rejects_unknown_backend():
    with pytest.raises(ValueError, match="kernel_backend"):
        ModelConfig(**KW, kernel_backend="fast")


@needs_interpreter
def test_trainer_triton_kernels_follow_reference_run(tmp_path, tiny_pretrain_run_args):
    """--fused_kernels=triton through the whole trainer (the Triton kernels in the interpreter here) gives
    the losses of --fused_kernels=false (plain PyTorch) to fp32 summation-order noise, and logs its choice."""
    from tests.conftest import PY, run_cmd
    from utils.metrics import read_metrics
    losses, logs = {}, {}
    for mode in ("false", "triton"):
        out = tmp_path / mode
        # the interpreter runs every Triton program in Python: 2 steps of 2 samples keep this ~20 s
        args = [a for a in tiny_pretrain_run_args if not a.startswith("--batch_size")]
        proc = run_cmd([PY, "train_my_ddp.py", *args, f"--out_dir={out}", "--max_iters=2", "--batch_size=2",
                        f"--fused_kernels={mode}"])
        logs[mode] = proc.stdout + proc.stderr
        losses[mode] = [r["loss"] for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r]
    assert len(losses["triton"]) == 2
    # 2 steps at lr 1e-2: fp32 rounding differences stay far below 1e-4 of the loss
    assert losses["triton"] == pytest.approx(losses["false"], rel=1e-4)
    assert "rms_norm Triton" in logs["triton"] and "reference PyTorch paths" in logs["false"]


def test_trainer_rejects_unknown_kernel_choice(tmp_path, tiny_pretrain_run_args):
    from tests.conftest import PY, ROOT, run_python
    proc = run_python([PY, "train_my_ddp.py", *tiny_pretrain_run_args, f"--out_dir={tmp_path / 'x'}",
                       "--max_iters=1", "--fused_kernels=fastest"], cwd=ROOT)
    assert proc.returncode == 2 and "--fused_kernels='fastest'" in proc.stderr + proc.stdout
