"""One process, one micro-batch a step: the gradients stay on the parameters (DistributedDataParallel.
keep_grads_on_params, optimizer/flat_adamw.py ParamGrads) and the one-launch AdamW reads them at their addresses.

Checked against the same engine with the gradients in DDP's fp32 buffers (the path every multi-process run takes):
with clipping off the update does not depend on the norm's summation order, so parameters, moments and masters
must be the same bits (each bf16 gradient widens to fp32 exactly either way); with clipping on, the norms agree to
float32 rounding. The kernel runs in the Triton interpreter (TRITON_INTERPRET=1, tests/conftest.py) or, forced off,
as its torch reference, which reads the gradients laid out like the buffer.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from optimizer.flat_adamw import triton_runs_on
from tests.optimizer.test_flat_adamw import _engine, _params, _steps, _zero_batch_backward

needs_interpreter = pytest.mark.skipif(not triton_runs_on(torch.device("cpu")),
                                       reason="needs Triton and TRITON_INTERPRET=1")


def _state(engine):
    return {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in e.items()}
            for n, e in engine.optimizer.state_dict()["params"].items()}


def _same_state(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for key in a[name]:
            x, y = a[name][key], b[name][key]
            assert (torch.equal(x, y) if torch.is_tensor(x) else x == y), (name, key)


@pytest.mark.parametrize("kernel", ["triton", "reference"])
@pytest.mark.parametrize("dtype, moments", [("bf16", "fp32"), ("fp32", "fp32"), ("bf16", "bf16")])
def test_the_step_from_the_parameters_grads_is_the_buffer_steps(monkeypatch, kernel, dtype, moments):
    """(bf16 moments: their stochastic rounding is seeded by buffer offsets, which both paths share.)"""
    if kernel == "triton" and not triton_runs_on(torch.device("cpu")):
        pytest.skip("needs Triton and TRITON_INTERPRET=1")
    engines = {}
    for mode in ("auto", "off"):
        e = _engine("on", monkeypatch, dtype=dtype, grads_on_params=mode, grad_clip=0.0,
                    optimizer_state_dtype=moments)
        e.optimizer.flat.use_triton = kernel == "triton"
        engines[mode] = e
    on, off = engines["auto"], engines["off"]
    assert on.model.grads_on_params and not off.model.grads_on_params
    assert on.model.grad_buffer_bytes() == 0 < off.model.grad_buffer_bytes()  # the fp32 gradient buffer is gone
    assert on.model._hook_removers == [] and len(off.model._hook_removers) == len(off.model.param_to_bucket)
    ra, rb = _steps(on, 3), _steps(off, 3)
    assert all(s for s, _ in ra + rb)
    pa, pb = _params(on), _params(off)
    assert all(torch.equal(pa[k], pb[k]) for k in pb)
    _same_state(_state(on), _state(off))
    if kernel == "reference":  # the same norm, computed from the same values laid out the same way
        assert ra == rb
    else:
        assert [n for _, n in ra] == pytest.approx([n for _, n in rb], rel=1e-6)
    # after the step the gradients are dropped with zero_grad, as the buffer path's
    on.optimizer.zero_grad()
    assert all(p.grad is None for p in on.module.parameters())


@needs_interpreter
def test_with_clipping_the_steps_follow_the_buffer_path_within_float32_rounding(monkeypatch):
    """Clipping on (0.5, active every step): the clip coefficient comes from norms summed in another order, so the
    fp32 runs agree to float32 rounding (the tolerance of tests/optimizer/test_flat_adamw.py against torch's AdamW)."""
    on = _engine("on", monkeypatch, dtype="fp32", grads_on_params="auto")
    off = _engine("on", monkeypatch, dtype="fp32", grads_on_params="off")
    assert on.model.grads_on_params and not off.model.grads_on_params
    ra, rb = _steps(on, 4), _steps(off, 4)
    assert all(n > 0.5 for _, n in rb)  # the clip was active
    assert [n for _, n in ra] == pytest.approx([n for _, n in rb], rel=1e-5)
    pa, pb = _params(on), _params(off)
    for k in pb:
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-5, atol=1e-6)


