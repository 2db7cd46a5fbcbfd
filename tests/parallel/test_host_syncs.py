"""Host syncs per training step: the engine's forward+backward reads nothing back, the optimizer
reads exactly one number (the global squared gradient norm: the skip and clip decisions), and the
trainer's step statistics ride behind it (utils.device.HostCopy).

On CPU a "sync" is counted as a call of aten::_local_scalar_dense (what `.item()`, `float(t)`,
`int(t)` and `bool(t)` of a tensor run): on a GPU each one of those on a device tensor waits for the
device. The GPU test at the end counts the real ones with torch.cuda.set_sync_debug_mode.
"""
from __future__ import annotations

import os
import traceback
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import TrainConfig

from trainer.task import task_of
from model import ModelConfig, Transformer
from parallel.engine import StepStats, step_fields
from trainer.tasks import task_class
from parallel.build import build_engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu_only_read() -> bool:
    """Whether the read comes from a line of this repository that is guarded by `device.type == "cpu"`:
    a branch a GPU never takes (e.g. the linear+CE's check for an upstream gradient of exactly 1)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(ROOT) and "/tests/" not in frame.filename and ".venv" not in frame.filename:
            return 'device.type == "cpu"' in (frame.line or "")
    return False


class CountItems(TorchDispatchMode):
    """Counts tensor-to-Python reads (aten::_local_scalar_dense), except those in CPU-only branches, and
    tensors made from host data (aten::lift_fresh: `torch.tensor(x)`, `t.new_tensor(x)`), which on a GPU
    are host-to-device copies from pageable memory: CUDA's copy waits for them (a sync too)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.from_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not _cpu_only_read():
            self.n += 1
        if func is torch.ops.aten.lift_fresh.default and not _cpu_only_read():
            self.from_host += 1
        return func(*args, **(kwargs or {}))


def test_the_counter_counts_what_a_gpu_would_wait_for():
    t = torch.ones(3)
    with CountItems() as c:
        float(t.sum()), int(t[0]), bool(t.any()), t.sum().item()
        t * 2, t.sum(dim=0), t.new_full((1,), 3.0), torch.full_like(t, 2.0)
    assert (c.n, c.from_host) == (4, 0)
    with CountItems() as c:
        t.new_tensor(2.0), torch.tensor([1.0, 2.0])
    assert (c.n, c.from_host) == (0, 2)


@pytest.fixture(autouse=True)
def fused_adamw_as_on_a_gpu(monkeypatch):
    """The engine asks for torch's fused AdamW on an accelerator (its step counters live on the device);
    on CPU it takes the foreach one, whose CPU step counters are read as numbers (no sync on any device).
    Build the GPU's optimizer here so that the count is the GPU's (fused AdamW runs on CPU too)."""
    import dataclasses

    from parallel import build
    real = build.optimizer_config
    monkeypatch.setattr(build, "optimizer_config", lambda flags: dataclasses.replace(real(flags), fused=True))


def _engine(device: torch.device, **flags):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16,
                                    max_seq_len=16))
    cfg = TrainConfig(device=device.type, learning_rate=1e-3, grad_clip=1.0, **flags)
    engine = build_engine(model.to(device), cfg, device=device)
    engine.stat_keys = task_class(cfg.task_type).stat_keys  # as the trainer sets them (trainer/start.py)
    return cfg, engine


def _batches(device_free_seed: int, n: int, task: str = "pretrain"):
    g = torch.Generator().manual_seed(device_free_seed)
    if task == "dpo":
        def side():
            x = torch.randint(0, 64, (2, 16), generator=g)
            y = x.clone()
            y[:, :5] = -100
            return x, y
        out = []
        for _ in range(n):
            (cx, cy), (rx, ry) = side(), side()
            out.append({"chosen_input_ids": cx, "chosen_labels": cy, "rejected_input_ids": rx, "rejected_labels": ry})
        return out
    return [{"input_ids": (x := torch.randint(0, 64, (2, 16), generator=g)), "labels": x.clone()} for _ in range(n)]


