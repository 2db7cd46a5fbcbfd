"""Smallest end-to-end use of the engine; also the multi-node smoke test's worker.

    torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=127.0.0.1 \
        --master_port=29500 -m parallel.examples.train_tiny_ddp --out=/tmp/run
    (and the same with --node_rank=1 on the other node)

Without torchrun it runs as one process (world size 1) through the same code path.
Writes <out>/params_rank<r>.pt (flat fp32 parameters after training).
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn

from optimizer import OptimizerConfig, build_optimizer
from parallel import DDPConfig, DistributedDataParallel
from utils.device import dist_backend, local_rank_from_env, resolve_device, set_device


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))


def batches(steps: int, global_batch: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(global_batch, 16, generator=g), torch.randn(global_batch, 8, generator=g))
            for _ in range(steps)]


def train(steps: int = 5, zero: bool = True, micro: int = 2) -> nn.Module:
    """The trainer's loop in miniature: zero_grad, micro-batches (no_sync on all but the last),
    scale_loss().backward(), step(). Returns the trained module."""
    device = resolve_device("auto", local_rank_from_env())
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = make_model().to(device)
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=256, use_distributed_optimizer=zero))
    ddp.broadcast_params()
    opt = build_optimizer(ddp, OptimizerConfig(lr=1e-2, use_distributed_optimizer=zero,
                                               overlap_param_gather=zero))
    for x, y in batches(steps):
        opt.zero_grad()
        xs, ys = x.chunk(world)[rank].chunk(micro), y.chunk(world)[rank].chunk(micro)
        for i in range(micro):
            with ddp.no_sync() if i < micro - 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(ddp(xs[i].to(device)), ys[i].to(device)) / micro
                opt.scale_loss(loss).backward()
        opt.step()
    opt.finish_param_sync()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-zero", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        device = resolve_device("auto", local_rank_from_env())
        set_device(device)
        dist.init_process_group(dist_backend(device))
    model = train(a.steps, zero=not a.no_zero)
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(a.out, exist_ok=True)
    torch.save(torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()]),
               os.path.join(a.out, f"params_rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()  # let every rank's last collective drain before tearing the group down
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
