"""Convergence bench: --optimizer=muon vs adamw on the bundled corpus, same model, data and token budget.

Each optimizer runs a small learning-rate sweep (the same values for both: under the Moonlight convention,
--muon_adjust_lr=match_rms_adamw, an AdamW learning rate carries over to Muon); the best run of each (lowest
final validation loss) is compared: the steps each needs to reach AdamW's final validation loss (linearly
interpolated between evaluations), their ratio, and the optimizer step's time (the project's
MixedPrecisionOptimizer.step on our DDP engine at world 1, the trainer's code path) with its extra time.

    python bench/bench_muon.py                       # defaults below (CPU, ~10-15 min on 2 cores)
    python bench/bench_muon.py --steps=100 --lrs=3e-3,1e-2 --dim=64

The tokenizer is trained once with the project's command into --work_dir (kept: later runs reuse it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model.config import ModelConfig  # noqa: E402
from model.llama import Transformer  # noqa: E402
from optimizer import OptimizerConfig, build_optimizer  # noqa: E402
from parallel import DDPConfig, DistributedDataParallel  # noqa: E402


def tokens_of_corpus(work_dir: str, vocab: int) -> torch.Tensor:
    """The bundled corpus (data/pretrain) tokenized with a BPE tokenizer trained by the project's command."""
    tok_dir = os.path.join(work_dir, f"tok{vocab}")
    cache = os.path.join(work_dir, f"tokens{vocab}.pt")
    if os.path.exists(cache):
        return torch.load(cache, weights_only=True)
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        subprocess.run([sys.executable, "-m", "tokenizer.train_tokenizer", "--data_dir=data/pretrain",
                        f"--output_dir={tok_dir}", f"--vocab_size={vocab}", "--tokenizer_type=hf_bbpe"],
                       cwd=ROOT, check=True)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    ids: list[int] = []
    for name in sorted(os.listdir(os.path.join(ROOT, "data", "pretrain"))):
        with open(os.path.join(ROOT, "data", "pretrain", name), encoding="utf-8") as f:
            for line in f:
                ids.extend(tok.encode(json.loads(line)["text"]).ids + [0])
    out = torch.tensor(ids, dtype=torch.int64)
    torch.save(out, cache)
    return out


def batches(tokens: torch.Tensor, seq: int, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([tokens[s:s + seq] for s in starts.tolist()])
        y = torch.stack([tokens[s + 1:s + seq + 1] for s in starts.tolist()])
        yield x, y


def lr_at(step: int, peak: float, total: int, warmup: int) -> float:
    """Linear warmup, cosine decay to peak / 10 (the trainer's default shape)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak / 10 + 0.5 * (1 + math.cos(math.pi * t)) * (peak - peak / 10)


def run(args, kind: str, lr: float, train: torch.Tensor, val: list) -> dict:
    torch.manual_seed(args.seed)
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                      max_seq_len=args.seq)
    dev = torch.device(args.device)
    model = Transformer(cfg).to(dev)
    ddp = DistributedDataParallel(model, DDPConfig())
    opt = build_optimizer(ddp, OptimizerConfig(optimizer=kind, lr=lr, weight_decay=0.1, muon_weight_decay=0.1,
                                               grad_clip=1.0, betas=(0.9, 0.95), fused=dev.type != "cpu"))
    sync = torch.accelerator.synchronize if dev.type != "cpu" else (lambda: None)
    evals, step_times = [], []

    def evaluate(step: int) -> None:
        model.eval()
        with torch.no_grad():
            loss = sum(float(model(x.to(dev), labels=y.to(dev))) for x, y in val) / len(val)
        model.train()
        evals.append((step, loss))

    warmup = max(1, args.steps // 10)
    for step, (x, y) in enumerate(batches(train, args.seq, args.batch, args.steps, args.seed + 1)):
        opt.set_lr(lr_at(step, lr, args.steps, warmup))
        opt.zero_grad()
        ddp(x.to(dev), labels=y.to(dev)).backward()
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        step_times.append(time.perf_counter() - t0)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1)
    n_params = sum(p.numel() for p in model.parameters())
    times = sorted(step_times[3:])
    return {"kind": kind, "lr": lr, "evals": evals, "final": evals[-1][1], "params": n_params,
            "step_ms": 1e3 * times[len(times) // 2]}


def steps_to_reach(evals: list, target: float) -> float:
    """The first step where the validation loss reaches `target`, interpolated between evaluations; inf if never."""
    prev_s, prev_l = 0, float("inf")
    for s, l in evals:
        if l <= target:
            if prev_l == float("inf"):
                return float(s)
            return prev_s + (s - prev_s) * (prev_l - target) / (prev_l - l)
        prev_s, prev_l = s, l
    return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="the sweep, the same values for both optimizers")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--n_layers", type=int, default=4)
    ap.add_argument("--n_heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eval_every", type=int, default=25)
    ap.add_argument("--eval_batches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the optimizer step is timed between syncs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work_dir", default=os.path.join(ROOT, "out", "bench_muon"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.work_dir, exist_ok=True)
    tokens = tokens_of_corpus(args.work_dir, args.vocab)
    split = int(tokens.numel() * 0.9)
    train, val_tokens = tokens[:split], tokens[split:]
    val = list(batches(val_tokens, args.seq, args.batch, args.eval_batches, seed=12345))
    print(f"[bench_muon] {tokens.numel():,} tokens ({split:,} train); {args.steps} steps x {args.batch} x {args.seq} "
          f"= {args.steps * args.batch * args.seq:,} train tokens per run; {args.threads} thread(s)", flush=True)
    results = []
    for kind in ("adamw", "muon"):
        for lr in (float(v) for v in args.lrs.split(",")):
            t0 = time.time()
            r = run(args, kind, lr, train, val)
            results.append(r)
            print(f"  {kind:5s} lr {lr:.0e}: final val {r['final']:.4f}, step {r['step_ms']:.1f} ms "
                  f"({r['params'] / 1e6:.2f}M params, {time.time() - t0:.0f} s)", flush=True)
    best = {k: min((r for r in results if r["kind"] == k), key=lambda r: r["final"]) for k in ("adamw", "muon")}
    target = best["adamw"]["final"]
    reach = {k: steps_to_reach(best[k]["evals"], target) for k in best}
    print(f"\nbest lr: adamw {best['adamw']['lr']:.0e}, muon {best['muon']['lr']:.0e}; "
          f"target = AdamW's final val loss {target:.4f}")
    print("| optimizer | best lr | final val loss | steps to AdamW's final val loss | optimizer step (median) |")
    print("| --- | --- | --- | --- | --- |")
    for k in ("adamw", "muon"):
        print(f"| {k} | {best[k]['lr']:.0e} | {best[k]['final']:.4f} | {reach[k]:.0f} | {best[k]['step_ms']:.1f} ms |")
    ratio = reach["muon"] / reach["adamw"]
    print(f"\nsteps ratio muon / adamw = {ratio:.2f} (goal <= 0.8); optimizer step extra time "
          f"{best['muon']['step_ms'] - best['adamw']['step_ms']:+.1f} ms "
          f"({best['muon']['step_ms'] / best['adamw']['step_ms']:.2f}x AdamW's)")


if __name__ == "__main__":
    main()