def _one_step(cfg, engine, batches, device, ref=None):
    loss_fn = lambda model, batch: task_of(cfg).micro_batch_loss(model, ref, batch, device)  # noqa: E731
    units = float(sum(task_of(cfg).count_units(b) for b in batches))
    engine.optimizer.zero_grad()
    with CountItems() as fb:
        acc = engine.forward_backward(batches, loss_fn, units)
    with CountItems() as opt:
        stepped, norm = engine.optimizer.step()
    _one_step.from_host = (fb.from_host, opt.from_host)
    return fb.n, opt.n, acc, stepped, norm


@pytest.mark.parametrize("flags", [{}, {"use_distributed_optimizer": True},
                                   {"use_distributed_optimizer": True, "zero_stage": 2},
                                   {"dtype": "bf16"}, {"dtype": "bf16", "optimizer_state_dtype": "bf16"},
                                   {"dtype": "bf16", "optimizer_state_dtype": "bf16",
                                    "use_distributed_optimizer": True}],
                         ids=["ddp", "zero1", "zero2", "ddp-bf16", "bf16-moments", "zero1-bf16-moments"])
def test_a_step_reads_one_number_back(flags):
    """0 reads in forward+backward of 3 micro-batches (the old code read each loss: 3), 1 in the optimizer
    step (the old code all-reduced an overflow flag and read it, then read the norm: 2)."""
    device = torch.device("cpu")
    cfg, engine = _engine(device, gradient_accumulation_steps=3, **flags)
    batches = _batches(0, 3)
    with torch.no_grad():  # the step's loss sum, evaluated before it
        expect = sum(float(task_of(cfg).micro_batch_loss(engine.forward_model, None, b, device)[0]) for b in batches)
    n_fb, n_opt, acc, stepped, norm = _one_step(cfg, engine, batches, device)
    assert (n_fb, n_opt) == (0, 1)
    # and no tensor made from host data: a pageable host-to-device copy on a GPU, which synchronises
    # (the clip coefficient's `new_tensor` did: 2 syncs per step on an H200)
    assert _one_step.from_host == (0, 0)
    assert stepped and 0 < norm < float("inf")
    assert acc.dtype == torch.float64 and acc.shape == (len(step_fields(engine.stat_keys)),)
    assert float(acc[0]) == pytest.approx(expect, rel=1e-5)


def test_forward_backward_sums_equal_the_per_batch_losses():
    device = torch.device("cpu")
    cfg, engine = _engine(device, gradient_accumulation_steps=2)
    batches = _batches(1, 2)
    with torch.no_grad():
        expect = [float(task_of(cfg).micro_batch_loss(engine.forward_model, None, b, device)[0]) for b in batches]
    acc = engine.forward_backward(batches, lambda m, b: task_of(cfg).micro_batch_loss(m, None, b, device), 64.0)
    assert float(acc[0]) == pytest.approx(sum(expect), rel=1e-6)
    assert acc[1:].abs().sum() == 0


def test_dpo_statistics_stay_on_the_device_and_sum_right():
    device = torch.device("cpu")
    cfg, engine = _engine(device, task_type="dpo", gradient_accumulation_steps=2)
    torch.manual_seed(1)
    ref = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16,
                                  max_seq_len=16))
    batches = _batches(2, 2, task="dpo")
    with torch.no_grad():
        per = [task_of(cfg).micro_batch_loss(engine.forward_model, ref, b, device) for b in batches]
    n_fb, n_opt, acc, stepped, _ = _one_step(cfg, engine, batches, device, ref=ref)
    assert (n_fb, n_opt) == (0, 1) and stepped
    for i, key in enumerate(("chosen_reward", "rejected_reward", "reward_acc"), start=1):
        assert float(acc[i]) == pytest.approx(sum(float(s[key]) for _, s in per), rel=1e-5, abs=1e-6)


