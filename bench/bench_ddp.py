"""Benchmark: our DDP / ZeRO / PowerSGD vs torch DDP on 2 CPU gloo processes (ratios printed).

    .venv/bin/python bench/bench_ddp.py                # ~60M-param Llama (vocab 32000, dim 512, 8 layers, seq 512)
    .venv/bin/python bench/bench_ddp.py --quality-steps 0   # skip the PowerSGD loss comparison

Part 1 (same process pair, same input, same init): median step time (zero_grad + fwd + bwd +
optimizer step), payload bytes handed to collectives per step, optimizer-state bytes per rank.
Part 2: loss on the bundled corpus (byte-level tokens of data/pretrain/*.jsonl, small model)
with plain all-reduce vs PowerSGD, to document PowerSGD's quality margin.
Nothing is asserted; timings on a shared 2-core box are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model import ModelConfig, Transformer  # noqa: E402
from optimizer import OptimizerConfig, build_optimizer  # noqa: E402
from parallel import DDPConfig, DistributedDataParallel, PowerSGDState, powersgd_hook  # noqa: E402

TORCH_BUCKET_MB = 25
QUALITY_VARIANTS = ["torch_ddp_powersgd_r4", "allreduce", "powersgd_r4"]
BUCKET_ELEMS = TORCH_BUCKET_MB * 2**20 // 4  # the same 25 MiB buckets as torch DDP (fp32)


def big_model(seq: int) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=32000, dim=512, n_layers=8, n_heads=8, max_seq_len=seq))


def _time_steps(step_fn, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t)
    return times


def _torch_setup(seq: int, ids: torch.Tensor):
    """torch DDP (25 MiB buckets) + torch AdamW (foreach) + clip_grad_norm_: the reference."""
    m = big_model(seq)
    tddp = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=TORCH_BUCKET_MB)
    topt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def step():
        topt.zero_grad(set_to_none=True)
        tddp(ids, labels=ids).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        topt.step()

    def stats() -> dict:
        state = sum(v.numel() * v.element_size() for s in topt.state.values() for k, v in s.items()
                    if k != "step")
        return {"bytes": sum(p.numel() * p.element_size() for p in m.parameters()), "grad_bytes": 0,
                "gather_bytes": 0, "state_bytes": state}

    return step, stats


def _our_setup(seq: int, ids: torch.Tensor, dcfg: DDPConfig, ocfg: OptimizerConfig, psgd):
    m = big_model(seq)
    ddp = DistributedDataParallel(m, dcfg)
    if psgd is not None:
        ddp.register_comm_hook(psgd, powersgd_hook)
    opt = build_optimizer(ddp, ocfg)
    gather_start = [0]

    def step():
        gather_start[0] = getattr(opt, "param_gather_bytes", 0)
        opt.zero_grad()
        opt.scale_loss(ddp(ids, labels=ids)).backward()
        opt.step()

    def stats() -> dict:
        opt.finish_param_sync()
        gather = getattr(opt, "param_gather_bytes", 0) - gather_start[0]
        return {"bytes": ddp.last_step_comm_bytes + gather, "grad_bytes": ddp.last_step_comm_bytes,
                "gather_bytes": gather, "state_bytes": opt.state_bytes()}

    return step, stats


def perf_part(rank: int, ws: int, a) -> dict:
    """Every configuration is timed INTERLEAVED with torch DDP (torch step, our step, torch step,
    ...): the box is shared, so only step-by-step alternation gives a fair ratio."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 32000, (a.batch, a.seq), generator=g)
    torch_step, torch_stats = _torch_setup(a.seq, ids)
    torch_step()  # warm-up (allocates Adam state)
    configs = {
        "ours_allreduce": (DDPConfig(bucket_size=BUCKET_ELEMS), OptimizerConfig(lr=1e-4), None),
        "ours_zero1": (DDPConfig(bucket_size=BUCKET_ELEMS, use_distributed_optimizer=True),
                       OptimizerConfig(lr=1e-4, use_distributed_optimizer=True), None),
        "ours_zero2_overlap_gather": (DDPConfig(bucket_size=BUCKET_ELEMS, use_distributed_optimizer=True),
                                      OptimizerConfig(lr=1e-4, use_distributed_optimizer=True, zero_stage=2,
                                                      overlap_param_gather=True), None),
    }
    for r in a.powersgd_ranks:
        configs[f"ours_powersgd_r{r}"] = (DDPConfig(bucket_size=BUCKET_ELEMS), OptimizerConfig(lr=1e-4),
                                          PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=1))
    out = {"torch_ddp": {"time": 0.0, "ratio": 1.0, **torch_stats()}}
    all_torch: list[float] = []
    for name, (dcfg, ocfg, psgd) in configs.items():
        step, stats = _our_setup(a.seq, ids, dcfg, ocfg, psgd)
        step()  # warm-up (and PowerSGD's uncompressed iteration 0)
        t_ref, t_our = [], []
        for _ in range(a.steps):
            t_ref += _time_steps(torch_step, 1)
            t_our += _time_steps(step, 1)
        all_torch += t_ref
        out[name] = {"time": statistics.median(t_our),
                     "ratio": statistics.median(o / r for o, r in zip(t_our, t_ref)), **stats()}
        del step, stats
    out["torch_ddp"]["time"] = statistics.median(all_torch)
    return out


