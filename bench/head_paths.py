"""What the LM-head benchmarks share (bench/bench_token_logprobs.py, bench/bench_distill_head.py; `measure` and
`in_fresh_processes` also bench/bench_activation_checkpoint.py's): each path of a head computation (the whole logits
vs chunk by chunk) timed and measured in a fresh process of its own, so that its
peak memory is its own: on the CPU the rise of the peak resident set over the set-up (ru_maxrss), on CUDA
torch.cuda.max_memory_allocated over the set-up; the table and the ratios printed alike.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

PATHS = ("whole", "chunked")


def measure(run: Callable[[], object], device, iters: int) -> dict:
    """{peak_bytes, seconds}: `run` called `iters` times on `device` (a torch.device): the peak memory over what was
    there before the first call, and the median seconds per call."""
    import torch

    from utils.device import is_accelerator, synchronize
    accel = is_accelerator(device)

    def peak_so_far() -> int:  # the allocator's peak on the accelerator, the resident set's on the CPU
        if accel:
            return torch.cuda.max_memory_allocated(device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    synchronize(device)
    if accel:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if accel else peak_so_far()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"peak_bytes": peak_so_far() - base, "seconds": statistics.median(times)}


def add_common_args(p: argparse.ArgumentParser, temperature: float) -> None:
    """The flags both benches take: the head's shape, the chunk, the temperature, the repeats, the device, and the
    hidden --one <path> of a child process."""
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--chunk", type=int, default=512, help="--loss_chunk_size")
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--one", choices=PATHS, help=argparse.SUPPRESS)  # the child process


def child_or_parent(script: str, a: argparse.Namespace, argv: Optional[list],
                    one: Callable[[str, argparse.Namespace], dict]) -> Optional[dict]:
    """In a child (--one): print its path's RESULT line and give None; in the parent: every path's result, each
    measured in a fresh process of `script`."""
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a)), flush=True)
        return None
    return in_fresh_processes(script, argv if argv is not None else sys.argv[1:])


def in_fresh_processes(script: str, argv: list[str], paths: tuple[str, ...] = PATHS) -> dict:
    """{path: measure's result} of `script` re-run with `argv` + `--one <path>` for each of `paths` (the child prints
    one `RESULT {json}` line)."""
    rows = {}
    for path in paths:
        r = subprocess.run([sys.executable, os.path.abspath(script), *argv, "--one", path], capture_output=True,
                           text=True, check=True)
        rows[path] = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    return rows


def print_comparison(title: str, rows: dict) -> None:
    """The shape line, a markdown table of both paths, and chunked / whole for memory and time."""
    print(title)
    print("| path | peak memory over set-up (MiB) | seconds per forward + backward |")
    print("| --- | --- | --- |")
    for path, r in rows.items():
        print(f"| {path} | {r['peak_bytes'] / 2 ** 20:,.0f} | {r['seconds']:.3f} |")
    w, c = rows["whole"], rows["chunked"]
    print(f"chunked / whole: memory {c['peak_bytes'] / max(1, w['peak_bytes']):.3f}x, "
          f"time {c['seconds'] / w['seconds']:.2f}x")
