"""Two `torchrun --nnodes=2` launches (one process each) train together on 127.0.0.1."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from parallel.examples.train_tiny_ddp import train
from tests.dist_helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_node_torchrun_trains_identically(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
         f"--node_rank={i}", "--master_addr=127.0.0.1", f"--master_port={port}",
         "-m", "parallel.examples.train_tiny_ddp", f"--out={tmp_path}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    a, b = (torch.load(tmp_path / f"params_rank{r}.pt", weights_only=True) for r in range(2))
    assert torch.equal(a, b)
    # ...and equal to one process on the full batch (same code path, world size 1).
    single = torch.cat([p.detach().reshape(-1) for p in train().parameters()])
    assert float((a - single).norm() / single.norm()) < 1e-5  # Adam, 5 steps, other summation order
