"""Benchmark: the training stall per checkpoint save, synchronous vs --async_checkpoint=true.

    .venv/bin/python bench/bench_checkpoint_stall.py                      # llama-60M, fp32, 5 saves each (~3 min)
    .venv/bin/python bench/bench_checkpoint_stall.py --dim=768 --n_layers=12  # ~110M parameters

Issue 35's goal: "async saves stall the step <= 0.2x of a synchronous save, at a model size where the write
dominates". One process on CPU, our DDP engine + AdamW (world size 1, fp32), built the trainer's way
(parallel/build.build_engine from a TrainConfig). For each mode the same model (same seed) trains
`--steps_between` optimizer steps (batch 1 x 64 tokens) between saves; the stall of a save is the wall time
of the save call (checkpoint/plain.py save_replicated) on the training thread, what a step waits for:
  sync   the whole protocol: files, fsync, manifest (sha256 of every file), publish, pruning;
  async  the wait for the previous background write (if it has not finished) + copying the state into the
         reused host buffers + creating step_N.tmp; the files are written by the writer thread meanwhile.
The checkpoint (weights + Adam moments + RNG) of llama-60M is ~0.7 GB. Printed: every save's stall, the median
per mode, the ratio async / sync, the background writes' durations and the steps' own times in each mode (the
writer thread competes with the training for the CPU and the disk: that cost is shown, not hidden). Nothing is
asserted.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model import ModelConfig, Transformer  # noqa: E402
from parallel.build import build_engine  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from checkpoint.async_writer import AsyncCheckpointer  # noqa: E402
from checkpoint.plain import save_replicated  # noqa: E402
from checkpoint.protocol import SaveJob  # noqa: E402
from checkpoint.rng import capture_rng_state  # noqa: E402
from checkpoint.verify import find_latest_valid  # noqa: E402
from utils.checkpoint_layout import step_dir_name  # noqa: E402
from utils.disk_space import tree_bytes  # noqa: E402


def build(args):
    torch.manual_seed(0)
    mcfg = ModelConfig(vocab_size=args.vocab_size, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                       max_seq_len=64)
    model = Transformer(mcfg)
    engine = build_engine(model, TrainConfig(dtype="fp32", device="cpu", learning_rate=1e-4, weight_decay=0.1))
    return engine, mcfg, sum(p.numel() for p in model.parameters())


def step(engine, g: torch.Generator, vocab: int) -> float:
    x = torch.randint(0, vocab, (1, 65), generator=g)
    t0 = time.perf_counter()
    opt = engine.optimizer
    opt.zero_grad()
    loss = engine.model(x[:, :-1], labels=x[:, 1:], reduction="sum")
    opt.scale_loss(loss / 64).backward()
    opt.step()
    return time.perf_counter() - t0


def run(mode: str, args) -> dict:
    out = os.path.join(args.out, mode)
    shutil.rmtree(out, ignore_errors=True)
    engine, mcfg, n_params = build(args)
    writer = AsyncCheckpointer(log=lambda m: None) if mode == "async" else None
    g = torch.Generator().manual_seed(1)
    step(engine, g, args.vocab_size)  # the optimizer's state exists before the first save
    stalls, step_times, writes, waits = [], [], [], []
    for i in range(1, args.saves + 1):
        step_times += [step(engine, g, args.vocab_size) for _ in range(args.steps_between)]
        t0 = time.perf_counter()
        save_replicated(engine, SaveJob(out, i, trainer_state={"bench": i}, model_config=mcfg.to_dict(),
                                        run_config={"mode": mode},
                                        extra_state={"rng": capture_rng_state(torch.device("cpu"))}, keep_last=2,
                                        log=lambda m: None), writer)
        stalls.append(time.perf_counter() - t0)
        if writer is not None:
            waits.append(writer.last_wait_s)
            if i > 1:
                writes.append(writer.last_write_s)
    final_wait = 0.0
    if writer is not None:
        t0 = time.perf_counter()
        writer.wait()
        final_wait = time.perf_counter() - t0
        writes.append(writer.last_write_s)
        writer.close()
    latest = find_latest_valid(out, log=lambda m: None)
    assert latest is not None and latest.endswith(step_dir_name(args.saves)), latest
    size = tree_bytes(latest)
    shutil.rmtree(out, ignore_errors=True)
    return {"params": n_params, "stalls": stalls, "steps": step_times, "writes": writes, "waits": waits,
            "final_wait": final_wait,
            "bytes": size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab_size", type=int, default=32000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--n_layers", type=int, default=8)
    ap.add_argument("--n_heads", type=int, default=8)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--steps_between", type=int, default=10, help="optimizer steps between two saves (enough for a "
                    "background write to finish before the next save: otherwise the next save waits for it)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CI box has 2 shared cores)")
    ap.add_argument("--out", default="/tmp/bench_checkpoint_stall", help="where the checkpoints are written")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = {mode: run(mode, args) for mode in ("sync", "async")}
    s, a = res["sync"], res["async"]
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s); {s['params'] / 1e6:.1f}M parameters, fp32 + "
          f"AdamW; checkpoint {s['bytes'] / 2**30:.2f} GiB on {args.out}; {args.saves} saves, "
          f"{args.steps_between} steps (batch 1 x 64 tokens) between saves")
    for mode in ("sync", "async"):
        r = res[mode]
        print(f"  {mode:5s} stall per save: " + ", ".join(f"{x:.3f}" for x in r["stalls"]) +
              f" s (median {statistics.median(r['stalls']):.3f} s); step median {statistics.median(r['steps']):.3f} s")
    print("  async: of each stall, waiting for the previous write: " + ", ".join(f"{x:.3f}" for x in a["waits"]) + " s")
    print("  async background writes: " + ", ".join(f"{x:.2f}" for x in a["writes"]) +
          f" s; wait at the end of the run {a['final_wait']:.2f} s")
    ratio = statistics.median(a["stalls"]) / statistics.median(s["stalls"])
    print(f"stall ratio async / sync (medians): {ratio:.3f} (goal <= 0.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
