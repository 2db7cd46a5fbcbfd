"""Two `torchrun --nnodes=2` launches (one process each) train together on 127.0.0.1.

Held to torch's own DDP run by the same worker on the same batches (same ranks, same data split),
not to a fixed tolerance: the gap between 2-rank training and one process on the full batch is
summation-order noise that differs between CPUs, and torch DDP shows the same gap.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import torch

from parallel.examples.train_tiny_ddp import train
from tests.dist_helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# What the launcher prints when its TCP store connection drops (seen once with both cores saturated by other
# jobs: one agent aborted at shutdown, after training): an infrastructure failure, retried once with a new port.
# A wrong result is never retried: the assertions below run on whichever launch completed.
# A launch that never ends is retried once too: the port is chosen free and then released, so another test's
# store can take it before the launcher binds it, and both agents then wait on a rendezvous that never completes
# (one hang in a full-suite run, not reproduced alone). A hang that repeats still fails.
TIMED_OUT = "[test] the launch timed out and was killed"
LAUNCH_TIMEOUT_S = 180  # ~8 s alone on 2 idle cores
_LAUNCHER_FAILURES = ("DistNetworkError", "terminate called without an active exception", TIMED_OUT)


def _launch_two_nodes(out_dir) -> tuple[list[int], list[str]]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    # --device=cpu: on a GPU machine both "nodes" would otherwise pick the one local GPU.
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
         f"--node_rank={i}", "--master_addr=127.0.0.1", f"--master_port={port}",
         "-m", "parallel.examples.train_tiny_ddp", f"--out={out_dir}", "--device=cpu", "--torch_ddp_reference"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for i in range(2)]
    try:
        outs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        # the launchers, and their workers, which torch's launcher starts in sessions of their own: found by the
        # --out directory on their command line, unique to this test
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):  # no procps: the workers end with their store's timeout
            subprocess.run(["pkill", "-9", "-f", "--", f"train_tiny_ddp --out={out_dir} "], check=False)
        outs = [p.communicate(timeout=60)[0] + f"\n{TIMED_OUT}" for p in procs]
    return [p.returncode for p in procs], outs


def test_two_node_torchrun_trains_identically(tmp_path):
    codes, outs = _launch_two_nodes(tmp_path)
    if codes != [0, 0] and any(m in o for o in outs for m in _LAUNCHER_FAILURES):
        print("the launch failed in the launcher (its store connection, or a hang); retried once:", outs)
        codes, outs = _launch_two_nodes(tmp_path)
    assert codes == [0, 0], outs
    ours = [torch.load(tmp_path / f"params_rank{r}.pt", weights_only=True) for r in range(2)]
    ref = [torch.load(tmp_path / f"torch_ddp_rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(ours[0], ours[1])  # the ranks agree bit for bit
    assert torch.equal(ref[0], ref[1])
    single = torch.cat([p.detach().reshape(-1) for p in train(device_name="cpu").parameters()])
    # torch DDP's own distance from one process on the full batch is the summation-order noise of
    # this machine; ours must be as close to torch DDP as that (floor: a few fp32 ulps over 5 steps).
    noise = rel(ref[0], single)
    assert rel(ours[0], ref[0]) <= max(1e-6, noise), (rel(ours[0], ref[0]), noise)
    assert rel(ours[0], single) <= 2 * noise + 1e-6, (rel(ours[0], single), noise)
