"""Benchmark: a training step of our MoE model vs transformers' MixtralForCausalLM at the same shapes, the MoE block
alone vs Mixtral's (and so the rest of the step), and our expert backends (grouped matmul, fused loop, loop), side by
side in one process on the CPU. Ratios are printed, never asserted.

Both models hold the same weights (ours exported with model/hf_interop.py, read by from_pretrained), get the same
batch, the same precision, the same optimizer (torch AdamW, foreach) and the same thread count. A step is forward +
backward + AdamW step; the two are interleaved round by round so that load from other processes hits both alike,
and the median of the rounds is reported, in wall-clock time and in this process's CPU time (less moved by other
processes on a shared machine). Mixtral has no z-loss or bias: both run without balancing terms (HF's
router_aux_loss_coef 0, output_router_logits off), so the same work is timed; our layers' statistics are taken
after each step, as the trainer does. HF runs its default (and on the CPU its fastest) experts implementation.

The block rows time one MoE feed-forward alone (ours: MoEFeedForward; HF: MixtralSparseMoeBlock), forward and
backward on the same hidden states and output gradient; `rest` is a step minus layers x block: the attention, norms,
embedding, loss and optimizer, which the two should run at parity.

    .venv/bin/python bench/bench_moe.py --threads=1             # defaults below, ~1-2 min on 2 cores
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
from model.moe import moe_layers, take_aux_losses  # noqa: E402
from model.moe_experts import GroupedExperts, choose_expert_backend  # noqa: E402

EXPERT_BACKENDS = ("grouped_mm", "fused_loop", "loop")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("vocab", 4096), ("dim", 256), ("layers", 4), ("heads", 8), ("experts", 8), ("top_k", 2),
                          ("expert_width", 256), ("batch", 4), ("seq", 256), ("steps", 10), ("warmup", 2),
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

    layers = moe_layers(model) if kind == "ours" else []

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if kind == "hf":
            loss = model(input_ids=x, labels=x).loss  # HF shifts the labels itself
        else:
            loss = model(x, labels=y)
        loss.backward()
        opt.step()
        take_aux_losses(layers)  # what the trainer takes after each step (trainer/moe.py)
        for layer in layers:
            layer.take_counts()
        return float(loss.detach())
    return step


def block_step(block, h: torch.Tensor, grad: torch.Tensor):
    """One MoE feed-forward alone: forward and backward on hidden states h [B, T, D] (fresh leaf each call)."""
    block.train()
    layers = moe_layers(block)

    def step() -> None:
        block.zero_grad(set_to_none=True)
        x = h.detach().requires_grad_()
        block(x).backward(grad)
        take_aux_losses(layers)
        for layer in layers:
            layer.take_counts()
    return step


def set_expert_backend(model, backend: str) -> None:
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.backend = backend


def timed(steps: dict, rounds: int, warmup: int) -> tuple[dict, dict]:
    """Median seconds per call of each step, interleaved round by round: (wall clock, this process's CPU time)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    wall, cpu = {k: [] for k in steps}, {k: [] for k in steps}
    for _ in range(rounds):
        for kind, step in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            wall[kind].append(time.perf_counter() - t0)
            cpu[kind].append(time.process_time() - c0)
    return ({k: statistics.median(v) for k, v in wall.items()}, {k: statistics.median(v) for k, v in cpu.items()})


def report(tag: str, wall: dict, cpu: dict, tokens: int, ref: str, new: str, what: str) -> None:
    for k in wall:
        print(f"[{tag}] {k:10s} {wall[k] * 1e3:8.1f} ms  {tokens / wall[k]:9.0f} tokens/s  (cpu {cpu[k] * 1e3:8.1f} ms)")
    print(f"[{tag}] {what}: {wall[ref] / wall[new]:.2f}x tokens/s (cpu time {cpu[ref] / cpu[new]:.2f}x)")


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
    auto = choose_expert_backend(torch.empty(0, dtype=dtype), "auto")
    wall, cpu = timed({"hf": make_step(hf, "hf", x, y), "ours": make_step(ours, "ours", x, y)}, a.steps, a.warmup)
    report("step", wall, cpu, tokens, "hf", "ours", f"ours / HF Mixtral (experts: ours auto = {auto} on the CPU)")

    # the MoE block alone, on the hidden states its layer sees (same weights both sides: before any step)
    ours_b, hf_b, _ = build_pair(a, dtype)
    seen = []
    hook = ours_b.layers[0].mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        ours_b.eval()(x)
    hook.remove()
    h = seen[0]
    grad = torch.randn(h.shape, generator=g, dtype=h.dtype) / tokens
    bw, bc = timed({"hf": block_step(hf_b.model.layers[0].mlp, h, grad),
                    "ours": block_step(ours_b.layers[0].mlp, h, grad)}, a.steps, a.warmup)
    report("block", bw, bc, tokens, "hf", "ours", "MoE block, ours / HF MixtralSparseMoeBlock")
    rw = {k: wall[k] - a.layers * bw[k] for k in wall}
    rc = {k: cpu[k] - a.layers * bc[k] for k in cpu}
    report("rest", rw, rc, tokens, "hf", "ours", f"step - {a.layers} x block, ours / HF")

    steps = {}
    for backend in EXPERT_BACKENDS:
        model = build_pair(a, dtype)[0]
        set_expert_backend(model, backend)
        steps[backend] = make_step(model, "ours", x, y)
    wall, cpu = timed(steps, a.steps, a.warmup)
    report("experts", wall, cpu, tokens, "loop", "grouped_mm", "grouped_mm / loop")
    print(f"[experts] fused_loop / loop: {wall['loop'] / wall['fused_loop']:.2f}x tokens/s "
          f"(cpu time {cpu['loop'] / cpu['fused_loop']:.2f}x)")


if __name__ == "__main__":
    main()
