"""Per-op GPU benchmark: each fused op of the model (the LM head's linear + cross-entropy, RMSNorm, residual
add + RMSNorm, RoPE of q and k, SwiGLU of the packed gate/up output), forward + backward, at the 124M and 1B
shapes, in every implementation the model can run: eager (our Triton kernel, our recomputing autograd Function
"torch", the plain reference) and compiled (torch.compile of the reference, what Inductor fuses; and of our
Triton op inside a graph). For the loss "triton" is the linear+CE custom op (model/triton_loss.py, chunks sized
by its memory budget), "torch" the chunked autograd Function (model/loss.py, loss_chunk_size 512 tokens) and
"reference" the full fp32 logits with F.cross_entropy (compiled: what `auto` runs under compile on CUDA while the
logits fit 4 GiB; its Inductor forward kernel took 0.73 ms for 1 GB of bf16 logits on both an H100 and an H200,
~1.4 TB/s: docs/gpu/report-1908bc2-h200.md).

This is what `--fused_kernels=auto` is decided from (model/kernels.py AUTO_EAGER / AUTO_UNDER_COMPILE): per op
and per mode, the fastest here. Times are the median of --iters CUDA-event-timed iterations after warm-up,
in microseconds; bf16 activations and weights (the trainer's precision). The ratio of each variant to the
best of its mode is printed. Ratios only, never asserted.

    python bench/bench_kernels_gpu.py                       # both shapes, every op and variant
    python bench/bench_kernels_gpu.py --configs 124m --json-out k.json
    python bench/bench_kernels_gpu.py --device cpu --configs tiny --iters 2   # plumbing check (interpreter off:
                                                                             # Triton rows are skipped on CPU)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as bench/bench_model_gpu.py
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# tokens, dim, heads, kv heads, head dim, MLP hidden: the bench's 124m / 1b models (model/config.py rules)
SHAPES = {"124m": dict(tokens=16 * 1024, dim=768, heads=12, kv_heads=12, head_dim=64, hidden=2048, batch=16,
                       vocab=32000),
          "1b": dict(tokens=4 * 2048, dim=2048, heads=16, kv_heads=8, head_dim=128, hidden=5632, batch=4, vocab=32000),
          "tiny": dict(tokens=2 * 64, dim=64, heads=4, kv_heads=2, head_dim=16, hidden=192, batch=2, vocab=256)}
OPS = ("loss", "rms_norm", "add_rms_norm", "rope", "swiglu")  # the loss first: the one kernel far off its roofline
# (mode, implementation): the model's kernel_backend for it, and whether fused at all
VARIANTS = (("eager", "triton"), ("eager", "torch"), ("eager", "reference"),
            ("compile", "triton"), ("compile", "reference"))
# the loss's A/B of its softmax kernel's vocabulary tile (model/triton_loss.py MAX_BLOCK_V, 16384 with 16 warps): a
# row of 32,000 logits in 4,096-element tiles with 8 warps, or 8,192 with 16. Compiled for sm_90 as the launcher
# specializes it (scripts/check_triton_cuda.py: 16-byte vectors), the 16384 tile with gradients takes 64 registers
# a thread (2 rows an SM), 8192 40 (3), 4096 32 (8). (An unspecialized compile had said 123 for 16384, one row an
# SM: the reason this A/B was added; its figures were wrong.) Unmeasured until a GPU runs this: the default stays
# until it does. Run right after the default tile's eager row, before the slower variants
LOSS_TILES = {"triton-4k": 4096, "triton-8k": 8192}


def variants(op: str) -> tuple:
    """(mode, implementation) rows of one op in the order they run: the loss's tile A/B after its eager Triton row."""
    if op != "loss":
        return VARIANTS
    return VARIANTS[:1] + tuple(("eager", t) for t in LOSS_TILES) + VARIANTS[1:]


def _inputs(op: str, s: dict, device):
    import torch
    g = torch.Generator(device="cpu").manual_seed(0)
    bf = torch.bfloat16

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=bf).requires_grad_(True)
    n, d = s["tokens"], s["dim"]
    if op == "loss":  # hidden, the LM head's weight, labels (a tenth ignored, as padding would be)
        y = torch.randint(0, s["vocab"], (n,), generator=g)
        y[torch.rand(n, generator=g) < 0.1] = -100
        return [r(n, d), r(s["vocab"], d, scale=0.02), y.to(device)]
    if op == "rms_norm":
        return [r(n, d), r(d)]
    if op == "add_rms_norm":
        return [r(n, d), r(n, d), r(d)]
    if op == "rope":
        b, t = s["batch"], n // s["batch"]
        pos = torch.arange(t, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, s["head_dim"], 2).float() / s["head_dim"]))
        ang = pos[:, None] * inv
        cos, sin = (f(ang)[None, :, None, :].to(device) for f in (torch.cos, torch.sin))
        return [r(b, t, s["heads"], s["head_dim"]), r(b, t, s["kv_heads"], s["head_dim"]), cos, sin]
    return [r(n, 2 * s["hidden"], scale=2.0)]


