"""--optimizer=muon at world 2 (gloo, CPU): ZeRO-1 and ZeRO-2 (shards cut the matrices) equal plain DDP at
world 2 bit for bit (each matrix is gathered whole, orthogonalised once on its owner, scattered back), and
one process on the global batch within the reference's own rounding, after 5 steps; the bytes Muon adds to
a step's collectives are measured and equal the formula optimizer/muon.py states."""
from __future__ import annotations

import os

import torch

from optimizer import OptimizerConfig, build_optimizer
from parallel import DDPConfig, DistributedDataParallel
from tests.optimizer.test_muon import (STEPS, batches, max_diff, muon_config, our_run, reference_run,
                                       tiny_model)

LAYOUTS = {"plain": dict(), "zero1": dict(use_distributed_optimizer=True, zero_stage=1),
           "zero2": dict(use_distributed_optimizer=True, zero_stage=2)}


def _ddp_cfg(zero: bool) -> DDPConfig:
    # small buckets, no alignment padding: several buckets, and shards that cut matrices anywhere
    return DDPConfig(use_distributed_optimizer=zero, bucket_size=3000, pad_alignment=1, param_alignment=1)


def _run(rank: int, ws: int, layout: str, kind: str = "muon") -> dict:
    import torch.distributed as dist
    from utils import comm
    zero = layout != "plain"
    # clipping off: ZeRO sums the squared norm shard by shard (other bits of the clip coefficient than plain
    # DDP's); clipping itself is compared with torch in test_muon.py
    cfg = muon_config(grad_clip=0.0, **LAYOUTS[layout]) if kind == "muon" else OptimizerConfig(
        lr=3e-3, grad_clip=0.0, **LAYOUTS[layout])
    model = tiny_model(torch.float32)
    ddp = DistributedDataParallel(model, _ddp_cfg(zero))
    opt = build_optimizer(ddp, cfg)
    counted = {"bytes": 0, "on": False}
    originals = (comm._all_gather, comm._reduce_scatter, dist.all_to_all_single)

    def counting(fn):
        def wrapper(out, inp, **kw):
            if counted["on"]:
                # the full (unsharded) side of the collective: all-gather's output, reduce-scatter's input
                counted["bytes"] += max(out.numel(), inp.numel()) * out.element_size()
            return fn(out, inp, **kw)
        return wrapper
    def all_to_all(out, inp, out_sizes, in_sizes, **kw):
        if counted["on"]:  # the bytes this rank sends to the other ranks
            counted["bytes"] += sum(n for r, n in enumerate(in_sizes) if r != rank) * inp.element_size()
        return originals[2](out, inp, out_sizes, in_sizes, **kw)
    comm._all_gather, comm._reduce_scatter = counting(originals[0]), counting(originals[1])
    dist.all_to_all_single = all_to_all
    split = False
    try:
        for x, y in batches():
            half = x.shape[0] // ws
            opt.zero_grad()
            ddp(x[rank * half:(rank + 1) * half], labels=y[rank * half:(rank + 1) * half]).backward()
            counted["on"] = True
            assert opt.step()[0]
            counted["on"] = False
        if kind == "muon" and zero:
            split = any(0 < m.piece.hi - m.piece.lo < m.numel for m in opt.muon.matrices if m.piece is not None)
    finally:
        comm._all_gather, comm._reduce_scatter, dist.all_to_all_single = originals
    out = {"params": {n: p.detach().double().clone() for n, p in model.named_parameters()},
           "step_bytes": counted["bytes"], "split": split, "state": opt.state_dict() if kind == "muon" else None}
    if kind == "muon" and zero:
        # counted here from the buckets: matrix k (in bucket order) is owned by the rank holding most of it (ties:
        # k % W first); this rank sends the owners the elements of its shards it does not own, and sends back
        # its own matrices' elements that the other ranks' shards hold, 2 bytes (bf16) each
        sent, k = 0, 0
        for b in ddp.buckets:
            for s in b.slots:
                if s.name.startswith("layers.") and s.param.ndim == 2:
                    held = [max(0, min(b.shard_range(r, ws)[1], s.end) - max(b.shard_range(r, ws)[0], s.start))
                            for r in range(ws)]
                    owner = max(range(ws), key=lambda r: (held[r], -((r - k) % ws)))
                    sent += sum(held[r] for r in range(ws) if (r == rank) != (owner == rank))
                    k += 1
        out["formula"] = STEPS * 2 * sent
        out["muon_numel"] = sum(m.numel for m in opt.muon.matrices)
        out["counted_by_muon"] = opt.muon.comm_bytes
        out["owners"] = sorted({m.owner for m in opt.muon.matrices})
    return out


def _worker(rank: int, ws: int, d: str) -> None:
    res = {layout: _run(rank, ws, layout) for layout in LAYOUTS}
    res["adamw_zero1"] = _run(rank, ws, "zero1", kind="adamw")
    torch.save(res, os.path.join(d, f"rank{rank}.pt"))


