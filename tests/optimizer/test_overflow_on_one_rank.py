"""Overflow (inf/nan) on ONE rank only, 2 gloo processes: every rank must take the same decision.

An inf is injected deterministically into one element of one gradient on rank 1 only (a tensor
hook on the parameter, before DDP sees the gradient). Checked for an fp16 model with loss scaling
(unsharded and ZeRO), the overlap_optim_step path (per-bucket decisions, unsharded and ZeRO), and
PowerSGD (its error-feedback/Q state must be exactly the pre-step state after a skipped step).
One spawned job runs every scenario (process start-up dominates on 2 cores); tests assert on it.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from optimizer import OptimizerConfig, build_optimizer
from parallel import DDPConfig, DistributedDataParallel, PowerSGDState, powersgd_hook
from tests.dist_helpers import computed_once, spawn

STEPS, BATCH, DIM = 6, 8, 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.c = nn.Linear(DIM, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in m.parameters()])


def _ranks_equal(t: torch.Tensor, ws: int) -> bool:
    out = [torch.empty_like(t) for _ in range(ws)]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out[1:])


def _hook_sd(ddp) -> dict:
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in ddp.comm_hook_state_dict().items()
            if k != "bytes_sent"}


def _sd_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


SCENARIOS = {  # name: (model dtype, DDPConfig kwargs, OptimizerConfig kwargs, PowerSGD?, injections)
    # injections: {step: parameter name}; the inf goes into element 3 of that parameter's gradient
    "fp16_unsharded": (torch.float16, {}, {}, False, {1: "b.weight"}),
    "fp16_zero1": (torch.float16, {"use_distributed_optimizer": True}, {"use_distributed_optimizer": True},
                   False, {1: "b.weight"}),
    "fp16_zero2": (torch.float16, {"use_distributed_optimizer": True},
                   {"use_distributed_optimizer": True, "zero_stage": 2}, False, {1: "c.bias"}),
    "fp32_overlap_unsharded": (torch.float32, {}, {"overlap_optim_step": True, "grad_clip": 0.0}, False,
                               {1: "b.weight"}),
    "fp32_overlap_zero1": (torch.float32, {"use_distributed_optimizer": True},
                           {"use_distributed_optimizer": True, "overlap_optim_step": True, "grad_clip": 0.0},
                           False, {1: "b.weight"}),
    "powersgd_fp16": (torch.float16, {}, {}, True, {2: "b.weight", 4: "a.bias"}),
    "powersgd_fp16_zero1": (torch.float16, {"use_distributed_optimizer": True},
                            {"use_distributed_optimizer": True}, True, {2: "a.weight", 4: "c.bias"}),
    "powersgd_fp32_overlap": (torch.float32, {}, {"overlap_optim_step": True, "grad_clip": 0.0}, True,
                              {2: "b.weight"}),
}


def _run(rank, ws, name):
    dtype, dkw, okw, use_psgd, inject = SCENARIOS[name]
    torch.manual_seed(0)
    m = Net().to(dtype)
    ddp = DistributedDataParallel(m, DDPConfig(bucket_size=DIM * DIM + DIM, **dkw))  # ~one layer a bucket
    ddp.broadcast_params()
    if use_psgd:
        ddp.register_comm_hook(PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=1, seed=1),
                               powersgd_hook)
    precision = "fp16" if dtype == torch.float16 else "fp32"
    cfg = dict(lr=1e-2, weight_decay=0.1, grad_clip=1.0, precision=precision, initial_loss_scale=1024.0,
               hysteresis=1, loss_scale_growth_interval=100)
    cfg.update(okw)
    opt = build_optimizer(ddp, OptimizerConfig(**cfg))
    params = dict(m.named_parameters())
    step_box = [0]
    if rank == 1:  # overflow on ONE rank only
        for pname in set(inject.values()):
            def hook(g, pname=pname):
                if inject.get(step_box[0]) != pname:
                    return g
                g = g.clone()
                g.view(-1)[3] = float("inf")
                return g
            params[pname].register_hook(hook)
    gen = torch.Generator().manual_seed(7)
    out = {"stepped": [], "scales": [], "ranks_equal": [], "unchanged_at_inject": {},
           "hook_unchanged_at_inject": {}, "bucket_unchanged": {}, "hook_bucket_keys": {}}
    for step in range(STEPS):
        step_box[0] = step
        x, y = torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, 4, generator=gen)
        x, y = x.chunk(ws)[rank], y.chunk(ws)[rank]
        before, hook_before = _flat(m), (_hook_sd(ddp) if use_psgd else None)
        bucket_before = [b.param_data.clone() for b in ddp.buckets]
        opt.zero_grad()
        loss = ((ddp(x.to(dtype)).float() - y) ** 2).mean()
        opt.scale_loss(loss).backward()
        stepped, norm = opt.step()
        opt.finish_param_sync()
        out["stepped"].append(bool(stepped))
        out["scales"].append(opt.loss_scale)
        out["ranks_equal"].append(_ranks_equal(_flat(m), ws))
        if step in inject:
            out["unchanged_at_inject"][step] = bool(torch.equal(before, _flat(m)))
            out["bucket_unchanged"][step] = [bool(torch.equal(a, b.param_data))
                                            for a, b in zip(bucket_before, ddp.buckets)]
            if use_psgd:
                after = _hook_sd(ddp)
                out["hook_unchanged_at_inject"][step] = _sd_equal(hook_before, after)
                # per bucket: did its error/Q entries stay exactly as before?
                per_bucket: dict[int, bool] = {}
                for k in hook_before:
                    if k.startswith(("error.", "q.")):
                        b = int(k.split(".")[1])
                        same = k in after and torch.equal(hook_before[k], after[k])
                        per_bucket[b] = per_bucket.get(b, True) and same
                out["hook_bucket_keys"][step] = per_bucket
    if use_psgd:
        out["iteration"] = int(ddp.comm_hook_state_dict()["iteration"])
        out["hook_finite"] = all(bool(torch.isfinite(v).all()) for v in ddp.comm_hook_state_dict().values()
                                 if torch.is_tensor(v))
    out["inject_bucket"] = {s: ddp.param_to_bucket[params[p]].index for s, p in inject.items()}
    return out


def _worker(rank, ws, out_dir):
    res = {name: _run(rank, ws, name) for name in SCENARIOS}
    torch.save(res, os.path.join(out_dir, f"overflow_rank{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = computed_once(tmp_path_factory, "overflow_on_one_rank", lambda d: spawn(_worker, 2, str(d)) or str(d))
    return [torch.load(os.path.join(out, f"overflow_rank{r}.pt"), weights_only=True) for r in range(2)]


def _both(results, name):
    return results[0][name], results[1][name]


@pytest.mark.parametrize("name", ["fp16_unsharded", "fp16_zero1", "fp16_zero2"])
def test_fp16_overflow_on_one_rank_skips_on_every_rank_and_backs_off(results, name):
    r0, r1 = _both(results, name)
    for r in (r0, r1):
        assert r["stepped"] == [True, False] + [True] * (STEPS - 2), r["stepped"]
        assert r["scales"] == [1024.0] + [512.0] * (STEPS - 1), r["scales"]  # backs off once, then steps
        assert r["unchanged_at_inject"] == {1: True}
        assert all(r["ranks_equal"]), r["ranks_equal"]
    assert r0["stepped"] == r1["stepped"]


@pytest.mark.parametrize("name", ["fp32_overlap_unsharded", "fp32_overlap_zero1"])
def test_overlapped_step_skips_the_overflowing_bucket_on_every_rank(results, name):
    """overlap_optim_step decides per bucket; the decision must be global: the bucket holding the
    inf is left untouched on EVERY rank (in ZeRO only one rank's shard sees the inf), the
    others are stepped, and every rank reports the same `stepped`."""
    r0, r1 = _both(results, name)
    for r in (r0, r1):
        bad = r["inject_bucket"][1]
        assert r["stepped"] == [True, False] + [True] * (STEPS - 2), r["stepped"]
        unchanged = r["bucket_unchanged"][1]
        assert unchanged[bad], unchanged
        assert not all(unchanged), unchanged  # the finite buckets were stepped
        assert all(r["ranks_equal"]), r["ranks_equal"]
    assert r0["bucket_unchanged"] == r1["bucket_unchanged"]


@pytest.mark.parametrize("name", ["powersgd_fp16", "powersgd_fp16_zero1"])
def test_powersgd_overflow_leaves_its_state_untouched_and_training_recovers(results, name):
    """Before: the error/Q buffers became NaN and were kept, every later step was skipped and the
    scale fell from 1024 to 32. Now the overflow steps (one in a compressed matrix, one in an
    uncompressed bias) leave errors, Qs and the iteration exactly as before, on both ranks."""
    r0, r1 = _both(results, name)
    skipped = [2, 4]
    for r in (r0, r1):
        assert r["stepped"] == [s not in skipped for s in range(STEPS)], r["stepped"]
        assert r["scales"] == [1024.0, 1024.0, 512.0, 512.0, 256.0, 256.0], r["scales"]
        assert r["hook_unchanged_at_inject"] == {2: True, 4: True}, r["hook_unchanged_at_inject"]
        assert r["unchanged_at_inject"] == {2: True, 4: True}
        assert r["iteration"] == STEPS - len(skipped)  # skipped steps don't count
        assert r["hook_finite"]
        assert all(r["ranks_equal"]), r["ranks_equal"]


def test_powersgd_overlapped_step_keeps_only_the_skipped_buckets_state(results):
    r0, r1 = _both(results, "powersgd_fp32_overlap")
    for r in (r0, r1):
        bad = r["inject_bucket"][2]
        per_bucket = r["hook_bucket_keys"][2]
        assert per_bucket[bad], per_bucket  # skipped bucket: error/Q exactly as before
        assert not all(per_bucket.values()), per_bucket  # stepped buckets: committed
        assert r["stepped"] == [s != 2 for s in range(STEPS)], r["stepped"]
        assert r["iteration"] == STEPS  # partly stepped: the step counts
        assert all(r["ranks_equal"]), r["ranks_equal"]
    assert math.isfinite(r0["scales"][-1])