def test_evaluate_reads_nothing_back():
    device = torch.device("cpu")
    cfg, engine = _engine(device)
    batches = _batches(3, 2)
    units = {id(b): task_of(cfg).count_units(b) for b in batches}  # read from the host batch (no device involved)
    with CountItems() as c:
        sums = engine.evaluate(batches, lambda m, b: task_of(cfg).micro_batch_loss(m, None, b, device),
                               lambda b: units[id(b)])
    assert c.n == 0
    named = StepStats.from_tensor(sums, engine.stat_keys)
    assert named.units == sum(units.values()) and named.loss_sum > 0
    assert named.per_unit()["loss"] == pytest.approx(named.loss_sum / named.units)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("flat", ["auto", "params", "off"], ids=["one-launch", "one-launch-param-grads", "torch-fused"])
def test_cuda_step_waits_for_the_norm_alone(monkeypatch, flat):
    """The real count on a GPU: set_sync_debug_mode warns on every synchronising call (stream and device syncs,
    blocking copies); neither forward+backward nor the optimizer step makes one. The step's one host read waits
    on an event behind the norm's copy only: with ~100 ms of device sleep put in front of the update's launches,
    `step()` returns while the device is still busy (the read it had before, `.item()` after the update's
    launches, waited for all of it: every next step began with an idle device). "params": one micro-batch a
    step, so the gradients stay on the parameters (their addresses reach the kernel by a pinned copy)."""
    from optimizer.mixed_precision_optimizer import MixedPrecisionOptimizer
    monkeypatch.setattr(MixedPrecisionOptimizer, "flat_adamw", "auto" if flat == "params" else flat)
    device = torch.device("cuda")
    n = 1 if flat == "params" else 3
    cfg, engine = _engine(device, gradient_accumulation_steps=n, dtype="bf16")
    assert (engine.optimizer.flat is not None) == (flat != "off")  # on CUDA "auto" is the one-launch AdamW
    assert engine.model.grads_on_params == (flat == "params")
    batches = _batches(0, n)
    _one_step(cfg, engine, batches, device)  # warm-up: lazy allocations and first-call set-up
    loss_fn = lambda model, batch: task_of(cfg).micro_batch_loss(model, None, batch, device)  # noqa: E731
    engine.optimizer.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as fb:
            warnings.simplefilter("always")
            acc = engine.forward_backward(batches, loss_fn, 32.0 * n)
        with warnings.catch_warnings(record=True) as opt:
            warnings.simplefilter("always")
            engine.optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = lambda ws: [str(w.message) for w in ws if "synchroniz" in str(w.message).lower()]  # noqa: E731
    assert syncs(fb) == [], syncs(fb)
    assert syncs(opt) == [], syncs(opt)
    assert acc.is_cuda

    optimizer = engine.optimizer
    if flat != "off":
        import optimizer.mixed_precision_optimizer as mpo
        name = "adamw_param_grads" if flat == "params" else "adamw_flat"
        real_flat = getattr(mpo, name)

        def slow_flat(*args, **kwargs):
            torch.cuda._sleep(200_000_000)  # ~100 ms of device time at a 2 GHz clock, ahead of the update
            real_flat(*args, **kwargs)
        monkeypatch.setattr(mpo, name, slow_flat)
    else:
        real_update = optimizer._update_on_device

        def slow_update(found_inf):
            torch.cuda._sleep(200_000_000)
            real_update(found_inf)
        monkeypatch.setattr(optimizer, "_update_on_device", slow_update)
    optimizer.zero_grad()
    engine.forward_backward(batches, loss_fn, 32.0 * n)
    torch.cuda.synchronize()
    stepped, norm = optimizer.step()
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert stepped and 0 < norm < float("inf")
    assert still_busy, "step() waited for its update's kernels before returning"


