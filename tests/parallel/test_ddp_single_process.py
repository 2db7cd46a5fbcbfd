"""World-size-1 checks of the buffer layout and PowerSGD (same code path as N ranks)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel import DDPConfig, DistributedDataParallel, PowerSGDState, powersgd_hook
from parallel.distributed_data_parallel.param_and_grad_buffer import ParamAndGradBuffer


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 3))


def test_buffer_layout_reverse_order_padding_and_views():
    m = _net()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ddp = DistributedDataParallel(m, DDPConfig(bucket_size=30, pad_alignment=8, param_alignment=4))
    names = [s.name for b in ddp.buckets for s in b.slots]
    assert names == [n for n, _ in m.named_parameters()][::-1]  # reverse registration order
    buf = ddp.buffers_[0]
    for b in ddp.buckets:
        assert b.numel % 8 == 0 and b.start % 8 == 0  # every bucket splits evenly (world 1 * 8)
        assert b.numel >= 1
    assert buf.numel % 8 == 0
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n])  # values kept...
        assert p.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()  # ...in the buffer
        assert p.main_grad.untyped_storage().data_ptr() == buf.grad_data.untyped_storage().data_ptr()
    # a bucket is closed once it reaches bucket_size elements
    assert len(ddp.buckets) >= 2


def test_buckets_pad_for_world_size():
    params = [("a", nn.Parameter(torch.randn(10))), ("b", nn.Parameter(torch.randn(3, 5)))]
    buf = ParamAndGradBuffer(params, torch.float32, bucket_size=None, world_size=4, pad_alignment=16,
                             param_alignment=1, first_bucket_index=0)
    assert buf.numel == 64 and buf.buckets[0].shard_range(3, 4) == (48, 64)


def test_no_sync_accumulates_and_last_microbatch_syncs():
    m, ref = _net(), _net()
    ddp = DistributedDataParallel(m, DDPConfig(bucket_size=16))
    x = torch.randn(6, 5)
    with ddp.no_sync():
        ddp(x[:3]).sum().backward()
    ddp(x[3:]).sum().backward()
    ddp.finish_grad_sync()
    ref(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert p.grad is None  # gradients live in main_grad only
        torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-6, atol=1e-7)
    assert ddp.last_step_comm_bytes == 0  # world size 1: nothing sent


class _Linear(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def forward(self, g):
        return (self.w * g).sum()  # d/dw = g: a constant gradient


def _compressed_grads(target: torch.Tensor, steps: int, error_feedback: bool) -> list[torch.Tensor]:
    mod = _Linear(torch.zeros_like(target))
    ddp = DistributedDataParallel(mod, DDPConfig())
    ddp.register_comm_hook(PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=0,
                                         use_error_feedback=error_feedback, seed=1), powersgd_hook)
    out = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        ddp(target).backward()
        ddp.finish_grad_sync()
        out.append(mod.w.main_grad.clone())
    return out


def test_powersgd_error_feedback_accumulated_update_converges():
    torch.manual_seed(0)
    g = torch.randn(24, 16)  # full rank: rank-1 compression alone can't represent it
    with_ef = _compressed_grads(g, 200, True)
    no_ef = _compressed_grads(g, 200, False)
    err = lambda gs, t: float((torch.stack(gs[:t]).mean(0) - g).norm() / g.norm())  # noqa: E731
    assert err(with_ef, 200) < 0.05
    assert err(with_ef, 200) < err(with_ef, 20)  # keeps shrinking (~1/T)
    assert err(no_ef, 200) > 0.5  # without feedback the lost directions are never sent


def test_powersgd_quadratic_reaches_optimum_with_error_feedback():
    """...and STAYS there: once w is at the optimum the gradient is ~0 and of rank < r, and
    PowerSGD must not blow rounding noise up (it reached 2e-8, then diverged to 4e17 at ~step 250).
    Reference: plain gradient descent (all-reduce hook) on the same problem."""
    torch.manual_seed(1)
    target = torch.randn(16, 12)
    errs = {}
    for name, hook in (("powersgd", (PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=0,
                                                    seed=3), powersgd_hook)), ("plain", None)):
        mod = _Linear(torch.zeros(16, 12))
        mod.forward = lambda t, mod=mod: 0.5 * ((mod.w - t) ** 2).sum()
        ddp = DistributedDataParallel(mod, DDPConfig())
        if hook is not None:
            ddp.register_comm_hook(*hook)
        errs[name] = []
        for _ in range(1500):
            ddp.zero_grad_buffer()
            ddp(target).backward()
            ddp.finish_grad_sync()
            with torch.no_grad():
                mod.w -= 0.2 * mod.w.main_grad
            errs[name].append(float((mod.w.detach() - target).norm() / target.norm()))
    assert max(errs["plain"][100:]) < 1e-6  # the reference sits at the optimum (fp32 rounding)
    assert max(errs["powersgd"][300:]) < 1e-2, max(errs["powersgd"][300:])  # reached, and stays
    assert errs["powersgd"][-1] < 1e-4, errs["powersgd"][-1]


def test_powersgd_skips_tensors_below_min_compression_rate():
    from parallel.powersgd import compression_plan
    st = PowerSGDState(matrix_approximation_rank=4, min_compression_rate=2.0)
    assert compression_plan(st, torch.Size([64, 64]))[0]  # 4096 / (4*128) = 8
    assert not compression_plan(st, torch.Size([64, 4]))[0]  # 256 / (4*68) < 2
    assert not compression_plan(st, torch.Size([64]))[0]  # vectors are never compressed


def test_powersgd_state_dict_is_tensors_and_ints(tmp_path):
    g = torch.randn(8, 8)
    mod = _Linear(torch.zeros(8, 8))
    ddp = DistributedDataParallel(mod, DDPConfig())
    st = PowerSGDState(start_powerSGD_iter=0)
    ddp.register_comm_hook(st, powersgd_hook)
    ddp(g).backward()
    ddp.finish_grad_sync()
    torch.save(ddp.comm_hook_state_dict(), tmp_path / "h.pt")
    sd = torch.load(tmp_path / "h.pt", weights_only=True)
    assert sd["iteration"] == 1 and "q.0.0" in sd and "error.0.0" in sd
    other = PowerSGDState(start_powerSGD_iter=0, matrix_approximation_rank=2)
    with pytest.raises(ValueError):
        other.load_state_dict(sd)


def test_shard_only_hooks_need_the_distributed_optimizer():
    from parallel import bf16_compress_wrapper, reduce_scatter_hook
    ddp = DistributedDataParallel(_net(), DDPConfig())
    for hook in (reduce_scatter_hook, bf16_compress_wrapper(reduce_scatter_hook)):
        with pytest.raises(ValueError, match="use_distributed_optimizer"):
            ddp.register_comm_hook(None, hook)
    DistributedDataParallel(_net(), DDPConfig(use_distributed_optimizer=True)).register_comm_hook(
        None, reduce_scatter_hook)


def test_startup_layout_line_names_engine_mesh_communication_and_global_batch():
    """One line says what a run is: a 1B ZeRO-1 run under torchrun used to print only `world 2`."""
    import dataclasses
    from types import SimpleNamespace
    from parallel.build import describe_layout as describe
    from parallel.config import ParallelConfig
    from trainer.config import TrainConfig
    base = TrainConfig(batch_size=4, gradient_accumulation_steps=8, max_seq_len=2048)

    def describe_layout(flags, engine, world_size):  # an engine as build_engine returns it: its layout section
        return describe(flags, SimpleNamespace(dp_size=engine.dp_size, parallel=ParallelConfig.from_flags(flags)),
                        world_size)
    line = describe_layout(dataclasses.replace(base, use_distributed_optimizer=True, comm_hook="powersgd",
                                               powersgd_rank=4, compile=True),
                           SimpleNamespace(dp_size=2), world_size=2)
    assert line.startswith("[layout] engine ddp + ZeRO-1;")
    assert "world 2 = pipeline 1 x data-parallel 2 x tensor 1" in line
    assert "powersgd (rank 4, from step" in line and "overlap grad reduce" in line
    assert "compile on" in line and "activation checkpointing off" in line
    assert "global batch 4 x 8 x 2 = 64 samples = 131,072 tokens per step" in line
    line = describe_layout(dataclasses.replace(base, parallel="fsdp", reshard_after_forward=False,
                                               pipeline_parallel_size=2, gradient_checkpointing=True),
                           SimpleNamespace(dp_size=2), world_size=4)
    assert "engine pipeline (2 stages, " in line and "over fsdp (FSDP2, ZeRO-2-like)" in line
    assert "world 4 = pipeline 2 x data-parallel 2 x tensor 1" in line and "gradients" not in line
    assert "activation checkpointing full (each block)" in line
    # the whole mesh (parallel/mesh.py): tensor parallel with sequence parallel, HSDP replicas
    line = describe_layout(dataclasses.replace(base, parallel="fsdp", tensor_parallel_size=2, sequence_parallel=True,
                                               dp_replicate_size=2), SimpleNamespace(dp_size=4), world_size=8)
    assert "tensor parallel 2 (DTensor, sequence parallel), HSDP over 2 replicas" in line, line
    assert "world 8 = pipeline 1 x data-parallel 4 (replicate 2 x shard 2) x tensor 2" in line, line
    assert "global batch 4 x 8 x 4 = 128 samples" in line
    line = describe_layout(dataclasses.replace(base, parallel="fsdp", expert_parallel_size=2), SimpleNamespace(dp_size=4),
                           world_size=4)  # expert parallel splits the data-parallel shard ranks
    assert "world 4 = pipeline 1 x data-parallel 4 (experts over 2 of them) x tensor 1" in line, line


class _Branchy(nn.Module):
    """`b` is used only when asked: a step may leave it without a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 4), nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        h = self.a(x)
        return self.b(h) if use_b else h


