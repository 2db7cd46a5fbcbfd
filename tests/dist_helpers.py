"""Launch helpers for the 2-process gloo tests: free ports, spawn with an initialised group."""
from __future__ import annotations

import gc
import os
import socket
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def computed_once(tmp_path_factory, name: str, compute: Callable) -> dict:
    """`compute(directory)`'s JSON-able result, computed by one pytest worker of this session and read by the
    others: a module fixture of several multi-rank runs, whose tests xdist's worksteal shares out over workers as
    they free up, would otherwise run again in every worker that got one of them (seen: 3 times). The directory
    (compute's scratch space, kept for the session: a checkpoint it writes can be named in the result) and the
    result live under the session's temporary directory, which its workers share, behind a file lock; a compute
    that fails leaves no result (the next worker tries, and fails, again)."""
    import fcntl
    import json
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # (xdist: each worker's basetemp is a directory of the session's)
    root = base / f"once-{name}"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            done = root / "result.json"
            if done.exists():
                return json.loads(done.read_text())
            work = root / "work"
            work.mkdir(exist_ok=True)
            out = compute(work)
            tmp = root / "result.json.tmp"
            tmp.write_text(json.dumps(out))
            os.replace(tmp, done)
            return json.loads(done.read_text())  # (every worker gets the same JSON round trip)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    fn(rank, world_size, *args)
    gc.collect()  # drop models/optimizers (hook cycles) while the process group still exists
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, retries_on_signal: int = 0) -> None:
    """Run fn(rank, world_size, *args) in `world_size` processes with gloo initialised. The processes are
    forked from the server of tests/forked_ranks.py, which has imported torch and the trainer once per
    pytest worker (a fresh "spawn" interpreter pays ~2 s of imports per rank); `fn` must be importable
    (a module-level function), as with spawn.

    retries_on_signal: run again (on a new port), at most this many times, when a rank was killed by a signal
    (SIGABRT, SIGSEGV: not an exception or an assertion in `fn`, which always fail at once), printing the first
    death on stderr. Only for an `fn` whose only output is written at its end, so that a second run starts from
    nothing: a crash that repeats still fails."""
    from tests.forked_ranks import forkserver_context
    forkserver_context()  # the server's preload list, whoever starts it first
    for attempt in range(retries_on_signal + 1):
        try:
            mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                               join=True, start_method="forkserver")
            return
        except mp.ProcessExitedException as e:
            if e.exit_code >= 0 or attempt == retries_on_signal:
                raise
            import sys
            print(f"[spawn] {getattr(fn, '__name__', fn)} at world {world_size}: {e}; running it again",
                  file=sys.stderr, flush=True)


def one_process_step(model, opt, params, batches, units: float, grad_clip: float) -> tuple[float, float]:
    """The reference every multi-process test compares with: one optimizer step of the whole model in one
    process over the global batch's (input_ids, labels) micro-batches, the loss normalised by the global
    target units, clipped with torch's clip_grad_norm_. Returns (loss per unit, gradient norm)."""
    import torch
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in batches:
        loss = model(x, labels=y, reduction="sum")
        total += float(loss.detach())
        (loss / units).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    opt.step()
    return total / units, norm


def traced_with_aot_eager(fn, *args, **kwargs) -> tuple:
    """(fn(*args, **kwargs), the number of graphs Dynamo compiled meanwhile) with every torch.compile traced by the
    aot_eager backend (Dynamo and AOTAutograd, no Inductor code generation: the compile tests' subject, and ~1 min
    per process on a CPU). 0 graphs would mean the run went silently eager."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    real = torch.compile
    torch.compile = lambda model=None, **kw: real(model, **{**kw, "backend": "aot_eager"})
    try:
        torch._dynamo.reset()
        counters.clear()
        out = fn(*args, **kwargs)
        return out, int(counters["stats"].get("unique_graphs", 0))
    finally:
        torch.compile = real
        torch._dynamo.reset()
