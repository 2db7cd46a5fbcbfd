"""Benchmark: the activation checkpointing policies (model/checkpointing.py) against keeping every activation, on
one forward + backward of a model.

    .venv/bin/python bench/bench_activation_checkpoint.py                  # dim 512, 8 layers, 4 x 1024 tokens, CPU
    .venv/bin/python bench/bench_activation_checkpoint.py --device cuda --dim 2048 --layers 16 --dtype bf16
    .venv/bin/python bench/bench_activation_checkpoint.py --policies none,op     # some of the rows

Policies: none, full (each block recomputed: --activation_checkpoint=full), op (selective per op: the attention's and
every other matmul's outputs kept: --activation_checkpoint=selective), 2 (every 2nd block recomputed:
--selective_ac_option=2). Each runs in a fresh process of its own (bench/head_paths.py), so its peak is its own: on
the CPU the rise of the peak resident set over the set-up (the weights, the batch), on CUDA the allocator's peak
over the set-up; and, exactly, the bytes the forward leaves for the backward (the autograd graph's saved tensors and
what selective checkpointing stored, each storage once, the weights not). Prints those, the peak and the seconds per
step (median of --iters), each also as a ratio to none's. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.head_paths import in_fresh_processes, measure  # noqa: E402

POLICIES = ("none", "full", "op", "2")


def _one(policy: str, a: argparse.Namespace) -> dict:
    import torch

    from model import ModelConfig, Transformer
    dev = torch.device(a.device)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, max_seq_len=a.seq,
                      gradient_checkpointing=policy != "none", checkpoint_policy="full" if policy == "none" else policy)
    model = Transformer(cfg).to(dev)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
    dtype = {"fp32": None, "bf16": torch.bfloat16}[a.dtype]

    def run() -> float:
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = model(x, labels=x)
        loss.backward()
        model.zero_grad(set_to_none=False)  # the gradients stay allocated: the peak is the activations'
        return float(loss)

    for w in model.parameters():  # the gradients' buffers in place before the measured calls (in the set-up)
        w.grad = torch.zeros_like(w)
    return {"policy": policy, **measure(run, dev, a.iters), "kept_bytes": _kept_bytes(model, x, dtype)}


def _kept_bytes(model, x, dtype) -> int:
    """The bytes the forward leaves for the backward: the autograd graph's saved tensors and what selective
    checkpointing stored, each storage counted once, the weights not (they are there anyway)."""
    import torch

    import model.checkpointing as checkpointing
    seen = {w.untyped_storage().data_ptr() for w in model.parameters()}
    total = [0]

    def count(t) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total[0] += t.untyped_storage().nbytes()
    stores, real = [], checkpointing.create_selective_checkpoint_contexts

    def recording(*args, **kw):
        fwd, recompute = real(*args, **kw)
        stores.append(fwd.storage)
        return fwd, recompute
    checkpointing.create_selective_checkpoint_contexts = recording
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (count(t), t)[1], lambda t: t), \
                torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(x, labels=x)
        for storage in stores:  # {op: {call: the kept output (in a version-checking wrapper) or a marker}}
            for calls in storage.values():
                for out in calls.values():
                    for t in out if isinstance(out, (tuple, list)) else (out,):
                        count(getattr(t, "val", t))
    finally:
        checkpointing.create_selective_checkpoint_contexts = real
    loss.backward()
    return total[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--policies", default=",".join(POLICIES), help="which to run, of " + ", ".join(POLICIES))
    p.add_argument("--one", choices=POLICIES, help=argparse.SUPPRESS)  # the child process
    a = p.parse_args(argv)
    if a.one:
        print("RESULT " + __import__("json").dumps(_one(a.one, a)), flush=True)
        return
    policies = tuple(x for x in a.policies.split(",") if x)
    if "none" not in policies or not set(policies) <= set(POLICIES):
        p.error(f"--policies={a.policies}: a comma-separated subset of {', '.join(POLICIES)} holding none")
    rows = in_fresh_processes(__file__, argv if argv is not None else sys.argv[1:], policies)
    print(f"dim {a.dim}, {a.layers} layers, {a.heads} heads, {a.batch} x {a.seq} tokens, vocab {a.vocab}, {a.dtype}, "
          f"{a.device}; one forward + backward")
    print("| policy | kept for the backward (MiB) | x none | peak memory over set-up (MiB) | x none | seconds per step "
          "| x none |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = rows["none"]
    for policy, r in rows.items():
        print(f"| {policy} | {r['kept_bytes'] / 2 ** 20:,.0f} | {r['kept_bytes'] / max(1, base['kept_bytes']):.2f} | "
              f"{r['peak_bytes'] / 2 ** 20:,.0f} | {r['peak_bytes'] / max(1, base['peak_bytes']):.2f} | "
              f"{r['seconds']:.3f} | {r['seconds'] / base['seconds']:.2f} |")


if __name__ == "__main__":
    main()
