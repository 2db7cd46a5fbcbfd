"""Two-process (gloo) checks of DDP, ZeRO-1/2, PowerSGD, fp16 skipping and exact resume.

Process start-up dominates on 2 cores, so ONE spawned job runs every scenario and saves its
measurements; the tests below only assert on them (each rank's results are checked).
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from optimizer import OptimizerConfig, build_optimizer
from parallel import (CommHookState, DDPConfig, DistributedDataParallel, PowerSGDState,
                      allreduce_hook, fp16_compress_wrapper, powersgd_hook)
from parallel.powersgd import compression_plan
from tests.dist_helpers import computed_once, spawn

STEPS, LR, WD, CLIP, GLOBAL_BATCH = 4, 1e-2, 0.1, 0.5, 8


class TinyNet(nn.Module):
    """Several shapes: matrices, biases, a 3-D param, a bias-free layer, an unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.mix = nn.Parameter(torch.randn(4, 2, 2) * 0.3)
        self.fc2 = nn.Linear(16, 16, bias=False)
        self.unused = nn.Linear(3, 3)  # never called: its params get no gradient
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.fc1(x)))
        h = h + (h.view(-1, 4, 4) @ self.mix.view(4, 4).to(h.dtype)).view(-1, 16)
        # head used WITHOUT calling the module (like a tied/fused LM head): overlap_param_gather
        # must still wait for its bucket
        return nn.functional.linear(torch.relu(self.fc2(h)), self.head.weight, self.head.bias)


class MatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                    nn.Linear(32, 32))

    def forward(self, x):
        return self.layers(x)


def make_model(cls=TinyNet, dtype=torch.float32, seed=1234) -> nn.Module:
    torch.manual_seed(seed)
    return cls().to(dtype)


def data(n_steps: int, din: int = 8, dout: int = 4):
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(GLOBAL_BATCH, din, generator=g), torch.randn(GLOBAL_BATCH, dout, generator=g))
            for _ in range(n_steps)]


def loss_fn(out, y):
    return ((out.float() - y) ** 2).mean()


