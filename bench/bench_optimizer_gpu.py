"""The optimizer step's kernels on the GPU, ours beside torch's, at the bench models' real parameter shapes.

One process, one microbenchmark each, every row's time the median of --iters CUDA-event-timed calls after
--warmup, with the bytes each call must move and the rate that makes:
- the gradient norm: torch (`torch._foreach_norm` then the norm of the norms, what clipping does) and our
  sum-of-squares kernel over the gradients where autograd left them (SUMSQ_ROWS table rows a program: with one,
  1.18 ms for the 1B step's 1.8 GB of bf16 gradients on an H200, with 8, 0.76 ms; docs/gpu/report-1908bc2-h200.md);
- the update: torch's fused AdamW (`torch._fused_adamw_` over fp32 parameters and fp32 gradients, no bf16
  copy written back: less than our step does) and our one-launch AdamW reading bf16 gradients at their
  addresses and writing the bf16 parameters, with fp32 and with bf16 moments (one table row a program: 4 ran
  at 0.84-0.89x of it on an H200, same report);
- the A/B of our two kernels' 16-byte vector accesses (GradAddresses.aligned): each also run
  told nothing about alignment, one element an access, as every figure before that date was measured.

    python bench/bench_optimizer_gpu.py                      # the 1B shapes (886M parameters), then 124M
    python bench/bench_optimizer_gpu.py --configs 1b --json-out opt.json
    python bench/bench_optimizer_gpu.py --device cpu --configs tiny --iters 1   # plumbing (Triton rows need
                                                                                # TRITON_INTERPRET=1 on CPU)

Ratios are printed, never asserted (tests/commands/test_bench_optimizer_gpu.py runs the plumbing on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as bench/bench_model_gpu.py
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_kernels_gpu import median_call_seconds  # noqa: E402
from bench.bench_model_gpu import CONFIGS  # noqa: E402  (the same 124m / 1b / tiny models)


def param_shapes(config: str) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, decays) of each parameter of the config's model, built on the meta device (no memory)."""
    import torch
    from model import ModelConfig
    from model.llama import Transformer
    with torch.device("meta"):
        m = Transformer(ModelConfig(**CONFIGS[config]["model"]))
    return [(tuple(p.shape), p.dim() >= 2) for p in m.parameters()]


