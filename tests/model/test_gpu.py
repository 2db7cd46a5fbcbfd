"""GPU-only checks (`make test-gpu`; skipped without CUDA): a bf16 train step with each Triton kernel
against the all-reference model, torch.compile(fullgraph=True) of the whole model with zero graph
breaks, and the trainer on CUDA (bf16, fp16, --compile, --gradient_checkpointing, ZeRO on NCCL at world
size 1). Kernel numerics at real sizes live in tests/model/test_triton_kernels.py and tests/model/test_triton_loss.py.

Tolerances are derived in the same run: the bf16 model with a kernel is compared with the bf16
all-reference model, and both with the fp32 all-reference model; the kernel's error against fp32 may
be at most 2x the reference's own bf16 error (+ a floor of a few bf16 ulps of the value's scale)."""
import os

import pytest
import torch

from tests.conftest import PY, run_cmd
from utils.metrics import read_metrics

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
KW = dict(vocab_size=32000, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=512)
SWITCHES = ("fused_rmsnorm", "fused_rope", "fused_swiglu", "fused_cross_entropy")
ALL_OFF = {s: False for s in SWITCHES} | {"fused_qkv": False}


def _model(**over):
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    return Transformer(ModelConfig(**KW, **over)).to(CUDA)


def _step(model, x, y, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        loss = model(x, labels=y)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def _batch(device=CUDA):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, KW["vocab_size"], (4, 512), generator=g)
    y = torch.cat((x[:, 1:], torch.full((4, 1), -100)), dim=1)
    return x.to(device), y.to(device)


@pytest.mark.parametrize("switch", SWITCHES)
def test_bf16_train_step_with_one_triton_kernel_matches_reference(switch):
    x, y = _batch()
    l32, g32 = _step(_model(**ALL_OFF), x, y, torch.float32)
    l_ref, g_ref = _step(_model(**ALL_OFF), x, y, torch.bfloat16)
    over = dict(ALL_OFF, **{switch: True}, kernel_backend="triton")
    l_k, g_k = _step(_model(**over), x, y, torch.bfloat16)
    floor = 2.0 ** -8
    assert abs(l_k - l32) <= 2 * abs(l_ref - l32) + floor * abs(l32)
    for n in g32:
        scale = g32[n].abs().max().item()
        err_ref = (g_ref[n] - g32[n]).abs().max().item()
        err_k = (g_k[n] - g32[n]).abs().max().item()
        assert err_k <= 2 * err_ref + floor * scale, (switch, n, err_k, err_ref)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_whole_model_compiles_with_zero_graph_breaks(backend):
    model = _model(kernel_backend=backend)
    x, y = _batch()
    torch._dynamo.reset()
    explain = torch._dynamo.explain(model)(x, labels=y)
    assert explain.graph_break_count == 0, explain.break_reasons
    eager, _ = _step(model, x, y, torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    l_c, _ = _step(compiled, x, y, torch.bfloat16)
    assert abs(l_c - eager) <= 2.0 ** -6 * abs(eager)  # same math, Inductor's fusion rounds differently


def test_triton_kernels_are_chosen_on_cuda():
    from model import kernels
    t = torch.empty(0, device=CUDA)
    for op in ("rms_norm", "rope", "swiglu", "cross_entropy"):
        assert kernels.choose(op, t, "auto") == "triton"
    assert "Triton" in kernels.describe_choice(CUDA, "auto", compiled=False)


@pytest.mark.parametrize("extra", [
    ["--dtype=bf16"],
    ["--dtype=fp16"],
    ["--dtype=bf16", "--compile=true"],
    ["--dtype=bf16", "--gradient_checkpointing=true"],
])
def test_trainer_on_cuda(tmp_path, tiny_pretrain_run_args, extra):
    args = [a for a in tiny_pretrain_run_args if not a.startswith("--device=")]
    out = tmp_path / "run"
    run_cmd([PY, "train_my_ddp.py", *args, "--device=cuda", f"--out_dir={out}", "--max_iters=6", *extra])
    recs = read_metrics(os.path.join(out, "metrics.jsonl"))
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) >= 6 and all(l == l for l in losses)  # finite (NaN != NaN)
    assert losses[-1] < losses[0]  # lr 1e-2 on a tiny model: the loss falls within 6 steps


def test_trainer_zero_on_nccl_world_1(tmp_path, tiny_pretrain_run_args):
    args = [a for a in tiny_pretrain_run_args if not a.startswith("--device=")]
    out = tmp_path / "run"
    run_cmd([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_my_ddp.py", *args,
             "--device=cuda", "--dtype=bf16", "--use_distributed_optimizer=true", f"--out_dir={out}",
             "--max_iters=4"])
    assert (out / "checkpoints").is_dir()


MLA_KW = dict(KW, n_kv_heads=None, kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=64, qk_rope_head_dim=32,
              v_head_dim=64)  # (DeepSeek-V3's proportions at dim 512: values narrower than the keys)