def flat_params(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in m.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def train_step(ddp, opt, x, y, rank, ws, micro=1, loss_mult=1.0):
    opt.zero_grad()
    xs, ys = x.chunk(ws)[rank].chunk(micro), y.chunk(ws)[rank].chunk(micro)
    for i in range(micro):
        ctx = ddp.no_sync() if i < micro - 1 else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(ddp(xs[i].to(next(ddp.parameters()).dtype)), ys[i]) / micro * loss_mult
            opt.scale_loss(loss).backward()
    return opt.step()


def build(ddp_cfg, opt_cfg, hook=None, cls=TinyNet, dtype=torch.float32, seed=1234):
    m = make_model(cls, dtype, seed)
    ddp = DistributedDataParallel(m, ddp_cfg)
    ddp.broadcast_params()
    if hook is not None:
        ddp.register_comm_hook(*hook())
    return m, ddp, build_optimizer(ddp, opt_cfg)


def opt_cfg(**kw) -> OptimizerConfig:
    base = dict(lr=LR, weight_decay=WD, grad_clip=CLIP, betas=(0.9, 0.95), eps=1e-8)
    base.update(kw)
    return OptimizerConfig(**base)


def torch_adamw(m: nn.Module):
    return torch.optim.AdamW([{"params": [p for p in m.parameters() if p.ndim >= 2], "weight_decay": WD},
                              {"params": [p for p in m.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95), eps=1e-8)


def reference(rank, ws, batches, micro, clip, use_ddp: bool):
    """torch DDP (use_ddp) or one process on the full batch, torch AdamW + clip_grad_norm_."""
    m = make_model()
    net = nn.parallel.DistributedDataParallel(m, find_unused_parameters=True) if use_ddp else m
    opt, norms = torch_adamw(m), []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        if use_ddp:
            xs, ys = x.chunk(ws)[rank].chunk(micro), y.chunk(ws)[rank].chunk(micro)
            for i in range(micro):
                ctx = net.no_sync() if i < micro - 1 else contextlib.nullcontext()
                with ctx:
                    (loss_fn(net(xs[i]), ys[i]) / micro).backward()
        else:
            loss_fn(net(x), y).backward()
        for p in m.parameters():  # our optimizer steps unused params with a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip if clip > 0 else 1e30)))
        opt.step()
    return flat_params(m), norms


def equivalence_cases():
    D, Z = dict(use_distributed_optimizer=True), dict(use_distributed_optimizer=True)
    return {  # name: (DDPConfig, OptimizerConfig, hook factory, micro-batches, clip)
        "allreduce_sync": (DDPConfig(overlap_grad_reduce=False), opt_cfg(), None, 1, CLIP),
        "allreduce_overlap_buckets": (DDPConfig(bucket_size=100), opt_cfg(), None, 1, CLIP),
        "allreduce_overlap_accum": (DDPConfig(bucket_size=100), opt_cfg(fused=True), None, 2, CLIP),
        "allreduce_explicit_hook": (DDPConfig(bucket_size=64), opt_cfg(),
                                    lambda: (CommHookState(), allreduce_hook), 1, CLIP),
        "zero1_bytes": (DDPConfig(bucket_size=None, pad_alignment=1, param_alignment=1, **D),
                        opt_cfg(**Z), None, 1, CLIP),
        "zero1_overlap": (DDPConfig(bucket_size=100, **D), opt_cfg(**Z), None, 1, CLIP),
        "zero1_sync_accum": (DDPConfig(overlap_grad_reduce=False, **D), opt_cfg(**Z), None, 2, CLIP),
        "zero2_overlap_accum": (DDPConfig(bucket_size=100, **D), opt_cfg(zero_stage=2, **Z), None, 2, CLIP),
        "zero1_param_gather": (DDPConfig(bucket_size=100, **D), opt_cfg(overlap_param_gather=True, **Z),
                               None, 1, CLIP),
        "overlap_optim_step": (DDPConfig(bucket_size=100), opt_cfg(grad_clip=0.0, overlap_optim_step=True),
                               None, 1, 0.0),
        "zero2_overlap_optim_step": (DDPConfig(bucket_size=100, **D),
                                     opt_cfg(grad_clip=0.0, overlap_optim_step=True, zero_stage=2, **Z),
                                     None, 2, 0.0),
        "fp16_compress": (DDPConfig(bucket_size=100), opt_cfg(),
                          lambda: (CommHookState(), fp16_compress_wrapper(allreduce_hook)), 1, CLIP),
    }


def _equivalence(rank, ws, res):
    batches = data(STEPS)
    refs = {}
    for name, (dcfg, ocfg, hook, micro, clip) in equivalence_cases().items():
        key = (micro, clip)
        if key not in refs:
            refs[key] = (reference(rank, ws, batches, micro, clip, True),
                         reference(rank, ws, batches, micro, clip, False))
        (t_params, t_norms), (f_params, _) = refs[key]
        m, ddp, opt = build(dcfg, ocfg, hook)
        norms = [train_step(ddp, opt, x, y, rank, ws, micro)[1] for x, y in batches]
        opt.finish_param_sync()
        mine = flat_params(m)
        res[name] = {"rel_torch_ddp": rel(mine, t_params), "rel_full_batch": rel(mine, f_params),
                     "norm_rel": max(abs(a - b) / b for a, b in zip(norms, t_norms)),
                     "state_bytes": opt.state_bytes(), "grad_buffer_bytes": ddp.grad_buffer_bytes(),
                     "dtype_kept": all(p.dtype == torch.float32 for p in m.parameters())}


def _powersgd(rank, ws, res):
    st = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=2.0, seed=7)
    m, ddp, opt = build(DDPConfig(bucket_size=1000), opt_cfg(), lambda: (st, powersgd_hook), cls=MatNet)
    per_step = []
    for x, y in data(5, 32, 32):
        train_step(ddp, opt, x, y, rank, ws)
        per_step.append(ddp.last_step_comm_bytes)
    allreduce_bytes = sum(b.numel * 4 for b in ddp.buckets)
    compressed_bytes = 0
    for b in ddp.buckets:
        for s in b.slots:
            ok, n, mm, r = compression_plan(st, s.shape)
            compressed_bytes += (n * r + mm * r) * 4 if ok else s.param.numel() * 4
    gathered = [torch.zeros_like(flat_params(m)) for _ in range(ws)]
    dist.all_gather(gathered, flat_params(m))
    res["powersgd"] = {"per_step": per_step, "allreduce_bytes": allreduce_bytes,
                       "expected_compressed_bytes": compressed_bytes,
                       "rank_ratio_bound": 2 * (32 + 32) / (32 * 32),  # r(n+m)/(nm)
                       "ranks_equal": bool(torch.equal(gathered[0], gathered[1]))}


def _fp16_skip(rank, ws, res):
    cfg = opt_cfg(precision="fp16", initial_loss_scale=1024.0, hysteresis=1, loss_scale_growth_interval=2)
    m, ddp, opt = build(DDPConfig(bucket_size=100, use_distributed_optimizer=True),
                        opt_cfg(**{**cfg.__dict__, "use_distributed_optimizer": True}))
    stepped, scales, unchanged = [], [], None
    for i, (x, y) in enumerate(data(4)):
        before = flat_params(m)
        bad = float("nan") if (i == 1 and rank == 1) else 1.0  # overflow on ONE rank only
        stepped.append(train_step(ddp, opt, x, y, rank, ws, loss_mult=bad)[0])
        scales.append(opt.loss_scale)
        if i == 1:
            unchanged = bool(torch.equal(before, flat_params(m)))
    res["fp16"] = {"stepped": stepped, "scales": scales, "skip_left_params": unchanged}


RESUME_CASES = {
    "resume_powersgd": (DDPConfig(bucket_size=100), opt_cfg(),
                        lambda: (PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=1, seed=3),
                                 powersgd_hook), torch.float32),
    "resume_zero1_powersgd": (DDPConfig(bucket_size=100, use_distributed_optimizer=True),
                              opt_cfg(use_distributed_optimizer=True),
                              lambda: (PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2, seed=4),
                                       powersgd_hook), torch.float32),
    "resume_zero2_bf16": (DDPConfig(bucket_size=100, use_distributed_optimizer=True, grad_reduce_in_fp32=True),
                          opt_cfg(precision="bf16", use_distributed_optimizer=True, zero_stage=2), None,
                          torch.bfloat16),
    "resume_zero1_fp16scale": (DDPConfig(bucket_size=100, use_distributed_optimizer=True),
                               opt_cfg(precision="fp16", use_distributed_optimizer=True,
                                       overlap_param_gather=True, initial_loss_scale=256.0), None,
                               torch.float32),
}
RESUME_TOTAL, RESUME_AT = 6, 3