def test_gradients_are_not_zero_filled_between_steps_yet_always_this_steps(monkeypatch):
    """zero_grad_buffer() writes nothing with the default all-reduce: each parameter's first gradient of a step
    is copied over last step's (no zero-fill, no read of the old values: 8 bytes per parameter a step), and
    one that gets no gradient is zeroed at its bucket's launch. Checked over steps that use `b`, skip it, and
    accumulate micro-batches, against torch's own .grad; a custom comm hook (PowerSGD) still gets zero-fills."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar) and args[0].numel() > 16:
                self.n += 1
            return func(*args, **(kwargs or {}))

    m, ref = _Branchy(), _Branchy()
    ddp = DistributedDataParallel(m, DDPConfig(bucket_size=8))
    assert len(ddp.buckets) >= 2
    x = torch.randn(6, 5)
    for step, (use_b, micro) in enumerate([(True, 1), (False, 1), (True, 3), (False, 2), (True, 1)]):
        with Fills() as fills:
            ddp.zero_grad_buffer()
        assert fills.n == 0 or step == 0
        ref.zero_grad(set_to_none=False)
        for k in range(micro):
            xs = x[k::micro] * (step + 1)
            ctx = ddp.no_sync() if k < micro - 1 else torch.enable_grad()
            with ctx:
                ddp(xs, use_b).pow(2).sum().backward()
            ref(xs, use_b).pow(2).sum().backward()
        ddp.finish_grad_sync()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            expect = q.grad if q.grad is not None else torch.zeros_like(q)
            assert torch.equal(p.main_grad, expect), (step, n)  # b's last-step gradient never leaks
    state = PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=0)
    ddp.register_comm_hook(state, powersgd_hook)
    with Fills() as fills:
        ddp.zero_grad_buffer()
    assert fills.n >= 1


def test_a_buckets_gradients_are_written_in_one_launch():
    """A bucket's gradients go into its (fp32) buffer together when its last one arrives: one multi-tensor copy
    per bucket (bf16 -> fp32), not one copy per parameter; the buffer then holds exactly each gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Writes(TorchDispatchMode):
        def __init__(self, storage):
            super().__init__()
            self.storage, self.multi, self.single = storage, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._foreach_copy_.default:
                self.multi += 1
            elif func in (torch.ops.aten.copy_.default, torch.ops.aten.add_.Tensor) and \
                    args[0].untyped_storage().data_ptr() == self.storage:
                self.single += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)]).to(torch.bfloat16)
    ref = nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)]).to(torch.bfloat16)
    ref.load_state_dict(m.state_dict())
    ddp = DistributedDataParallel(m, DDPConfig(bucket_size=90, grad_reduce_in_fp32=True))
    assert len(ddp.buckets) >= 3 and len(list(m.parameters())) == 12
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    for step in range(2):  # the second step: copied over the stale buffer, no zero-fill
        ddp.zero_grad_buffer()
        with Writes(ddp.buffers_[0].grad_data.untyped_storage().data_ptr()) as w:
            ddp(x * (step + 1)).float().square().sum().backward()
        ddp.finish_grad_sync()
        assert (w.multi, w.single) == (len(ddp.buckets), 0), (step, w.multi, w.single)
        ref.zero_grad()
        ref(x * (step + 1)).float().square().sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert p.main_grad.dtype == torch.float32 and torch.equal(p.main_grad, q.grad.float())