def run_config(config: str, device_name: str, iters: int, warmup: int) -> list[dict]:
    import torch
    from optimizer.flat_adamw import (GradAddresses, ParamGrads, SUMSQ_ROWS, adamw_param_grads, sumsq_param_grads,
                                      triton_runs_on)
    device = torch.device(device_name)

    def time_call(fn, iters: int, warmup: int) -> float:
        return median_call_seconds(fn, iters, warmup, device.type == "cuda")
    shapes = param_shapes(config)
    torch.manual_seed(0)
    params, start = [], 0
    for shape, _ in shapes:
        p = torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device=device))
        p.grad = torch.randn(shape, dtype=torch.bfloat16, device=device) * 1e-3
        params.append((p, start))
        start += -(-p.numel() // 16) * 16  # DDP's param_alignment
    n = sum(p.numel() for p, _ in params)
    decay = torch.zeros(start, dtype=torch.uint8, device=device)
    for (p, s), (_, d) in zip(params, shapes):
        decay[s:s + p.numel()] = int(d)
    grads = [p.grad for p, _ in params]
    rows: list[dict] = []

    def row(kernel: str, impl: str, seconds: float, nbytes: float, note: str = "") -> None:
        rows.append(dict(config=config, params=n, kernel=kernel, impl=impl, ms=round(seconds * 1e3, 3),
                         gb_per_s=round(nbytes / seconds / 1e9, 1), bytes_per_param=round(nbytes / n, 1), note=note))
        print(json.dumps(rows[-1]), flush=True)

    # --- the gradient norm (bf16 gradients: 2 bytes a parameter read)
    row("grad norm", "torch _foreach_norm", time_call(
        lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))), iters, warmup), 2 * n)
    triton_ok = triton_runs_on(device)
    pg = ParamGrads(params, start, device, decay) if triton_ok else None
    addrs = pg.addresses(pg.grads()) if pg is not None else None
    if pg is not None:
        want = float(sum(x.double().square().sum() for x in grads))  # (torch's bf16 norms: 3 digits)
        got = float(sumsq_param_grads(pg, addrs))
        row("grad norm", f"ours, {SUMSQ_ROWS} rows a program", time_call(
            lambda: sumsq_param_grads(pg, addrs), iters, warmup), 2 * n,
            f"squared norm {abs(got - want) / want:.1e} from the float64 sum"
            + ("" if addrs.aligned else "; NOT aligned: one element an access"))
        # the A/B of the 16-byte vector accesses (GradAddresses.aligned): the same kernel told nothing, one
        # element an access, as the kernels run when nothing is known aligned
        scalar = GradAddresses(addrs.tensor, False)
        row("grad norm", f"ours, {SUMSQ_ROWS} rows a program, scalar accesses (unaligned)", time_call(
            lambda: sumsq_param_grads(pg, scalar), iters, warmup), 2 * n)

    # --- the update. torch's fused AdamW (torch.optim.AdamW(fused=True), what a torch user steps with): fp32
    # parameters, fp32 gradients, fp32 moments (4 + 4 read, 4 written, moments 8 + 8): 28 bytes a parameter; it
    # writes no bf16 copy of the parameters, which ours does
    cuda = device.type == "cuda"
    ref = [torch.nn.Parameter(torch.zeros(p.shape, dtype=torch.float32, device=device)) for p, _ in params]
    for r, gr in zip(ref, grads):
        r.grad = gr.float()
    opt = torch.optim.AdamW(ref, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            **(dict(fused=True) if cuda else dict(foreach=True)))
    row("AdamW", "torch fused (fp32 grads, no bf16 copy)" if cuda else "torch foreach (CPU)",
        time_call(opt.step, iters, warmup), 28 * n)
    del ref, opt
    master = torch.zeros(start, dtype=torch.float32, device=device)
    if pg is not None:
        out = torch.zeros(start, dtype=torch.bfloat16, device=device)
        sumsq = torch.tensor(1.0, device=device)
        for state, per_param in ((torch.float32, 28), (torch.bfloat16, 20)):
            m = torch.zeros(start, dtype=state, device=device)
            v = torch.zeros(start, dtype=state, device=device)
            step = [0]

            def ours(m=m, v=v) -> None:
                step[0] += 1
                adamw_param_grads(master, pg, addrs, m, v, out, sumsq, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                                  weight_decay=0.1, max_norm=1.0, step=step[0])
            # master 4 + 4, gradient 2, moments (4 or 2) x 2 x 2, bf16 parameters 2
            row("AdamW", f"ours, one launch, {'fp32' if state == torch.float32 else 'bf16'} moments",
                time_call(ours, iters, warmup), per_param * n)
            if state == torch.float32:  # the vector accesses' A/B, as for the norm

                def ours_scalar(m=m, v=v) -> None:
                    step[0] += 1
                    adamw_param_grads(master, pg, scalar, m, v, out, sumsq, lr=1e-4, beta1=0.9, beta2=0.95,
                                      eps=1e-8, weight_decay=0.1, max_norm=1.0, step=step[0])
                row("AdamW", "ours, one launch, fp32 moments, scalar accesses (unaligned)",
                    time_call(ours_scalar, iters, warmup), per_param * n)
            del m, v
    return rows


def ratios(rows: list[dict]) -> list[str]:
    """Each of our rows against torch's row of the same kernel and config (time ratio, > 1: ours faster)."""
    out = []
    for r in rows:
        if not r["impl"].startswith("ours"):
            continue
        ref = next((x for x in rows if x["config"] == r["config"] and x["kernel"] == r["kernel"]
                    and x["impl"].startswith("torch")), None)
        if ref:
            out.append(f"| {r['config']} | {r['kernel']} | {r['impl']} / {ref['impl']} | {ref['ms'] / r['ms']:.2f}x |")
        # the vector accesses' A/B: the row against its scalar twin (> 1: the vectors faster)
        twin = next((x for x in rows if x["config"] == r["config"] and x["kernel"] == r["kernel"]
                     and x["impl"] == r["impl"] + ", scalar accesses (unaligned)"), None)
        if twin:
            out.append(f"| {r['config']} | {r['kernel']} | {r['impl']} / {twin['impl']} | "
                       f"{twin['ms'] / r['ms']:.2f}x |")
    return out


def markdown(rows: list[dict]) -> str:
    L = ["| config | kernel | implementation | ms | GB/s | bytes a parameter | note |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
    L += [f"| {r['config']} | {r['kernel']} | {r['impl']} | {r['ms']} | {r['gb_per_s']} | {r['bytes_per_param']} | "
          f"{r['note']} |" for r in rows]
    L += ["", "| config | kernel | speed-up (over torch; the vectors over scalar accesses) | value |",
          "| --- | --- | --- | --- |"] + ratios(rows)
    return "\n".join(L)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1b,124m", help="comma list of: " + ",".join(CONFIGS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_optimizer_gpu: no CUDA device here: nothing measured (--device cpu --configs tiny: plumbing)")
        return []
    rows: list[dict] = []
    configs = [c for c in args.configs.split(",") if c]
    for i, config in enumerate(configs):
        rows += run_config(config, args.device, args.iters, args.warmup)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if args.json_out:  # after each config: a caller's timeout keeps the configs done
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump(dict(rows=rows, device=args.device, done=i == len(configs) - 1), f, indent=1)
    print("\n" + markdown(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
