"""Two `torchrun --nnodes=2` launches (one process each) train train_my_ddp.py with --parallel=fsdp on
127.0.0.1, and end with the weights of one process running --parallel=ddp on the same global batch.

The tolerance is derived in the same run, not fixed: a 2-process --parallel=ddp run (one torchrun,
the same per-rank batch) is a second legitimate reference; its distance from the 1-process run is
the float32 summation-order noise of splitting the batch over 2 ranks on this machine. FSDP over 2
"nodes" may differ from the 1-process run by that order too (plus its own reduce-scatter order), so
it must stay within 10x that noise (floor 1e-6 relative), and the final DCP checkpoint, read back in
this process with load_full_model_state_dict, is what is compared (fp32 throughout).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from checkpoint.dcp import is_dcp_checkpoint, load_full_model_state_dict
from tests.conftest import ROOT
from tests.dist_helpers import free_port
from checkpoint.files import load_model_state
from checkpoint.verify import find_latest_valid

TRAIN = os.path.join(ROOT, "train_my_ddp.py")
STEPS = 4


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _flat(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([sd[k].detach().float().reshape(-1) for k in sorted(sd)])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.slow  # 4 launches (6 Python processes with torch): ~30-40 s of CPU, more than the ~20 s "slow" line
def test_two_node_torchrun_fsdp_matches_one_process_ddp(tiny_pretrain_run_args, tmp_path):
    base = [a for a in tiny_pretrain_run_args if not a.startswith(("--batch_size", "--checkpoint_interval"))]
    base += [f"--max_iters={STEPS}", f"--checkpoint_interval={STEPS}", "--dtype=fp32"]
    one, two, fsdp = tmp_path / "ddp_1proc", tmp_path / "ddp_2proc", tmp_path / "fsdp_2node"
    env = _env()

    # the two "nodes": separate torchrun launchers, static rendezvous on 127.0.0.1 (as for ddp in
    # tests/parallel/test_ddp_multinode.py); --device=cpu is in the args, so both never pick one local GPU.
    # The references run at the same time: one process on the full batch (4), and 2 ranks of our DDP
    # (batch 2 each) under one torchrun.
    port = free_port()
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={i}",
             "--master_addr=127.0.0.1", f"--master_port={port}", TRAIN, *base, "--batch_size=2",
             "--parallel=fsdp", f"--out_dir={fsdp}"] for i in range(2)]
    cmds.append([sys.executable, TRAIN, *base, "--batch_size=4", f"--out_dir={one}"])
    cmds.append([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN, *base,
                 "--batch_size=2", f"--out_dir={two}"])
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [o[-3000:] for o in outs]

    ckpt = find_latest_valid(str(fsdp))
    assert ckpt is not None and ckpt.endswith(f"{STEPS}") and is_dcp_checkpoint(ckpt), ckpt
    got_sd = load_full_model_state_dict(ckpt)
    ref_sd = load_model_state(find_latest_valid(str(one)))
    two_sd = load_model_state(find_latest_valid(str(two)))
    assert sorted(got_sd) == sorted(ref_sd) == sorted(two_sd)
    assert all(got_sd[k].dtype == torch.float32 and got_sd[k].shape == ref_sd[k].shape for k in ref_sd)
    got, ref, two_ranks = _flat(got_sd), _flat(ref_sd), _flat(two_sd)
    noise = rel(two_ranks, ref)
    tol = max(1e-6, 10 * noise)
    print(f"fsdp 2-node vs 1-process ddp: {rel(got, ref):.3e}; 2-rank ddp vs 1-process ddp (noise): {noise:.3e}; "
          f"tolerance {tol:.3e}; weights moved from the 2-rank ddp run by {rel(got, two_ranks):.3e}")
    assert rel(got, ref) <= tol, (rel(got, ref), noise, tol)
    assert rel(got, two_ranks) <= tol, (rel(got, two_ranks), noise, tol)
