"""Smallest end-to-end use of the engine; also the multi-node smoke test's worker.

    torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=127.0.0.1 \
        --master_port=29500 -m parallel.examples.train_tiny_ddp --out=/tmp/run
    (and the same with --node_rank=1 on the other node)

Without torchrun it runs as one process (world size 1) through the same code path.
Writes <out>/params_rank<r>.pt (flat fp32 parameters after training); with --torch_ddp_reference
it also trains the same model on the same batches with torch's own DDP + AdamW + clip_grad_norm_
and writes <out>/torch_ddp_rank<r>.pt, the reference the multi-node test compares against.
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


LR, WD, BETAS, EPS, CLIP = 1e-2, 0.1, (0.9, 0.95), 1e-8, 1.0


def train(steps: int = 5, zero: bool = True, micro: int = 2, device_name: str = "auto") -> nn.Module:
    """The trainer's loop in miniature: zero_grad, micro-batches (no_sync on all but the last),
    scale_loss().backward(), step(). Returns the trained module."""
    device = resolve_device(device_name, local_rank_from_env())
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = make_model().to(device)
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=256, use_distributed_optimizer=zero))
    ddp.broadcast_params()
    opt = build_optimizer(ddp, OptimizerConfig(lr=LR, weight_decay=WD, betas=BETAS, eps=EPS, grad_clip=CLIP,
                                               use_distributed_optimizer=zero, overlap_param_gather=zero))
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


def train_torch_ddp(steps: int = 5, micro: int = 2, device_name: str = "auto") -> nn.Module:
    """The same run with torch.nn.parallel.DistributedDataParallel, torch AdamW (decay on matrices
    only, as ours) and clip_grad_norm_: the reference our engine is held to."""
    device = resolve_device(device_name, local_rank_from_env())
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = make_model().to(device)
    net = nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": WD},
                             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    for x, y in batches(steps):
        opt.zero_grad(set_to_none=True)
        xs, ys = x.chunk(world)[rank].chunk(micro), y.chunk(world)[rank].chunk(micro)
        for i in range(micro):
            no_sync = net.no_sync() if (i < micro - 1 and net is not model) else contextlib.nullcontext()
            with no_sync:
                (nn.functional.mse_loss(net(xs[i].to(device)), ys[i].to(device)) / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return model


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-zero", action="store_true")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (tests pass cpu)")
    ap.add_argument("--torch_ddp_reference", action="store_true",
                    help="also train with torch DDP and write torch_ddp_rank<r>.pt")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        device = resolve_device(a.device, local_rank_from_env())
        set_device(device)
        dist.init_process_group(dist_backend(device))
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(a.out, exist_ok=True)
    torch.save(_flat(train(a.steps, zero=not a.no_zero, device_name=a.device)),
               os.path.join(a.out, f"params_rank{rank}.pt"))
    if a.torch_ddp_reference:
        torch.save(_flat(train_torch_ddp(a.steps, device_name=a.device)), os.path.join(a.out, f"torch_ddp_rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()  # let every rank's last collective drain before tearing the group down
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