def _resume(rank, ws, res, out_dir):
    batches = data(RESUME_TOTAL)
    for name, (dcfg, ocfg, hook, dtype) in RESUME_CASES.items():
        m, ddp, opt = build(dcfg, ocfg, hook, dtype=dtype)
        for x, y in batches:
            train_step(ddp, opt, x, y, rank, ws)
        opt.finish_param_sync()
        full = flat_params(m)

        m, ddp, opt = build(dcfg, ocfg, hook, dtype=dtype)
        for x, y in batches[:RESUME_AT]:
            train_step(ddp, opt, x, y, rank, ws)
        path = os.path.join(out_dir, f"{name}_rank{rank}.pt")
        opt_sd = opt.state_dict()  # waits for in-flight param gathers before the model is read
        torch.save({"model": {k: v.clone() for k, v in m.state_dict().items()}, "optim": opt_sd,
                    "hook": ddp.comm_hook_state_dict()}, path)
        del m, ddp, opt
        ck = torch.load(path, weights_only=True)
        m, ddp, opt = build(dcfg, ocfg, hook, dtype=dtype, seed=777)  # different init: load must fix it
        m.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        ddp.load_comm_hook_state_dict(ck["hook"])
        for x, y in batches[RESUME_AT:]:
            train_step(ddp, opt, x, y, rank, ws)
        opt.finish_param_sync()
        res[name] = {"max_abs_diff": float((flat_params(m) - full).abs().max())}
        if rank == 0:
            torch.save(full, os.path.join(out_dir, f"{name}_final.pt"))


def _worker(rank, ws, out_dir):
    res: dict = {}
    _equivalence(rank, ws, res)
    _powersgd(rank, ws, res)
    _fp16_skip(rank, ws, res)
    _resume(rank, ws, res, out_dir)
    torch.save(res, os.path.join(out_dir, f"results_rank{rank}.pt"))


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    out = computed_once(tmp_path_factory, "ddp_two_processes", lambda d: spawn(_worker, 2, str(d)) or str(d))
    return out, [torch.load(os.path.join(out, f"results_rank{r}.pt"), weights_only=True) for r in range(2)]


