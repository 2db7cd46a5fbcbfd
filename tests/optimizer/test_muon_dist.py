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