def _mla_step(backend: str, dtype, position_ids=None, device=CUDA):
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MLA_KW)).to(device)
    model.attn_backend = backend
    x, y = _batch(device)
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(x, labels=y, position_ids=position_ids)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend,packed", [("auto", False), ("flex", True)], ids=["auto-causal", "flex-packed"])
def test_latent_attention_through_the_padded_kernels_follows_sdpa_in_bf16(backend, packed, device=CUDA):
    """Multi-head latent attention (model/mla.py) on the GPU: the kernels that need one head width (FlashAttention-4
    where `auto` picks it, flash-attn 2, FlexAttention on packed documents) get its values zero-padded; their bf16
    loss and gradients may be at most 2x SDPA's own bf16 error from the fp32 SDPA model (+ a bf16 floor)."""
    pos = torch.cat((torch.arange(200), torch.arange(312)))[None].expand(4, 512).to(device) if packed else None
    l32, g32 = _mla_step("sdpa", torch.float32, pos, device)
    l_ref, g_ref = _mla_step("sdpa", torch.bfloat16, pos, device)
    l_k, g_k = _mla_step(backend, torch.bfloat16, pos, device)
    floor = 2.0 ** -8
    assert abs(l_k - l32) <= 2 * abs(l_ref - l32) + floor * abs(l32)
    for n in g32:
        scale = g32[n].abs().max().item()
        err_ref, err_k = (g_ref[n] - g32[n]).abs().max().item(), (g_k[n] - g32[n]).abs().max().item()
        assert err_k <= 2 * err_ref + floor * scale, (backend, n, err_k, err_ref)


@pytest.mark.parametrize("windowed", [False, True], ids=["causal", "window-128"])
def test_soft_capped_flex_attention_on_the_gpu_is_as_close_to_fp64_as_plain_sdpa(windowed, device=CUDA):
    """Gemma 2's capped scores through FlexAttention's score_mod (compiled once per process, model/attention.py
    softcap_score_mod), GQA, causal or windowed, in bf16: its output and the gradients of q, k, v within 2x plain
    SDPA's own bf16 error from their fp64 truths (the scores capped, written out) + a bf16 floor."""
    from model.attention import AttnSpec, attention_ref, block_mask, dense_mask, flex_attention_, sdpa_attention
    from model.attention import softcap_score_mod
    g = torch.Generator(device=device).manual_seed(0)
    B, H, Hkv, T, D, cap = 2, 8, 2, 512, 64, 1.0
    q, k, v = (torch.randn(B, h, T, D, generator=g, device=device, dtype=torch.float64) for h in (H, Hkv, Hkv))
    mask = dense_mask(T, 0, device, window=128 if windowed else 0)
    flex = AttnSpec("flex", block_mask=block_mask(B, T, device, None, None, 128 if windowed else 0))
    sdpa = AttnSpec("sdpa_masked", is_causal=False, mask=mask)
    w = torch.randn(B, H, T, D, generator=g, device=device, dtype=torch.float64)

    def run(fn, dtype):
        ins = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        (out.double() * w).sum().backward()
        return [out.double()] + [t.grad.double() for t in ins]

    truth = run(lambda a, b, c: attention_ref(a, b, c, mask, cap=cap), torch.float64)
    plain_truth = run(lambda a, b, c: attention_ref(a, b, c, mask), torch.float64)
    got = run(lambda a, b, c: flex_attention_(a, b, c, flex, softcap_score_mod(cap)), torch.bfloat16)
    plain = run(lambda a, b, c: sdpa_attention(a, b, c, sdpa), torch.bfloat16)
    floor = 2.0 ** -8
    rel = [((p - t).abs().max() / t.abs().max()).item() for p, t in zip(plain, plain_truth)]
    for i, (t, x) in enumerate(zip(truth, got)):
        err, scale = (x - t).abs().max().item(), t.abs().max().item()
        assert err <= (2 * rel[i] + floor) * scale, (i, err, rel, scale)


@pytest.mark.parametrize("windowed", [False, True], ids=["causal", "window-128"])
def test_sink_attention_on_the_gpu_is_as_close_to_fp64_as_plain_sdpa(windowed, device=CUDA):
    """gpt-oss's attention sinks (model/attention.py sink_attention: one extra key through SDPA, values padded to the
    keys' width on CUDA) in bf16: its output and gradients (q, k, v, sinks) within 2x plain SDPA's own bf16 error
    from their fp64 truths (+ a bf16 floor)."""
    from model.attention import AttnSpec, attention_ref, dense_mask, sdpa_attention, sink_attention
    g = torch.Generator(device=device).manual_seed(0)
    B, H, Hkv, T, D = 2, 8, 2, 512, 64
    q, k, v = (torch.randn(B, h, T, D, generator=g, device=device, dtype=torch.float64) for h in (H, Hkv, Hkv))
    sinks = torch.randn(H, generator=g, device=device, dtype=torch.float64)
    mask = dense_mask(T, 0, device, window=128) if windowed else None
    spec = AttnSpec("sdpa_masked", is_causal=False, mask=mask) if windowed else AttnSpec("sdpa", is_causal=True)
    w = torch.randn(B, H, T, D, generator=g, device=device, dtype=torch.float64)

    def run(fn, dtype, with_sinks):
        ins = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
        out = fn(*ins) if with_sinks else fn(*ins[:3])
        (out.double() * w).sum().backward()
        return [out.double()] + [t.grad.double() for t in ins[:3 + with_sinks]]

    truth = run(lambda a, b, c, s=None: attention_ref(a, b, c, mask, s), torch.float64, True)
    plain_truth = run(lambda a, b, c: attention_ref(a, b, c, mask), torch.float64, False)
    got = run(lambda a, b, c, s: sink_attention(a, b, c, spec, s), torch.bfloat16, True)
    plain = run(lambda a, b, c: sdpa_attention(a, b, c, spec), torch.bfloat16, False)
    floor = 2.0 ** -8
    rel = [((p - t).abs().max() / t.abs().max()).item() for p, t in zip(plain, plain_truth)]
    for i, (t, x) in enumerate(zip(truth, got)):  # (the sinks' gradient: plain SDPA's worst relative error)
        err, scale = (x - t).abs().max().item(), t.abs().max().item()
        assert err <= (2 * (rel[i] if i < 4 else max(rel)) + floor) * scale, (i, err, rel, scale)