def test_zero_world2_equals_one_process(tmp_path):
    from tests.dist_helpers import spawn
    spawn(_worker, 2, str(tmp_path))
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    cfg, data = muon_config(grad_clip=0.0), batches()
    ref32 = reference_run(tiny_model(torch.float32), cfg, data)
    ref64 = reference_run(tiny_model(torch.float64), cfg, data)
    tol = max_diff(ref32, ref64)  # the reference's own rounding (module docstring of test_muon.py)
    one, _, _ = our_run(tiny_model(torch.float32), cfg, data)
    for r in range(2):
        plain = res[r]["plain"]["params"]
        for layout in ("zero1", "zero2"):
            got = res[r][layout]
            assert got["split"], layout  # some Muon matrix really is cut between the ranks
            assert got["owners"] == [0, 1]  # the orthogonalisations are spread over both ranks
            # the same reduced gradients: the gather / owner / scatter path changes no bit
            assert max_diff(got["params"], plain) == 0.0, layout
            assert max_diff(got["params"], ref32) <= tol, (layout, max_diff(got["params"], ref32), tol)
            # bytes: what Muon adds to the step's collectives (measured against AdamW under the same ZeRO)
            # equals the stated formula, about 2 x 2 bytes x (W-1)/W x the Muon elements of a rank's shards
            extra = got["step_bytes"] - res[r]["adamw_zero1"]["step_bytes"]
            if layout == "zero1":
                assert extra == got["formula"] == got["counted_by_muon"], (extra, got["formula"])
                assert 0 < extra <= STEPS * 2 * 2 * got["muon_numel"] / 2  # at most ~2 x 2 B x P_muon / W
        assert max_diff(plain, one) <= tol
    assert max_diff(res[0]["zero1"]["params"], res[1]["zero1"]["params"]) == 0.0  # the ranks agree
    # across world sizes: both ranks' ZeRO-2 states load into one process (plain and ZeRO), the momentum and
    # the masters element for element
    sds = [res[r]["zero2"]["state"] for r in range(2)]
    full: dict = {}
    for sd in sds:
        for name, e in sd["params"].items():
            for k in ("main", "momentum", "exp_avg"):
                if k in e:
                    full.setdefault((name, k), torch.full((e["numel"],), float("nan")))[e["lo"]:e["hi"]] = e[k]
    assert any(k == "momentum" for _, k in full) and all(not t.isnan().any() for t in full.values())
    for zero in (False, True):
        model = tiny_model(torch.float32)
        opt = build_optimizer(DistributedDataParallel(model, _ddp_cfg(zero)),
                              muon_config(grad_clip=0.0, use_distributed_optimizer=zero))
        opt.load_state_dict(sds)
        for m in opt.muon.matrices:
            assert torch.equal(m.momentum, full[(m.name, "momentum")]), m.name
            assert torch.equal(m.piece.main.detach().reshape(-1), full[(m.name, "main")]), m.name
        assert opt.muon.steps == STEPS


MOE_LAYOUTS = {2: {"zero1": dict(parallel="ddp", use_distributed_optimizer=True), "fsdp": dict(parallel="fsdp"),
                   "ep2_zero1": dict(parallel="ddp", use_distributed_optimizer=True, expert_parallel_size=2),
                   "ep2_fsdp": dict(parallel="fsdp", expert_parallel_size=2)},
               # the experts' ZeRO shards cut over the 2 ranks holding the same ones (Muon's expert domain)
               4: {"ep2_zero1": dict(parallel="ddp", use_distributed_optimizer=True, expert_parallel_size=2,
                                     bucket_size=3000)}}


def _moe_step(layout: dict) -> dict:
    """One Muon step of the MoE model through the trainer's engine (clipping off), every weight gathered whole."""
    import dataclasses
    from torch.distributed.tensor import DTensor
    from parallel.build import build_engine
    from tests.optimizer.test_muon_fsdp import FLAGS
    from trainer.config import TrainConfig
    cfg = dataclasses.replace(TrainConfig(), dtype="fp32", device="cpu", **FLAGS, **layout)
    engine = build_engine(tiny_model(torch.float32, moe=True), cfg, device=torch.device("cpu"))
    for x, y in batches(1):
        n = x.shape[0] // engine.dp_size
        rows = slice(engine.dp_rank * n, (engine.dp_rank + 1) * n)
        engine.optimizer.zero_grad()
        engine.forward_backward([{"input_ids": x[rows], "labels": y[rows]}],
                                lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {}),
                                float(y.numel()))
        assert engine.optimizer.step()[0]
    whole = dict(engine.module.named_parameters())
    if getattr(engine, "expert_state", None) is not None:  # our DDP's expert shards gathered (collective)
        whole.update(engine.expert_state.full_shards())
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().clone() for n, p in whole.items()}


def _moe_worker(rank: int, ws: int, d: str) -> None:
    res = {name: _moe_step(layout) for name, layout in MOE_LAYOUTS[ws].items()}
    if rank == 0:
        torch.save(res, os.path.join(d, f"moe{ws}.pt"))


def test_moe_experts_under_zero_fsdp2_and_expert_parallel_equal_one_process(tmp_path):
    """Muon on the stacked experts (tests/optimizer/test_muon.py) under ZeRO-1 (the stacks cut between the ranks,
    assembled on their owner), FSDP2 (row shards: whole experts per rank), expert parallelism 2 with ZeRO-1 (the
    experts' matrices exchanged only among the ranks holding the same experts: at 4 ranks 2 of them) and with
    FSDP2: one step equals one process's within one bf16 rounding of each orthogonalised update (the reduced
    gradients' last bits may round Newton-Schulz's bf16 products differently), AdamW's weights within fp32's."""
    from tests.dist_helpers import spawn
    from tests.optimizer.test_muon import bf16_step_bound
    from optimizer.muon import is_muon_param
    cfg = muon_config(grad_clip=0.0)
    one, _, _ = our_run(tiny_model(torch.float32, moe=True), cfg, batches(1))
    for ws in (2, 4):
        spawn(_moe_worker, ws, str(tmp_path))
        for name, got in torch.load(tmp_path / f"moe{ws}.pt", weights_only=True).items():
            assert got.keys() == one.keys()
            for n, want in one.items():
                bound = bf16_step_bound(cfg, n, tuple(want.shape)) if is_muon_param(n, want.shape) else 1e-6
                assert float((got[n] - want).abs().max()) <= bound, (ws, name, n, float((got[n] - want).abs().max()))