def _byte_corpus(n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    text = ""
    for f in sorted(os.listdir(os.path.join(ROOT, "data", "pretrain"))):
        with open(os.path.join(ROOT, "data", "pretrain", f), encoding="utf-8") as fh:
            text += "".join(json.loads(line)["text"] + "\n" for line in fh if line.strip())
    data = torch.tensor(list(text.encode("utf-8")[: 2 * n_tokens]), dtype=torch.long)
    return data[: n_tokens], data[n_tokens:]


def quality_part(rank: int, ws: int, a) -> dict:
    """Byte-level LM on the bundled corpus, same data order and init for every variant:
    our all-reduce, our PowerSGD rank 4, and torch DDP's own PowerSGD hook (reference)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    seq, batch, rank4_start = 128, 4, 10
    train, val = _byte_corpus(400_000)
    n = (len(val) - 1) // seq * seq
    vx, vy = val[:n].view(-1, seq)[:64], val[1:n + 1].view(-1, seq)[:64]
    out = {}
    for name in QUALITY_VARIANTS:
        dist.barrier()
        torch.manual_seed(0)
        m = Transformer(ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=seq))
        if name.startswith("torch"):
            # One bucket (an explicit cap also sets the first-bucket cap): torch's PowerSGD issues
            # its P/Q all-reduces from future callbacks, which race with the next bucket's
            # collectives on gloo (collective mismatch). Ours issues everything in bucket order.
            net = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=100)
            net.register_comm_hook(torch_psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=rank4_start,
                min_compression_rate=2.0), torch_psgd.powerSGD_hook)
            topt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)

            def step(x, y):
                topt.zero_grad(set_to_none=True)
                loss = net(x, labels=y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                topt.step()
                return loss
        else:
            net = DistributedDataParallel(m, DDPConfig())
            if name == "powersgd_r4":
                net.register_comm_hook(PowerSGDState(matrix_approximation_rank=4,
                                                     start_powerSGD_iter=rank4_start), powersgd_hook)
            opt = build_optimizer(net, OptimizerConfig(lr=3e-3, weight_decay=0.0))

            def step(x, y):
                opt.zero_grad()
                loss = net(x, labels=y)
                opt.scale_loss(loss).backward()
                opt.step()
                return loss
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(a.quality_steps):
            starts = torch.randint(0, len(train) - seq - 1, (ws * batch,), generator=g)[rank * batch:(rank + 1) * batch]
            x = torch.stack([train[s:s + seq] for s in starts])
            y = torch.stack([train[s + 1:s + seq + 1] for s in starts])  # labels are pre-shifted
            losses.append(float(step(x, y).detach()))
        with torch.no_grad():
            vloss = float(m(vx, labels=vy))
        out[name] = {"train_last10": statistics.mean(losses[-10:]), "val": vloss}
    return out


def _worker(rank: int, ws: int, port: int, a, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    res = {"perf": perf_part(rank, ws, a) if a.steps > 0 else {}}
    if a.quality_steps > 0:
        res["quality"] = quality_part(rank, ws, a)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after 1 warm-up)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--powersgd-ranks", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--quality-steps", type=int, default=150)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join("/tmp", f"bench_ddp_{os.getpid()}.json")
    t0 = time.time()
    mp.start_processes(_worker, args=(2, port, a, path), nprocs=2, start_method="spawn")
    with open(path) as f:
        res = json.load(f)
    perf = res["perf"]
    if perf:
        ref = perf["torch_ddp"]
        n = 2
        print(f"{'config':28s} {'step s':>8s} {'vs torch*':>9s} {'payload MB':>11s} {'ring wire MB':>13s} "
              f"{'wire vs torch':>14s} {'optim state MB/rank':>20s}")

        def wire(name: str, r: dict) -> float:
            # ring all-reduce sends 2(n-1)/n of its payload per rank; reduce-scatter and
            # all-gather (n-1)/n each. PowerSGD's P/Q and the plain part are all-reduces.
            if "zero" in name:
                return (r["grad_bytes"] + r["gather_bytes"]) * (n - 1) / n
            return r["bytes"] * 2 * (n - 1) / n

        for name, r in perf.items():
            print(f"{name:28s} {r['time']:8.3f} {r['ratio']:9.3f} {r['bytes'] / 2**20:11.2f} "
                  f"{wire(name, r) / 2**20:13.2f} {wire(name, r) / wire('torch_ddp', ref):14.4f} "
                  f"{r['state_bytes'] / 2**20:20.1f}")
        print("* median over rounds of (our step time / the torch DDP step timed right before it)")
    if "quality" in res:
        q = res["quality"]
        for name, r in q.items():
            print(f"quality {name:22s} train loss (last 10) {r['train_last10']:.4f}  val loss {r['val']:.4f}")
        print(f"ours PowerSGD r4 - all-reduce: val loss {q['powersgd_r4']['val'] - q['allreduce']['val']:+.4f}; "
              f"torch's PowerSGD r4 - all-reduce: {q['torch_ddp_powersgd_r4']['val'] - q['allreduce']['val']:+.4f}")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