class _TwoLayers(nn.Module):
    """`unused` gets no gradient: the buffer path zeroes its main_grad, so AdamW still decays it and its moments."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def _direct(mode, dtype):
    from optimizer import OptimizerConfig, build_optimizer
    from parallel.distributed_data_parallel import DDPConfig, DistributedDataParallel
    torch.manual_seed(0)
    model = _TwoLayers().to(dtype)
    ddp = DistributedDataParallel(model, DDPConfig(grad_reduce_in_fp32=True, bucket_size=100))
    opt = build_optimizer(ddp, OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.0, fused=True,
                                               precision="bf16" if dtype == torch.bfloat16 else "fp32",
                                               one_launch="on", grads_on_params=mode == "auto"))
    assert opt.flat is not None
    assert opt.keep_grads_on_params() == (mode == "auto")
    return model, ddp, opt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_parameter_no_gradient_reached_is_stepped_with_zeros_as_in_the_buffer(dtype):
    runs = {}
    for mode in ("auto", "off"):
        model, ddp, opt = _direct(mode, dtype)
        assert ddp.grads_on_params == (mode == "auto")
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randn(4, 8, generator=g).to(dtype)).float().square().sum().backward()
            assert model.unused.weight.grad is None
            stepped, _ = opt.step()
            assert stepped
        runs[mode] = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    before = _TwoLayers().to(dtype)  # the initial weights of both runs
    for n in runs["off"]:
        assert torch.equal(runs["auto"][n], runs["off"][n]), n
    assert not torch.equal(runs["auto"]["unused.weight"], before.unused.weight)  # decayed, as in the buffer


@needs_interpreter
def test_a_non_finite_gradient_skips_the_step_on_the_device(monkeypatch):
    e = _engine("on", monkeypatch, grads_on_params="auto")
    assert e.model.grads_on_params
    _steps(e, 2)
    before, steps = _params(e), e.optimizer.flat.steps
    (stepped, norm), = _steps(e, 1, seed=3, poison_at=0)  # NaN written into one parameter's .grad
    assert not stepped and norm == float("inf") and e.optimizer.flat.steps == steps
    assert all(torch.equal(x, y) for x, y in zip(before.values(), _params(e).values()))
    (stepped, _), = _steps(e, 1, seed=4)
    assert stepped and e.optimizer.flat.steps == steps + 1


def test_accumulation_keeps_the_fp32_buffers_and_no_sync_refuses_on_parameters(monkeypatch):
    acc = _engine("on", monkeypatch, grads_on_params="auto", gradient_accumulation_steps=2)
    assert not acc.model.grads_on_params and acc.model.grad_buffer_bytes() > 0  # micro-batches add in fp32
    one = _engine("on", monkeypatch, grads_on_params="auto")
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps > 1"):
        with one.model.no_sync():
            pass
    for flags in ({"use_distributed_optimizer": True}, {"comm_hook": "powersgd", "powersgd_rank": 1}):
        assert not _engine("on", monkeypatch, grads_on_params="auto", **flags).model.grads_on_params, flags
    assert not _engine("off", monkeypatch, grads_on_params="auto").model.grads_on_params  # torch's AdamW: buffers
    assert not _engine("on", monkeypatch, grads_on_params="off").model.grads_on_params


@pytest.mark.parametrize("how", ["reference-fails", "kernel-fails", "norm-kernel-fails", "comm-hook"])
def test_leaving_the_parameters_puts_this_steps_gradients_in_the_buffers(monkeypatch, caplog, how):
    """Back to DDP's buffers in the middle of a run: a kernel (the update's or the norm's; or the reference's
    update) that cannot be built at its first launch (torch's fused AdamW takes over, from this step's
    gradients), or a comm hook registered later (it reads the buckets). Either way the run continues as the
    buffer path's would."""
    import optimizer.one_launch_step as mpo
    from parallel.comm_hooks import allreduce_hook
    fails = how.endswith("fails")
    if how in ("kernel-fails", "norm-kernel-fails") and not triton_runs_on(torch.device("cpu")):
        pytest.skip("needs Triton and TRITON_INTERPRET=1")
    on = _engine("on", monkeypatch, grads_on_params="auto")
    ref = _engine("off" if fails else "on", monkeypatch, grads_on_params="off")
    on.optimizer.flat.use_triton = how != "reference-fails"
    if ref.optimizer.flat is not None:
        ref.optimizer.flat.use_triton = False
    if fails:
        calls = []

        def broken(*a, **k):
            calls.append(1)
            raise RuntimeError("no kernel here")
        monkeypatch.setattr(mpo, {"reference-fails": "adamw_flat", "kernel-fails": "adamw_param_grads",
                                  "norm-kernel-fails": "sumsq_param_grads"}[how], broken)
    else:
        _steps(on, 1)
        _steps(ref, 1)
        on.model.register_comm_hook(None, allreduce_hook)  # the default hook, registered again: buffers back
        assert not on.model.grads_on_params and on.model.grad_buffer_bytes() > 0
    with caplog.at_level(logging.WARNING, logger="optimizer.one_launch_step"):
        ra, rb = _steps(on, 2), _steps(ref, 2)
    assert not on.model.grads_on_params and on.model.grad_buffer_bytes() == ref.model.grad_buffer_bytes()
    assert len(on.model._hook_removers) == len(on.model.param_to_bucket)
    if fails:
        assert calls == [1] and on.optimizer.flat is None and "one-launch AdamW off" in caplog.text
    assert [n for _, n in ra] == pytest.approx([n for _, n in rb], rel=1e-6)
    _same_within_rounding(on, ref)


