"""optimizer/step_paths.py: our DDP optimizers' step path is chosen once, when the optimizer is built, from the
config (the run's choice, or a path named by a test); `step()` never chooses again; a named path that cannot step
the run is refused with the reason; MYLLM_FLAT_ADAMW stands for OptimizerConfig.one_launch in build_optimizer."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from optimizer import OptimizerConfig, build_optimizer
from parallel import DDPConfig, DistributedDataParallel


def _build(path=None, dtype=torch.bfloat16, zero_stage=0, **cfg):
    torch.manual_seed(0)
    # "layers.0." names: Muon's matrices (optimizer/muon.py is_muon_param)
    model = nn.Sequential()
    model.add_module("layers", nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    model.to(dtype)
    zero = zero_stage > 0
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=64, use_distributed_optimizer=zero))
    config = OptimizerConfig(**{**dict(precision="bf16" if dtype == torch.bfloat16 else "fp32", lr=1e-2,
                                       grad_clip=0.5, use_distributed_optimizer=zero,
                                       zero_stage=max(zero_stage, 1)), **cfg})
    return model, ddp, build_optimizer(ddp, config, path=path)


def _step(model, ddp, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    x = torch.randn(4, 6, generator=g).to(next(model.parameters()).dtype)
    ddp(x).float().square().mean().backward()
    return tuple(opt.step())


@pytest.mark.parametrize("cfg, zero_stage, want", [
    ({}, 0, "host_decided"),  # a CPU run: foreach AdamW takes no device flag
    ({"fused": True}, 0, "device_decided"),
    ({"fused": True}, 2, "device_decided"),
    ({"fused": True, "optimizer": "muon"}, 0, "host_decided"),  # Muon: the host decides
    ({"fused": True, "overlap_optim_step": True}, 0, "overlapped"),
    ({"fused": True, "one_launch": "on"}, 0, "one_launch"),
    ({"fused": True, "one_launch": "on"}, 1, "one_launch"),  # ZeRO-1's shards
    ({"fused": True, "one_launch": "on"}, 2, "device_decided"),  # ZeRO-2: not the kernel's
    ({"one_launch": "on", "state_dtype": "bf16"}, 0, "one_launch"),
])
def test_the_run_gets_its_path_when_the_optimizer_is_built(cfg, zero_stage, want):
    _, _, opt = _build(zero_stage=zero_stage, **cfg)
    assert opt.path.name == want
    assert (opt.flat is not None) == (want == "one_launch")


@pytest.mark.parametrize("cfg, path", [({"fused": True}, "one_launch"), ({"fused": True}, "device_decided"),
                                       ({"fused": True, "one_launch": "on"}, "host_decided"),
                                       ({"fused": True, "overlap_optim_step": True}, "overlapped")])
def test_step_never_chooses_again(monkeypatch, cfg, path):
    """After construction nothing that chooses a path runs: steps (a skipped one included) and a state dict round
    trip with the choosers broken."""
    import optimizer.mixed_precision_optimizer as mpo
    import optimizer.one_launch_step as ols
    import optimizer.step_paths as sp
    model, ddp, opt = _build(path=path, **cfg)

    def chooses(*a, **k):
        raise AssertionError("a path was chosen after construction")
    for module, name in ((mpo, "choose_path"), (sp, "one_launch_applies"), (sp, "one_launch_unfit"),
                         (sp, "torch_adamw_path"), (ols, "one_launch_unfit")):
        monkeypatch.setattr(module, name, chooses)
    results = [_step(model, ddp, opt, seed) for seed in range(3)]
    opt.zero_grad()
    ddp(torch.full((4, 6), float("nan"), dtype=torch.bfloat16)).float().sum().backward()
    assert tuple(opt.step())[0] is False  # (the overlapped step's norm is then nan, the others' inf)
    opt.load_state_dict(opt.state_dict())
    assert all(stepped for stepped, _ in results) and opt.path.name == path


@pytest.mark.parametrize("cfg, path, why", [
    ({"fused": True, "optimizer": "muon"}, "one_launch", "--optimizer=muon"),
    ({"fused": True, "one_launch": "off"}, "one_launch", r"one_launch=off"),
    ({"optimizer": "muon", "fused": True}, "device_decided", "every update to take a device flag"),
    ({"fused": True}, "overlapped", "needs overlap_optim_step"),
    ({"fused": True, "overlap_optim_step": True}, "host_decided", "cannot run with overlap_optim_step"),
    ({"fused": True}, "fastest", "unknown optimizer step path 'fastest'"),
    ({"one_launch": "on", "state_dtype": "bf16"}, "device_decided", "bf16 needs the one-launch AdamW"),
])
def test_a_named_path_that_cannot_step_the_run_is_refused(cfg, path, why):
    with pytest.raises(ValueError, match=why):
        _build(path=path, **cfg)


def test_the_environment_stands_for_one_launch_in_build_optimizer(monkeypatch):
    monkeypatch.setenv("MYLLM_FLAT_ADAMW", "on")
    assert _build(fused=True)[2].path.name == "one_launch"
    assert _build(fused=True, one_launch="off")[2].path.name == "device_decided"  # the config's own choice wins
    monkeypatch.setenv("MYLLM_FLAT_ADAMW", "sometimes")
    with pytest.raises(ValueError, match="MYLLM_FLAT_ADAMW='sometimes': auto | on | off"):
        _build(fused=True)
    with pytest.raises(ValueError, match="one_launch must be auto, on or off"):
        OptimizerConfig(one_launch="yes")
