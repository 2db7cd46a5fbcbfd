"""Benchmark: LoRA on the routed experts of one MoE block, ours (model/lora_experts.py) against PEFT's
`target_parameters` adapters on transformers' block (its LoRA ParamWrapper, which forms W + s B A per forward), side
by side in one process on the CPU: the memory the forward keeps for backward beyond the weights, and the time of a
forward + backward. Ratios are printed, never asserted.

Both blocks hold the same weights and the same adapters (ours exported with model/hf_interop.py, the adapters saved
with model/lora.py save_lora and read by peft.PeftModel.from_pretrained, the outputs compared first); both get the
same hidden states and output gradient. Ours runs its grouped-matmul path (the update added to the outputs,
s (x A^T) B^T) and its fused-loop path (the update formed in weight space, as PEFT does); transformers' block runs its
eager experts and its grouped matmul (`experts_implementation`). Rows are interleaved round by round; medians are reported.
"Kept" counts each tensor the forward saves for backward once (by storage), parameters excluded.

    .venv/bin/python bench/bench_moe_lora.py                 # defaults below, ~1 min on 2 cores
    .venv/bin/python bench/bench_moe_lora.py --experts=64 --dim=1024 --expert_width=384 --tokens=2048 --rank=16
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
from model.hf_interop import export_hf  # noqa: E402
from model.lora import apply_lora, save_lora  # noqa: E402
from model.lora_experts import grouped_experts  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dim", 512), ("experts", 32), ("top_k", 4), ("expert_width", 256), ("tokens", 1024),
                          ("rank", 16), ("rounds", 7), ("threads", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    return p.parse_args(argv)


def build(a, work: str):
    """(our block, {name: transformers' block under PEFT}): the same weights and adapters (B drawn away from 0)."""
    import peft
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, dim=a.dim, n_layers=1, n_heads=8, hidden_dim=a.expert_width, max_seq_len=64,
                      moe_num_experts=a.experts, moe_top_k=a.top_k, moe_hidden_dim=a.expert_width)
    ours = Transformer(cfg)
    export_hf(ours, os.path.join(work, "base"))
    apply_lora(ours, r=a.rank, alpha=2.0 * a.rank, target_modules="experts")
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    save_lora(ours, os.path.join(work, "adapters"))
    theirs = {}
    for impl in ("eager", "grouped_mm"):
        hf = AutoModelForCausalLM.from_pretrained(os.path.join(work, "base"), experts_implementation=impl)
        pm = peft.PeftModel.from_pretrained(hf, os.path.join(work, "adapters"), is_trainable=True)
        theirs[f"peft {impl}"] = pm.base_model.model.model.layers[0].mlp
    return ours.layers[0].mlp, theirs


def run_block(block, x: torch.Tensor, grad: torch.Tensor, params: list) -> tuple[float, int]:
    """(seconds of one forward + backward, bytes the forward kept for backward beyond the parameters)."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    x = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return time.perf_counter() - t0, sum(seen.values())


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as work:
        ours, theirs = build(a, work)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, a.tokens, a.dim, generator=g)
    grad = torch.randn(1, a.tokens, a.dim, generator=g)
    with torch.no_grad():
        want = ours(x)
        for name, block in theirs.items():
            out = block(x)
            out = out[0] if isinstance(out, tuple) else out
            print(f"check: {name} output vs ours, max |diff| {float((out - want).abs().max()):.2e} "
                  f"(scale {float(want.abs().max()):.2e})")
    rows = {}
    for backend in ("grouped_mm", "fused_loop"):
        rows[f"ours {backend}"] = (ours, backend)
    rows.update({name: (block, None) for name, block in theirs.items()})
    times: dict[str, list[float]] = {name: [] for name in rows}
    kept: dict[str, int] = {}
    for r in range(a.rounds + 1):
        for name, (block, backend) in rows.items():
            if backend:
                for _, ex in grouped_experts(block):
                    ex.backend = backend
            params = {p.untyped_storage().data_ptr() for p in block.parameters()}
            secs, nbytes = run_block(block, x, grad, params)
            block.zero_grad(set_to_none=True)
            if r:  # (round 0 warms up)
                times[name].append(secs)
                kept[name] = nbytes
    base = "peft grouped_mm"  # (transformers' fastest experts implementation here)
    print(f"\none MoE block, {a.tokens} tokens, dim {a.dim}, {a.experts} experts of width {a.expert_width}, top "
          f"{a.top_k}, LoRA rank {a.rank} on both expert projections; fp32, {torch.get_num_threads()} threads, "
          f"median of {a.rounds} rounds")
    print(f"{'row':<18} {'fwd+bwd ms':>11} {'vs ' + base:>14} {'kept MB':>9} {'vs ' + base:>14}")
    for name in rows:
        ms = 1e3 * statistics.median(times[name])
        t_ratio = statistics.median(times[base]) / statistics.median(times[name])
        print(f"{name:<18} {ms:>11.1f} {t_ratio:>13.2f}x {kept[name] / 2**20:>9.1f} "
              f"{kept[name] / max(kept[base], 1):>13.2f}x")


if __name__ == "__main__":
    main()