def _poisoned_run(flat: str, monkeypatch, read_at_once: bool, dtype: str = "bf16"):
    """4 steps of the one-launch AdamW ("on": its torch reference on CPU, or the kernel in the interpreter) or of
    torch's fused AdamW deciding the skip on the device ("off"), NaN gradients on step 2. read_at_once: each
    verdict unpacked as step() returns (the old contract); else left unread, as the trainer leaves it for a step.
    Returns (the verdicts, the reads each step() call made, which verdicts were read by then, the parameters, the
    state dict's step counts: its call reads the last verdict)."""
    from tests.optimizer.test_flat_adamw import _engine, _params, _steps
    e = _engine(flat, monkeypatch, dtype=dtype)
    assert (e.optimizer.flat is not None) == (flat == "on")
    reads = []

    def counted(engine):
        with CountItems() as c:
            v = engine.optimizer.step()
            if read_at_once:
                v = tuple(v)
        reads.append(c.n)
        return v
    verdicts = _steps(e, 4, poison_at=1, step=counted)
    read = [v.read if hasattr(v, "read") else True for v in verdicts]
    steps = {float(s["step"]) for s in e.optimizer.state_dict()["params"].values()}
    assert all(v.read for v in verdicts if hasattr(v, "read"))
    return verdicts, reads, read, _params(e), steps


@pytest.mark.parametrize("flat", ["on", "off"], ids=["one-launch", "torch-fused"])
def test_a_verdict_left_unread_is_read_by_the_next_step_and_changes_nothing(monkeypatch, flat):
    """step() returns without reading its verdict (the device decided the clip and the skip); the next step()
    reads it first (one read, a step old: on a GPU it waits for nothing), so the NaN step's skip is known to the
    bias corrections of the step after it. Parameters and step counts are those of reading every verdict at once."""
    now, reads_now, _, p_now, steps_now = _poisoned_run(flat, monkeypatch, read_at_once=True)
    late, reads_late, read_late, p_late, steps_late = _poisoned_run(flat, monkeypatch, read_at_once=False)
    assert reads_now == [1, 1, 1, 1]
    assert reads_late == [0, 1, 1, 1]  # each call reads the verdict before it, none its own
    assert read_late == [True, True, True, False]
    assert [tuple(v) for v in late] == now
    assert [s for s, _ in now] == [True, False, True, True] and now[1][1] == float("inf")
    assert steps_now == steps_late == {3.0}  # the skipped step is not counted
    for k in p_now:
        assert torch.equal(p_now[k], p_late[k]), k


def test_fp16_reads_its_verdict_inside_the_step(monkeypatch):
    """fp16: the next forward scales its loss by the scale this verdict updates, so step() reads it at once."""
    _, reads, read, _, _ = _poisoned_run("off", monkeypatch, read_at_once=False, dtype="fp16")
    assert reads == [1, 1, 1, 1] and read == [True] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("flat", ["auto", "off"], ids=["one-launch", "torch-fused"])
def test_cuda_step_returns_before_its_norm_is_computed(monkeypatch, flat):
    """The verdict left unread: with ~100 ms of device sleep queued after the backward, before the norm, `step()`
    returns at once (nothing read: the device is still asleep); unpacking the verdict then waits for the norm."""
    from optimizer.mixed_precision_optimizer import MixedPrecisionOptimizer
    monkeypatch.setattr(MixedPrecisionOptimizer, "flat_adamw", flat)
    device = torch.device("cuda")
    cfg, engine = _engine(device, dtype="bf16")
    batches = _batches(0, 1)
    _one_step(cfg, engine, batches, device)  # warm-up: lazy allocations and first-call set-up
    loss_fn = lambda model, batch: task_of(cfg).micro_batch_loss(model, None, batch, device)  # noqa: E731
    engine.optimizer.zero_grad()
    engine.forward_backward(batches, loss_fn, 32.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~100 ms at a 2 GHz clock, ahead of the norm
    verdict = engine.optimizer.step()
    still_busy = not torch.cuda.current_stream().query()
    assert still_busy and not verdict.read, "step() waited for the device"
    stepped, norm = verdict
    assert stepped and 0 < norm < float("inf") and verdict.read
    torch.cuda.synchronize()
