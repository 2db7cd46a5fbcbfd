"""The step with the skip and the clip decided on the device (fused AdamW's found_inf, a clip coefficient
tensor, the one host read after the update's launches) gives the same bits as the host-decided step:
parameters, returned norms and verdicts, the optimizer state dict and the loss scale, with clipping active
and with overflow steps (also the first step), unsharded and ZeRO-1/2, bf16 and fp16."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from optimizer import OptimizerConfig, build_optimizer
from parallel import DDPConfig, DistributedDataParallel


def _net(dtype, device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3)).to(device, dtype)


def _run(dtype, zero_stage, on_device: bool, batched: bool = True, device: str = "cpu"):
    model = _net(dtype, device)
    zero = zero_stage > 0
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=20, use_distributed_optimizer=zero))
    cfg = OptimizerConfig(precision="fp16" if dtype == torch.float16 else "bf16", fused=True, lr=1e-2,
                          grad_clip=0.05, initial_loss_scale=256.0, hysteresis=1, loss_scale_growth_interval=2,
                          use_distributed_optimizer=zero, zero_stage=max(zero_stage, 1))
    # torch's fused AdamW, by the path named (a CUDA run would otherwise take the one-launch path, tested on its own)
    opt = build_optimizer(ddp, cfg, path="device_decided" if on_device else "host_decided")
    opt.adamw.batched = batched
    assert len(opt.optimizers) >= 3  # several buckets: the batched step spans them
    assert opt.path.name == ("device_decided" if on_device else "host_decided")
    g = torch.Generator().manual_seed(3)
    results = []
    for step in range(7):
        x, y = (t.to(device) for t in (torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)))
        opt.zero_grad()
        loss = ((ddp(x.to(dtype)).float() - y) ** 2).mean()
        if step in (0, 3):
            loss = loss * float("inf")  # an overflow: skipped, also before any state exists
        opt.scale_loss(loss).backward()
        results.append(opt.step())
    return model, opt, results


@pytest.mark.parametrize("dtype,zero_stage", [(torch.bfloat16, 0), (torch.float16, 0), (torch.bfloat16, 1),
                                              (torch.float16, 2)])
def test_the_device_decided_step_equals_the_host_decided_one(dtype, zero_stage):
    m_host, o_host, r_host = _run(dtype, zero_stage, on_device=False)
    m_dev, o_dev, r_dev = _run(dtype, zero_stage, on_device=True)
    assert r_dev == r_host
    assert [s for s, _ in r_dev] == [False, True, True, False, True, True, True]
    for a, b in zip(m_host.state_dict().values(), m_dev.state_dict().values()):
        assert torch.equal(a, b)
    sd_h, sd_d = o_host.state_dict(), o_dev.state_dict()
    assert sd_h["scaler"] == sd_d["scaler"] and sd_h["lr"] == sd_d["lr"]
    for name, e in sd_h["params"].items():
        for k, v in e.items():
            assert torch.equal(v, sd_d["params"][name][k]) if torch.is_tensor(v) else v == sd_d["params"][name][k]


@pytest.mark.parametrize("on_device", [True, False], ids=["device-decided", "host-decided"])
@pytest.mark.parametrize("dtype,zero_stage", [(torch.bfloat16, 0), (torch.float16, 1), (torch.bfloat16, 2)])
def test_one_batched_adamw_launch_equals_stepping_each_bucket(dtype, zero_stage, on_device):
    """optimizer/fused_step.py (every bucket's AdamW in one fused call per group) against each bucket's
    own torch AdamW.step(): the same bits in parameters, norms, verdicts and state, overflow steps included."""
    m_one, o_one, r_one = _run(dtype, zero_stage, on_device, batched=True)
    m_each, o_each, r_each = _run(dtype, zero_stage, on_device, batched=False)
    assert r_one == r_each
    for a, b in zip(m_each.state_dict().values(), m_one.state_dict().values()):
        assert torch.equal(a, b)
    sd_e, sd_o = o_each.state_dict(), o_one.state_dict()
    for name, e in sd_e["params"].items():
        for k, v in e.items():
            assert torch.equal(v, sd_o["params"][name][k]) if torch.is_tensor(v) else v == sd_o["params"][name][k]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_on_cuda_the_batched_step_equals_stepping_each_bucket(zero_stage):
    """The same comparison with torch's CUDA fused AdamW kernel (what a GPU run steps with)."""
    m_one, o_one, r_one = _run(torch.bfloat16, zero_stage, True, batched=True, device="cuda")
    m_each, o_each, r_each = _run(torch.bfloat16, zero_stage, True, batched=False, device="cuda")
    assert r_one == r_each and [s for s, _ in r_one] == [False, True, True, False, True, True, True]
    for a, b in zip(m_each.state_dict().values(), m_one.state_dict().values()):
        assert torch.equal(a, b)
