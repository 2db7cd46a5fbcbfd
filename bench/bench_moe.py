"""Benchmark: a training step of our MoE model vs transformers' MixtralForCausalLM at the same shapes, and our
grouped-matmul experts vs the reference loop, side by side in one process on the CPU. Ratios are printed, never
asserted.

Both models hold the same weights (ours exported with model/hf_interop.py, read by from_pretrained), get the same
batch, the same precision, the same optimizer (torch AdamW, foreach) and the same thread count. A step is forward +
backward + AdamW step; the two are interleaved round by round so that load from other processes hits both alike,
and the median of the rounds is reported. Mixtral has no z-loss or bias: both run without balancing terms
(HF's router_aux_loss_coef 0, output_router_logits off), so the same work is timed.

    .venv/bin/python bench/bench_moe.py                         # defaults below, ~1-2 min on 2 cores
    .venv/bin/python bench/bench_moe.py --dim=512 --experts=16 --top_k=4 --expert_width=256 --steps=5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from model import ModelConfig, Transformer  # noqa: E402
from model.flops import flops_per_token  # noqa: E402
from model.hf_interop import export_hf  # noqa: E402
from model.moe import GroupedExperts  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("vocab", 4096), ("dim", 256), ("layers", 4), ("heads", 8), ("experts", 8), ("top_k", 2),
                          ("expert_width", 256), ("batch", 4), ("seq", 256), ("steps", 6), ("warmup", 2),
                          ("threads", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    return p.parse_args(argv)


def build_pair(a, dtype: torch.dtype):
    from transformers import MixtralForCausalLM
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, hidden_dim=a.expert_width,
                      max_seq_len=a.seq, moe_num_experts=a.experts, moe_top_k=a.top_k, moe_hidden_dim=a.expert_width)
    ours = Transformer(cfg)
    with tempfile.TemporaryDirectory() as d:
        export_hf(ours, os.path.join(d, "hf"))
        hf = MixtralForCausalLM.from_pretrained(os.path.join(d, "hf"), torch_dtype=torch.float32)
    return ours.to(dtype), hf.to(dtype), cfg


def make_step(model, kind: str, x, y):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if kind == "hf":
            loss = model(input_ids=x, labels=x).loss  # HF shifts the labels itself
        else:
            loss = model(x, labels=y)
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def set_expert_backend(model, backend: str) -> None:
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.backend = backend


def timed(steps: dict, rounds: int, warmup: int) -> dict:
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for kind, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[kind].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    ours, hf, cfg = build_pair(a, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    y = torch.cat((x[:, 1:], torch.full((a.batch, 1), -100)), dim=1)  # the targets of HF's shift
    tokens = a.batch * a.seq
    impl = getattr(hf.config, "_experts_implementation", None) or "default"
    print(f"[moe] {a.layers} blocks x {a.experts} experts (top {a.top_k}, width {a.expert_width}), dim {a.dim}, "
          f"batch {a.batch} x {a.seq}, {a.dtype}, {torch.get_num_threads()} thread(s), torch {torch.__version__}; "
          f"HF Mixtral experts implementation: {impl}; active-parameter FLOPs/token "
          f"{flops_per_token(cfg, a.seq) / 1e6:.1f} M")

    with torch.no_grad():  # same weights: the same loss before any step
        l_ours, l_hf = float(ours.eval()(x, labels=y)), float(hf.eval()(input_ids=x, labels=x).loss)
    print(f"[check] loss ours {l_ours:.6f} vs HF {l_hf:.6f}")

    set_expert_backend(ours, "auto")
    med = timed({"hf": make_step(hf, "hf", x, y), "ours": make_step(ours, "ours", x, y)}, a.steps, a.warmup)
    for k in ("hf", "ours"):
        print(f"[step] {k:4s} {med[k] * 1e3:8.1f} ms  {tokens / med[k]:9.0f} tokens/s")
    print(f"[step] ours / HF Mixtral: {med['hf'] / med['ours']:.2f}x tokens/s (experts: ours auto = "
          f"{'loop' if dtype == torch.float32 else 'grouped_mm'} on the CPU)")

    steps = {}
    for backend in ("grouped_mm", "loop"):
        model = build_pair(a, dtype)[0]
        set_expert_backend(model, backend)
        steps[backend] = make_step(model, "ours", x, y)
    med = timed(steps, a.steps, a.warmup)
    for k in steps:
        print(f"[experts] {k:10s} {med[k] * 1e3:8.1f} ms  {tokens / med[k]:9.0f} tokens/s")
    print(f"[experts] grouped_mm / loop: {med['loop'] / med['grouped_mm']:.2f}x tokens/s")


if __name__ == "__main__":
    main()