def _fn(op: str, impl: str):
    from model import kernels
    if op == "loss":
        from model import loss as L
        if impl.startswith("triton"):
            from model import triton_loss
            tile = LOSS_TILES.get(impl)

            def lce(h, w, y):
                saved = triton_loss.MAX_BLOCK_V  # (read at each launch; the mean's backward launches none)
                triton_loss.MAX_BLOCK_V = tile or saved
                try:
                    return triton_loss.linear_cross_entropy_triton(h, w, y, "mean", chunk_size=None)
                finally:
                    triton_loss.MAX_BLOCK_V = saved
            return lce
        if impl == "torch":
            return lambda h, w, y: L.linear_cross_entropy(h, w, y, "mean", 512)
        return lambda h, w, y: L.linear_cross_entropy_ref(h, w, y, "mean")
    fused = impl != "reference"
    backend = impl if impl in ("triton", "torch") else "auto"
    if op == "rms_norm":
        return lambda x, w: kernels.rms_norm(x, w, 1e-5, fused=fused, backend=backend)
    if op == "add_rms_norm":
        return lambda x, res, w: kernels.add_rms_norm(x, res, w, 1e-5, fused=fused, backend=backend)
    if op == "rope":
        return lambda q, k, cos, sin: kernels.apply_rope_qk(q, k, cos, sin, fused=fused, backend=backend)
    return lambda gu: kernels.swiglu_packed(gu, fused=fused, backend=backend)


def time_variant(op: str, shape: str, mode: str, impl: str, device, iters: int, warmup: int) -> dict:
    import torch
    s = SHAPES[shape]
    args = _inputs(op, s, device)
    fn = _fn(op, impl)
    if mode == "compile":
        fn = torch.compile(fn, dynamic=False)  # (fullgraph=True refuses TORCH_COMPILE_DISABLE=1, the dry run)
    leaves = [a for a in args if a.requires_grad]
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]

    def step():
        for a in leaves:
            a.grad = None
        o = fn(*args)
        torch.autograd.backward(o if isinstance(o, tuple) else (o,), grads)

    t0 = time.perf_counter()
    step()  # compiles (compile mode) or JIT-compiles the Triton kernel
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    us = median_call_seconds(step, iters, warmup, cuda) * 1e6
    return dict(op=op, shape=shape, mode=mode, impl=impl, us=round(us, 1), first_s=round(first_s, 2))


def median_call_seconds(fn, iters: int, warmup: int, cuda: bool) -> float:
    """The median seconds of `iters` calls of `fn` after `warmup` untimed ones: each call between two CUDA events
    on a GPU (waiting for the second), by the host clock on the CPU. (Also bench/bench_optimizer_gpu.py's.)"""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, iters)):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def markdown(rows: list[dict]) -> str:
    out = ["| shape | op | mode | implementation | fwd+bwd us | / best of the mode |", "| --- | --- | --- | --- | --- | --- |"]
    best: dict = {}
    for r in rows:
        if "us" in r:
            k = (r["shape"], r["op"], r["mode"])
            best[k] = min(best.get(k, float("inf")), r["us"])
    for r in rows:
        k = (r["shape"], r["op"], r["mode"])
        if "us" not in r:
            out.append(f"| {r['shape']} | {r['op']} | {r['mode']} | {r['impl']} | {r.get('error', 'not run')} | |")
            continue
        out.append(f"| {r['shape']} | {r['op']} | {r['mode']} | {r['impl']} | {r['us']} | {r['us'] / best[k]:.2f}x |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="124m,1b")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=0, help="start no variant after this many seconds")
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)
    import torch
    from utils.publish import atomic_write_text
    cuda = torch.device(args.device).type == "cuda"
    rows: list[dict] = []
    t_start = time.perf_counter()
    for shape in args.configs.split(","):
        for op in args.ops.split(","):
            for mode, impl in variants(op):
                key = dict(op=op, shape=shape, mode=mode, impl=impl)
                if impl.startswith("triton") and not cuda:
                    rows.append(dict(key, error="no Triton on this device"))
                    continue
                if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                    rows.append(dict(key, error="not run: budget spent"))
                    continue
                try:
                    rows.append(time_variant(op, shape, mode, impl, args.device, args.iters, args.warmup))
                except Exception as e:  # noqa: BLE001 - one variant failing is a row that says so
                    rows.append(dict(key, error=f"{type(e).__name__}: {str(e)[:150]}"))
                print(json.dumps(rows[-1]), flush=True)
                if args.json_out:
                    atomic_write_text(args.json_out, json.dumps(dict(rows=rows, done=False), indent=1))
    table = markdown(rows)
    print("\n" + table, flush=True)
    if args.json_out:
        atomic_write_text(args.json_out, json.dumps(dict(rows=rows, done=True, table=table), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
