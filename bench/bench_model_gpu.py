"""GPU benchmark: our model (Triton kernels and references, eager and torch.compile) against
transformers.LlamaForCausalLM (SDPA, eager and compiled) and HF + Liger-Kernel when it is installed.

Every model gets the same config, the same weights, the same batch, bf16 autocast over fp32 parameters
and torch's fused AdamW; a step is forward + backward + optimizer step. Each (config, model, mode) runs in
its own subprocess, so a compile failure or an out-of-memory is a row that says so, and peak memory
is that of one model alone. Median of --steps timed steps after --warmup. Ratios are printed, never
asserted.

    python bench/bench_model_gpu.py                                 # 124m and 1b, all models, eager+compile
    python bench/bench_model_gpu.py --configs 124m --modes eager
    python bench/bench_model_gpu.py --device cpu --configs tiny --steps 2 --warmup 1   # smoke test without a GPU

Models: ours (kernel_backend=auto: Triton kernels on CUDA), ours-ref (every fused_* switch off: the
plain-PyTorch references), hf (LlamaForCausalLM, attn_implementation="sdpa"), hf-liger (the same with
Liger-Kernel's RMSNorm/RoPE/SwiGLU/fused linear-CE patched in; skipped when liger-kernel is absent).
MFU uses model/flops.py's formula against 989 TFLOP/s (H100 dense bf16, --peak-tflops) and against the
matmul peak measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = {
    "124m": dict(model=dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=1024), batch=16, seq=1024),
    "1b": dict(model=dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, max_seq_len=2048),
               batch=4, seq=2048),
    "tiny": dict(model=dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
                 batch=2, seq=64),
}
MODELS = ("ours", "ours-ref", "hf", "hf-liger")


def _build(model_name: str, mcfg: dict, device):
    """The model of `model_name` with the weights of our Transformer built from seed 0."""
    import torch
    from model import ModelConfig, Transformer
    from model.hf_interop import hf_config_dict, to_hf_state_dict
    torch.manual_seed(0)
    cfg = ModelConfig(**mcfg)
    ours = Transformer(cfg)
    if model_name == "ours":
        return ours.to(device)
    if model_name == "ours-ref":
        ref = Transformer(ModelConfig(**mcfg, fused_rmsnorm=False, fused_rope=False, fused_swiglu=False,
                                      fused_qkv=False, fused_cross_entropy=False))
        ref.load_state_dict(ours.state_dict())
        return ref.to(device)
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = hf_config_dict(ours.cfg)
    for k in ("dtype", "torch_dtype", "architectures"):
        hf_cfg.pop(k, None)
    if model_name == "hf-liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # ImportError: row says "not installed"
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    hf = LlamaForCausalLM(LlamaConfig(**hf_cfg, attn_implementation="sdpa"))
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    return hf.to(device)


def run_one(config: str, model_name: str, mode: str, device_name: str, steps: int, warmup: int) -> dict:
    """One (config, model, mode) in this process: tokens/s, peak memory, first loss."""
    import torch
    from model.flops import flops_per_token
    from model.kernels import build_adamw, compile_model
    from utils.device import autocast_context, synchronize
    device = torch.device(device_name)
    spec = CONFIGS[config]
    B, T = spec["batch"], spec["seq"]
    model = _build(model_name, spec["model"], device)
    model.train()
    if mode == "compile":
        if model_name.startswith("ours"):
            compile_model(model, per_layer=False)
        else:
            model.compile()
    opt = build_adamw(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, spec["model"]["vocab_size"], (B, T), generator=g).to(device)
    y = torch.cat((x[:, 1:], torch.full((B, 1), -100, device=device)), dim=1)  # = HF's own shift
    ours = model_name.startswith("ours")

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with autocast_context(device, torch.bfloat16):
            loss = model(x, labels=y) if ours else model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    first = float(step())
    for _ in range(warmup):
        step()
    synchronize(device)
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    tps = B * T / statistics.median(times)
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    from model import ModelConfig
    return dict(config=config, model=model_name, mode=mode, tokens_per_s=round(tps), first_loss=round(first, 4),
                warmup_s=round(warm_s, 1), peak_mem_gib=round(peak_mem / 2**30, 2),
                flops_per_token=flops_per_token(ModelConfig(**spec["model"]), T))


def child_rows(args) -> list[dict]:
    rows = []
    for config in args.configs:
        for mode in args.modes:
            for model_name in args.models:
                cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{config},{model_name},{mode}",
                       "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup)]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                if r.returncode == 0 and lines:
                    row = json.loads(lines[-1])
                else:
                    err = (r.stderr.strip().splitlines() or ["?"])[-1]
                    if "liger_kernel" in r.stderr and "No module named" in r.stderr:
                        err = "liger-kernel not installed"
                    row = dict(config=config, model=model_name, mode=mode, error=err[:160])
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def report(rows: list[dict], peak_table: float, peak_measured: float) -> None:
    by = {(r["config"], r["model"], r["mode"]): r for r in rows}
    tps = {k: r.get("tokens_per_s", 0) for k, r in by.items()}
    print("\n| config | model | mode | tokens/s | MFU (table peak) | MFU (measured matmul peak) | peak GiB | first loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (c, m, mode), r in by.items():
        if "error" in r:
            print(f"| {c} | {m} | {mode} | failed: {r['error']} | | | | |")
            continue
        f = r["flops_per_token"] * r["tokens_per_s"]
        print(f"| {c} | {m} | {mode} | {r['tokens_per_s']} | {f / peak_table:.1%} | "
              f"{(f / peak_measured) if peak_measured else 0:.1%} | {r['peak_mem_gib']} | {r['first_loss']} |")
    print("\n| config | ratio | value |")
    print("| --- | --- | --- |")
    for c in dict.fromkeys(r["config"] for r in rows):
        get = lambda m, mode: tps.get((c, m, mode), 0)  # noqa: E731
        best_ours = max(get("ours", md) for md in ("eager", "compile"))
        best_peer = max(get(m, md) for m in ("hf", "hf-liger") for md in ("eager", "compile"))
        print(f"| {c} | best ours / best of HF and HF+Liger | {_ratio(best_ours, best_peer)} |")
        for md in ("eager", "compile"):
            print(f"| {c} | ours / HF ({md}) | {_ratio(get('ours', md), get('hf', md))} |")
            print(f"| {c} | ours kernels / ours references ({md}) | {_ratio(get('ours', md), get('ours-ref', md))} |")
        print(f"| {c} | ours eager / HF+Liger eager | {_ratio(get('ours', 'eager'), get('hf-liger', 'eager'))} |")
        mem = lambda m, md: by.get((c, m, md), {}).get("peak_mem_gib", 0)  # noqa: E731
        for md in ("eager", "compile"):
            print(f"| {c} | peak memory ours / HF ({md}) | {_ratio(mem('ours', md), mem('hf', md))} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="124m,1b", help="comma list of: " + ",".join(CONFIGS))
    p.add_argument("--models", default=",".join(MODELS), help="comma list of: " + ",".join(MODELS))
    p.add_argument("--modes", default="eager,compile", help="comma list of eager,compile")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per (config, model, mode) subprocess")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: config,model,mode in this process
    args = p.parse_args()
    if args.one:
        config, model_name, mode = args.one.split(",")
        print(json.dumps(run_one(config, model_name, mode, args.device, args.steps, args.warmup)), flush=True)
        return
    args.configs, args.models, args.modes = (s.split(",") for s in (args.configs, args.models, args.modes))
    import torch
    from model.flops import measure_peak_flops
    peak_measured = measure_peak_flops(args.device, torch.bfloat16, seconds=2.0)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"torch {torch.__version__}, device {name}, measured bf16 matmul peak {peak_measured / 1e12:.1f} TFLOP/s",
          flush=True)
    rows = child_rows(args)
    report(rows, args.peak_tflops * 1e12, peak_measured)


if __name__ == "__main__":
    main()
