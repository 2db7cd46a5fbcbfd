"""Benchmark: train-step throughput of our model vs transformers.LlamaForCausalLM, MFU, and the
peak memory of the chunked linear+CE vs full logits.

Both models get the same config, the same weights, the same batch, the same precision (fp32 or bf16
autocast), the same optimizer (torch fused AdamW) and the same thread count, in one process. A step is
forward + backward + AdamW step. Ratios are printed, never asserted.

    .venv/bin/python bench/bench_model.py                      # everything (~15 min on 2 cores)
    .venv/bin/python bench/bench_model.py --configs tiny --precisions bf16 --modes eager
    .venv/bin/python bench/bench_model.py --only-loss-memory
    .venv/bin/python bench/bench_model.py --only-saved-bytes    # fused_qkv vs separate q/k/v, gate/up
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from model import ModelConfig, Transformer  # noqa: E402
import model.flops as flops_mod  # noqa: E402
from model.flops import flops_per_token, measure_peak_flops  # noqa: E402
from model.hf_interop import hf_config_dict, to_hf_state_dict  # noqa: E402
from optimizer import OptimizerConfig  # noqa: E402
from optimizer.adamw import build_adamw  # noqa: E402
from parallel.transforms.compile import compile_in_place  # noqa: E402
from utils.device import autocast_context  # noqa: E402

CONFIGS = {
    "tiny": dict(model=dict(vocab_size=8192, dim=256, n_layers=4, n_heads=8, max_seq_len=256), batch=8, seq=256),
    "large": dict(model=dict(vocab_size=32000, dim=512, n_layers=8, n_heads=8, max_seq_len=512), batch=2, seq=512),
}


def build_pair(mcfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    ours = Transformer(ModelConfig(**mcfg))
    hf_cfg = hf_config_dict(ours.cfg)
    hf_cfg.pop("dtype", None), hf_cfg.pop("torch_dtype", None), hf_cfg.pop("architectures", None)
    hf = LlamaForCausalLM(LlamaConfig(**hf_cfg))
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    return ours, hf


def make_step(model, kind: str, x, y_ours, dtype):
    """One training step (forward + backward + AdamW) as a closure returning the loss."""
    model.train()
    opt = build_adamw(list(model.parameters()), [], OptimizerConfig(lr=1e-4, weight_decay=0.0, fused=True), "cpu")

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with autocast_context("cpu", dtype):
            if kind == "ours":
                loss = model(x, labels=y_ours)
            else:
                loss = model(input_ids=x, labels=x).loss  # HF shifts labels itself
        loss.backward()
        opt.step()
        return loss.item()
    return step


_PEAKS: dict = {}


def best_peak(dtype: torch.dtype) -> float:
    """Max of repeated matmul-peak measurements: under load from other processes a single
    measurement can come out low, which would inflate MFU."""
    flops_mod._PEAK_CACHE.clear()
    for n in (1024, 2048):
        _PEAKS[dtype] = max(_PEAKS.get(dtype, 0.0), measure_peak_flops("cpu", dtype, n=n, seconds=1.5))
        flops_mod._PEAK_CACHE.clear()
    return _PEAKS[dtype]


def bench_throughput(args) -> list[dict]:
    rows = []
    for cname in args.configs:
        spec = CONFIGS[cname]
        B, T = args.batch or spec["batch"], spec["seq"]
        for prec in args.precisions:
            dtype = torch.bfloat16 if prec == "bf16" else torch.float32
            peak = best_peak(dtype)
            g = torch.Generator().manual_seed(1)
            x = torch.randint(0, spec["model"]["vocab_size"], (B, T), generator=g)
            y = torch.cat((x[:, 1:], torch.full((B, 1), -100)), dim=1)  # same targets as HF's shift
            res = {}
            for mode in args.modes:
                ours, hf = build_pair(spec["model"])
                if mode == "compile":
                    compile_in_place(ours)
                    hf.compile()
                steps = {"hf": make_step(hf, "hf", x, y, dtype), "ours": make_step(ours, "ours", x, y, dtype)}
                first, warm_s = {}, {}
                for kind, step in steps.items():
                    t0 = time.perf_counter()
                    first[kind] = step()
                    for _ in range(args.warmup):
                        step()
                    warm_s[kind] = time.perf_counter() - t0
                # interleave the two so that load from other processes hits both alike
                times = {k: [] for k in steps}
                for _ in range(args.steps):
                    for kind, step in steps.items():
                        t0 = time.perf_counter()
                        step()
                        times[kind].append(time.perf_counter() - t0)
                for kind in steps:
                    tps = B * T / statistics.median(times[kind])
                    res[(kind, mode)] = tps
                    row = dict(config=cname, precision=prec, mode=mode, impl=kind, tokens_per_s=round(tps),
                               best_tokens_per_s=round(B * T / min(times[kind])),
                               mfu=round(tps * flops_per_token(ours.cfg, T) / peak, 4),
                               first_loss=round(first[kind], 4), warmup_s=round(warm_s[kind], 1))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del ours, hf, steps
                gc.collect()
            for mode in args.modes:
                print(f"== {cname} {prec} {mode}: ours/hf = {res[('ours', mode)] / res[('hf', mode)]:.2f}x", flush=True)
            best_hf = max(v for (k, m), v in res.items() if k == "hf")
            best_ours = max(v for (k, m), v in res.items() if k == "ours")
            print(f"== {cname} {prec}: best ours / best hf = {best_ours / best_hf:.2f}x "
                  f"(peak matmul {peak / 1e9:.0f} GFLOP/s, {flops_per_token(ModelConfig(**spec['model']), T) / 1e6:.0f} MFLOP/token)",
                  flush=True)
            rows.append(dict(config=cname, precision=prec, summary=round(best_ours / best_hf, 3)))
    return rows


_LOSS_CHILD = r"""
import resource, sys, torch
sys.path.insert(0, sys.argv[1])
from model.loss import linear_cross_entropy, linear_cross_entropy_ref
torch.set_num_threads(int(sys.argv[4]))
V, N, D = 64000, 4096, int(sys.argv[3])
torch.manual_seed(0)
h = torch.randn(N, D, requires_grad=True)
w = (torch.randn(V, D) * 0.02).requires_grad_(True)
y = torch.randint(0, V, (N,))
# warm the allocator on something unrelated and of the size of the gradients, then record the baseline
gh, gw = torch.zeros_like(h), torch.zeros_like(w); del gh, gw
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[2] == "chunked":
    loss = linear_cross_entropy(h, w, y, "mean", 1024)