def _same_within_rounding(a, b):
    """Two engines whose updates were computed by different (each correct) kernels: the fp32 masters agree to float32
    rounding (the bound of tests/optimizer/test_flat_adamw.py against torch's AdamW); a bf16 parameter is its own
    master rounded to bf16, so where two masters that agree to float32 rounding straddle a bf16 rounding boundary
    the parameters differ by one bf16 unit in the last place at their magnitude, and by no more."""
    ma, mb = _masters(a), _masters(b)
    for k in mb:
        torch.testing.assert_close(ma[k], mb[k], rtol=1e-5, atol=1e-6)
    pa, pb = _params(a), _params(b)
    for k in pb:
        x, y = pa[k], pb[k]
        if x.dtype == torch.float32:  # its own master
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
            continue
        assert torch.equal(x, ma[k].view_as(x).to(x.dtype)), k  # written back from its master
        assert torch.equal(y, mb[k].view_as(y).to(y.dtype)), k
        ulp = _ulp(torch.maximum(x.float().abs(), y.float().abs()), x.dtype)
        assert ((x.float() - y.float()).abs() <= ulp).all(), k


def _masters(engine):
    return {n: e["main"].float().reshape(-1) for n, e in engine.optimizer.state_dict()["params"].items()}


def _ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s values at each magnitude: 2**floor(log2 |x|) * eps (eps = 2**-mantissa bits)."""
    info = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(magnitude.clamp_min(info.tiny)))) * info.eps


def test_the_bound_is_one_unit_in_the_last_place():
    """The helper above measures what it claims: bf16 has 7 explicit mantissa bits, and values one ulp apart are
    neighbours (nothing representable between them)."""
    assert _ulp(torch.tensor([1.0, 1.5, 2.0, 0.002]), torch.bfloat16).tolist() == [2 ** -7, 2 ** -7, 2 ** -6,
                                                                                    2 ** -16]
    x = torch.tensor([1.0, 0.002, 3.0], dtype=torch.bfloat16)
    up = torch.nextafter(x.float(), torch.full_like(x.float(), 10.0))  # the next fp32 value up
    assert torch.equal(up.to(torch.bfloat16), x)  # rounds back: fp32 noise does not move a bf16 value
    nxt = (x.float() + _ulp(x.float(), torch.bfloat16)).to(torch.bfloat16)
    assert (nxt > x).all() and torch.equal((x.float() + _ulp(x.float(), torch.bfloat16) / 4).to(torch.bfloat16), x)


def test_the_step_is_the_same_few_ops_for_any_model_size(monkeypatch):
    """The addresses' copy, the sum of squares (its two launches, counted as such), the kernel and the norm's host
    copy: the same count for 2 layers in 2 buckets and 4 layers in many."""
    import optimizer.one_launch_step as mpo
    from model import ModelConfig, Transformer
    from parallel.build import build_engine
    from tests.optimizer.test_step_launches import CountLaunches
    from trainer.config import TrainConfig
    counts = []
    for layers, bucket in ((2, 3000), (4, 1500)):
        e = _engine("on", monkeypatch, grads_on_params="auto")
        if layers > 2:
            torch.manual_seed(0)
            e = build_engine(Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                                                     multiple_of=16, max_seq_len=16)),
                             TrainConfig(device="cpu", dtype="bf16", grad_clip=0.5, bucket_size=bucket),
                             device=torch.device("cpu"))
        assert e.model.grads_on_params and e.optimizer.flat.use_triton is not None
        e.optimizer.flat.use_triton = True  # the GPU's path (the kernels themselves are replaced below)
        _zero_batch_backward(e)
        kernels = []
        monkeypatch.setattr(mpo, "adamw_param_grads", lambda *a, **k: kernels.append(1))
        monkeypatch.setattr(mpo, "sumsq_param_grads", lambda pg, a: kernels.extend((1, 1)) or torch.ones(()))
        with CountLaunches() as launches:
            e.optimizer.step()
        monkeypatch.undo()
        counts.append(len(launches.ops) + len(kernels))
    assert counts[0] == counts[1] <= 8, counts
