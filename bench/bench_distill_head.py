"""Benchmark: distillation's loss (--task_type=distill) from the student's whole logits at the target tokens vs chunk
by chunk in its LM head.

    .venv/bin/python bench/bench_distill_head.py                      # 4096 target tokens, vocab 32000, dim 512
    .venv/bin/python bench/bench_distill_head.py --tokens 8192 --vocab 151936 --device cuda

"whole": the student's logits at the N target tokens [N, V] and model/distill_head.py `distill_loss` on them (how the
task computed it before the head did); "chunked": `chunked_distill_loss`, `--loss_chunk_size` tokens at a time (what
the task runs). --teacher=logits (default): both get the teacher's logits [N, V] (fp32 here) in their set-up, so the
figures are the student side's (the task's path under FSDP2 with fewer target tokens than the teacher's width);
--teacher=hidden: both get the teacher's final hidden states [N, dim] and head weight [V, dim], "whole" forms its logits
[N, V] in the call, "chunked" hands them over as `TeacherHidden` (chunk by chunk beside the student's: the task's path
where the teacher is whole on the rank, and under FSDP2 with more target tokens than its width, its gathered weight
copied), so the figures are both sides'. One forward + backward of the head and the loss. Each
path runs in a fresh process of its own (bench/head_paths.py). Prints both paths' peak memory and seconds per call
(median of --iters), and the ratios. Nothing is asserted.
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

    from model.distill_head import TeacherHidden, chunked_distill_loss, distill_loss
    dev = torch.device(a.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(a.tokens, a.dim, generator=g) * 0.5).to(dev).requires_grad_()
    w = (torch.randn(a.vocab, a.dim, generator=g) * a.dim ** -0.5).to(dev).requires_grad_()
    if a.teacher == "hidden":
        teacher = TeacherHidden(torch.randn(a.tokens, a.dim, generator=g).to(dev),
                                (torch.randn(a.vocab, a.dim, generator=g) * 2 * a.dim ** -0.5).to(dev))
    else:
        teacher = torch.randn(a.tokens, a.vocab, generator=g).mul_(2).to(dev)  # (in place: no set-up peak above it)
    y = torch.randint(0, a.vocab, (a.tokens,), generator=g).to(dev)
    kw = dict(temperature=a.temperature, alpha=a.alpha, loss_type=a.loss)

    def run() -> float:
        if path == "whole":
            whole = teacher.logits() if isinstance(teacher, TeacherHidden) else teacher
            losses, div, _ = distill_loss(torch.nn.functional.linear(h, w), whole, y, **kw)
            loss, div = losses.sum(), div.sum()
        else:
            loss, div, _ = chunked_distill_loss(h, w, teacher, y, chunk_size=a.chunk, **kw)
        loss.backward()
        h.grad = w.grad = None
        return float(div)

    return {"path": path, **measure(run, dev, a.iters)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="target tokens in the micro-batch (N)")
    p.add_argument("--loss", default="forward_kl", choices=("forward_kl", "reverse_kl", "jsd"))
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--teacher", default="logits", choices=("logits", "hidden"),
                   help="the teacher's side as its logits [N, V] (set-up) or hidden states and head weight")
    add_common_args(p, temperature=1.0)
    a = p.parse_args(argv)
    rows = child_or_parent(__file__, a, argv, _one)
    if rows is None:
        return
    logits_mib = a.tokens * a.vocab * 4 / 2 ** 20
    print_comparison(f"{a.tokens} target tokens, vocab {a.vocab}, dim {a.dim}, chunk {a.chunk}, --distill_loss="
                     f"{a.loss}, alpha {a.alpha:g}, teacher as {a.teacher}, {a.device} (one fp32 copy of the logits: "
                     f"{logits_mib:,.0f} MiB)",
                     rows)


if __name__ == "__main__":
    main()