else:
    loss = linear_cross_entropy_ref(h, w, y, "mean")
loss.backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - base) / 1024.0, loss.item())
"""


def bench_loss_memory(args) -> dict:
    out = {}
    for kind in ("full", "chunked"):
        r = subprocess.run([sys.executable, "-c", _LOSS_CHILD, ROOT, kind, str(args.loss_dim), str(torch.get_num_threads())],
                           capture_output=True, text=True, check=True)
        mib, loss = r.stdout.split()
        out[kind] = (float(mib), float(loss))
        print(f"loss memory {kind:8s}: peak RSS increase {float(mib):8.1f} MiB  (loss {float(loss):.5f})", flush=True)
    ratio = out["chunked"][0] / out["full"][0]
    print(f"== loss memory vocab 64000 x 4096 tokens x dim {args.loss_dim}: chunked/full = {ratio:.3f}", flush=True)
    return {"full_mib": out["full"][0], "chunked_mib": out["chunked"][0], "ratio": ratio}


def saved_for_backward_bytes(model, x) -> int:
    """Bytes autograd saves for backward during one forward (the loss included), each storage once,
    parameters not counted: what a training step holds between its forward and its backward."""
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, labels=x)
    return sum(saved.values())


def bench_saved_bytes(args) -> list[dict]:
    """fused_qkv (one matmul for q/k/v and one for gate/up, `kernels.concat_linear`) against three
    separate projections (the reference), same weights and batch, fp32: what each keeps for backward."""
    rows = []
    for c in args.configs:
        cfg = CONFIGS[c]
        batch = args.batch or cfg["batch"]
        x = torch.randint(0, cfg["model"]["vocab_size"], (batch, cfg["seq"]), generator=torch.Generator().manual_seed(0))
        got = {}
        for fused in (True, False):
            torch.manual_seed(0)
            got[fused] = saved_for_backward_bytes(Transformer(ModelConfig(**cfg["model"], fused_qkv=fused)), x)
        rows.append({"config": c, "fused_mib": got[True] / 2**20, "separate_mib": got[False] / 2**20,
                     "ratio": got[True] / got[False]})
        print(f"== saved for backward, {c} ({batch} x {cfg['seq']} tokens, fp32): fused_qkv {got[True] / 2**20:.1f} MiB, "
              f"separate projections {got[False] / 2**20:.1f} MiB, fused/separate = {got[True] / got[False]:.3f}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="tiny,large", help="comma list of: " + ",".join(CONFIGS))
    p.add_argument("--precisions", default="fp32,bf16", help="comma list of fp32,bf16")
    p.add_argument("--modes", default="eager,compile", help="comma list of eager,compile")
    p.add_argument("--steps", type=int, default=6, help="timed steps per model (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=0, help="override the config's batch size")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for both models")
    p.add_argument("--loss-dim", type=int, default=512)
    p.add_argument("--only-loss-memory", action="store_true")
    p.add_argument("--skip-loss-memory", action="store_true")
    p.add_argument("--only-saved-bytes", action="store_true",
                   help="only the bytes saved for backward, fused_qkv vs separate projections (seconds)")
    args = p.parse_args()
    args.configs, args.precisions, args.modes = (s.split(",") for s in (args.configs, args.precisions, args.modes))
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpu count {os.cpu_count()}, "
          f"load avg {os.getloadavg()}", flush=True)
    if args.only_saved_bytes:
        bench_saved_bytes(args)
        return
    if not args.skip_loss_memory:
        bench_loss_memory(args)
    if not args.only_loss_memory:
        rows = bench_throughput(args)
        # final table: MFU against the best peak seen during the whole run (re-measured now too)
        print("\n| config | precision | mode | HF tokens/s | ours tokens/s | ours/HF | HF MFU | ours MFU | loss HF / ours |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        by = {(r["config"], r["precision"], r["mode"], r["impl"]): r for r in rows if "impl" in r}
        for (c, p_, m, impl), r in by.items():
            if impl != "ours":
                continue
            h = by[(c, p_, m, "hf")]
            dtype = torch.bfloat16 if p_ == "bf16" else torch.float32
            peak = best_peak(dtype)
            fpt = flops_per_token(ModelConfig(**CONFIGS[c]["model"]), CONFIGS[c]["seq"])
            print(f"| {c} | {p_} | {m} | {h['tokens_per_s']} | {r['tokens_per_s']} | "
                  f"{r['tokens_per_s'] / h['tokens_per_s']:.2f}x | {h['tokens_per_s'] * fpt / peak:.2f} | "
                  f"{r['tokens_per_s'] * fpt / peak:.2f} | {h['first_loss']} / {r['first_loss']} |")
        for dt, pk in _PEAKS.items():
            print(f"peak matmul {dt}: {pk / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
