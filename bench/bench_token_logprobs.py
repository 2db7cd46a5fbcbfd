"""Benchmark: GRPO's per-token log-probabilities (and entropies) from the whole logits vs chunk by chunk.

    .venv/bin/python bench/bench_token_logprobs.py                       # rows 8 x 256 tokens, vocab 32000, dim 512
    .venv/bin/python bench/bench_token_logprobs.py --rows 16 --seq 512 --device cuda

What `--chunked_logprobs=false` (trainer/tasks/grpo_rollout.py token_logps on the model's logits) and `=true`
(model/token_logprobs.py, `--loss_chunk_size` tokens at a time) cost for one forward + backward of the LM head and the
log-probabilities of the targets, plus the entropies (what the training micro-batch computes). Each path runs in a
fresh process of its own, so its peak memory is its own (bench/head_paths.py). Prints both paths' peak memory and
seconds per call (median of --iters), and the ratios. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.head_paths import add_common_args, child_or_parent, measure, print_comparison  # noqa: E402


def _one(path: str, a: argparse.Namespace) -> dict:
    import torch

    from model.token_logprobs import token_logprobs
    from trainer.tasks.grpo_rollout import token_logps
    dev = torch.device(a.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(a.rows, a.seq, a.dim, generator=g) * 0.5).to(dev).requires_grad_()
    w = (torch.randn(a.vocab, a.dim, generator=g) * a.dim ** -0.5).to(dev).requires_grad_()
    x = torch.randint(0, a.vocab, (a.rows, a.seq), generator=g).to(dev)

    def run() -> float:
        if path == "whole":
            logp, ent = token_logps(torch.nn.functional.linear(h, w), x, a.temperature, with_entropy=True)
        else:
            nxt = torch.cat([x[:, 1:], x[:, :1]], dim=1)
            logp, ent = token_logprobs(h, w, nxt, a.temperature, a.chunk)
            logp, ent = logp[:, :-1], ent[:, :-1]
        logp.sum().backward()
        h.grad = w.grad = None
        return float(ent.sum())

    return {"path": path, **measure(run, dev, a.iters)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="completions in the micro-batch (prompts x G)")
    p.add_argument("--seq", type=int, default=256, help="tokens per row (prompt + completion)")
    add_common_args(p, temperature=0.9)
    a = p.parse_args(argv)
    rows = child_or_parent(__file__, a, argv, _one)
    if rows is None:
        return
    logits_mib = a.rows * a.seq * a.vocab * 4 / 2 ** 20
    print_comparison(f"rows {a.rows} x {a.seq} tokens, vocab {a.vocab}, dim {a.dim}, chunk {a.chunk}, {a.device} "
                     f"(one fp32 copy of the logits: {logits_mib:,.0f} MiB)", rows)


if __name__ == "__main__":
    main()