@pytest.mark.parametrize("case", list(equivalence_cases()))
def test_ddp_matches_torch_ddp_and_full_batch(dist_results, case):
    tol = 5e-3 if case == "fp16_compress" else 1e-6
    for res in dist_results[1]:
        r = res[case]
        assert r["rel_torch_ddp"] < tol, r
        assert r["rel_full_batch"] < tol, r
        assert r["dtype_kept"]
        if case != "fp16_compress" and "overlap_optim_step" not in case:
            assert r["norm_rel"] < 1e-5, r  # global clip norm == torch's (ZeRO all-reduces it)


def test_zero_shards_optimizer_state(dist_results):
    for res in dist_results[1]:
        full, shard = res["allreduce_sync"]["state_bytes"], res["zero1_bytes"]["state_bytes"]
        assert full == 2 * 4 * sum(p.numel() for p in make_model().parameters())  # exp_avg + exp_avg_sq
        assert abs(shard - full / 2) <= 8 * 2, (shard, full)  # 1/world, up to one odd element
    total = sum(res["zero1_bytes"]["state_bytes"] for res in dist_results[1])
    assert total == dist_results[1][0]["allreduce_sync"]["state_bytes"]


def test_zero2_frees_unowned_grad_memory(dist_results):
    for res in dist_results[1]:
        assert res["zero2_overlap_accum"]["grad_buffer_bytes"] == 0
        assert res["zero1_overlap"]["grad_buffer_bytes"] > 0


def test_powersgd_bytes_and_consistency(dist_results):
    for res in dist_results[1]:
        p = res["powersgd"]
        assert p["per_step"][:2] == [p["allreduce_bytes"]] * 2  # plain all-reduce before start iter
        assert p["per_step"][2:] == [p["expected_compressed_bytes"]] * 3
        # rank 2 on 32x32 matrices: r(n+m)/(nm) = 1/8 of the matrix bytes; biases go uncompressed
        matrix_bytes = 3 * 32 * 32 * 4
        assert p["expected_compressed_bytes"] <= matrix_bytes * p["rank_ratio_bound"] + 3 * 32 * 4
        assert p["ranks_equal"]


def test_fp16_overflow_on_one_rank_skips_everywhere(dist_results):
    for res in dist_results[1]:
        f = res["fp16"]
        assert f["stepped"] == [True, False, True, True]
        assert f["scales"] == [1024.0, 512.0, 512.0, 1024.0]  # halves, then grows after 2 clean steps
        assert f["skip_left_params"]


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_is_exact(dist_results, case):
    for res in dist_results[1]:
        assert res[case]["max_abs_diff"] == 0.0, res[case]


def test_zero_state_reshards_2_to_1(dist_results):
    """Load both ranks' ZeRO shards into ONE process and continue on the full batch."""
    out = dist_results[0]
    name = "resume_zero1_fp16scale"
    dcfg, ocfg, _, dtype = RESUME_CASES[name]
    cks = [torch.load(os.path.join(out, f"{name}_rank{r}.pt"), weights_only=True) for r in range(2)]
    batches = data(RESUME_TOTAL)
    for distributed in (True, False):
        d = DDPConfig(bucket_size=dcfg.bucket_size, use_distributed_optimizer=distributed)
        o = opt_cfg(precision="fp16", use_distributed_optimizer=distributed, initial_loss_scale=256.0)
        m, ddp, opt = build(d, o, seed=5)
        m.load_state_dict(cks[0]["model"])
        if distributed:
            with pytest.raises(ValueError, match="re-shard"):
                opt.load_state_dict(cks[0]["optim"])  # one shard of a 2-rank run: clear error
        opt.load_state_dict([ck["optim"] for ck in cks])
        for x, y in batches[RESUME_AT:]:
            train_step(ddp, opt, x, y, 0, 1)
        opt.finish_param_sync()
        final = torch.load(os.path.join(out, f"{name}_final.pt"), weights_only=True)
        assert rel(flat_params(m), final) < 1e-5
