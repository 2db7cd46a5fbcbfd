"""--async_checkpoint=true through train_my_ddp.py: the checkpoints written in the background hold exactly what the
synchronous ones hold (one process, and ZeRO-2 at 2 ranks, where rank 0 publishes only after the other rank's
marker), and a SIGKILL inside a background write (kill_in_save with the write held open by
MYLLM_FAULT_SAVE_DELAY while the training goes on) leaves the previous checkpoint the latest: the supervisor
resumes from it and the run ends with the uninterrupted run's losses and weights, bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from checkpoint.weights import checkpoint_model_state
from tests.conftest import ROOT, child_env, run_cmd, sigterm_after_two_steps, train_cmd
from checkpoint.files import load_model_state
from checkpoint.verify import find_latest_valid, list_checkpoints, verify_checkpoint
from utils.metrics import dedupe_by_step, read_metrics

MONITOR = os.path.join(ROOT, "monitor_process.py")


def losses(out_dir) -> dict[int, float]:
    return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(out_dir, "metrics.jsonl"))).items()}


def checkpoint_contents(ckpt_dir: str) -> dict:
    """Every file of a checkpoint as comparable values: tensors (flattened dict paths), JSON minus the save time
    and the manifest's hashes (torch.save's zip records differ with the tensors' storage layout)."""
    out: dict = {}

    def flat(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                flat(f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                flat(f"{prefix}.{i}", v)
        else:
            out[prefix] = obj
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if name.endswith(".safetensors"):
            flat(name, load_file(path))
        elif name.endswith(".pt"):
            flat(name, torch.load(path, weights_only=True))
        elif name == "manifest.json":
            out[name] = sorted(json.load(open(path)))  # the file list
        elif name.endswith(".json") or name == "COMPLETE":
            data = json.load(open(path))
            if isinstance(data, dict):
                data.pop("saved_at", None)
                if name == "dcp_manifest.json":
                    data.get("files", {}).pop(".metadata", None)  # its size varies with the save id
                if name == "config.json":
                    data.pop("out_dir", None)
                    data.pop("async_checkpoint", None)
            flat(name, data)
        elif name != ".metadata":  # DCP's pickled plan: holds a random save id; its shards are compared byte for byte
            out[name] = open(path, "rb").read()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_checkpoints(a_out, b_out) -> None:
    a, b = list_checkpoints(str(a_out)), list_checkpoints(str(b_out))
    assert [s for s, _ in a] == [s for s, _ in b] and a
    for (step, pa), (_, pb) in zip(a, b):
        assert verify_checkpoint(pb) is None
        ca, cb = checkpoint_contents(pa), checkpoint_contents(pb)
        assert ca.keys() == cb.keys(), (step, set(ca) ^ set(cb))
        for k in ca:
            x, y = ca[k], cb[k]
            if torch.is_tensor(x):
                assert torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(
                    bits(x), bits(y)), (step, k)  # bit for bit (NaN included: an unset Python gauss state)
            else:
                assert x == y, (step, k, x, y)


@pytest.mark.parametrize("nproc, extra", [
    (1, []),
    (2, ["--use_distributed_optimizer=true", "--zero_stage=2", "--batch_size=2"]),
    (2, ["--pipeline_parallel_size=2", "--gradient_accumulation_steps=2"]),
    (2, ["--parallel=fsdp", "--batch_size=2"]),
], ids=["1proc", "2proc-zero2", "pipeline2", "fsdp2"])
def test_async_checkpoints_equal_sync_ones(tiny_pretrain_run_args, tmp_path, nproc, extra):
    args = [*tiny_pretrain_run_args, *extra, "--max_iters=6", "--checkpoint_interval=2", "--keep_last=5"]
    sync_out, async_out = tmp_path / "sync", tmp_path / "async"
    run_cmd(train_cmd([*args, f"--out_dir={sync_out}"], nproc), env=child_env())
    proc = run_cmd(train_cmd([*args, f"--out_dir={async_out}", "--async_checkpoint=true"], nproc), env=child_env())
    assert "written in the background" in proc.stdout
    assert losses(async_out) == losses(sync_out)
    assert_same_checkpoints(sync_out, async_out)  # steps 2, 4, 6: every tensor and JSON value
    assert not [n for n in os.listdir(async_out / "checkpoints") if n.endswith(".tmp")]
    a, b = (checkpoint_model_state(find_latest_valid(str(o))) for o in (sync_out, async_out))  # loads (DCP's reader)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigkill_inside_background_write_resumes_exactly(tiny_pretrain_run_args, tmp_path):
    """kill_in_save@4 fires in the writer thread after a 1 s delay (the training meanwhile runs steps 5 and 6 and
    waits at step 6's save): step 4 never publishes, the restart resumes from step 2 and matches the reference."""
    args = [*tiny_pretrain_run_args, "--max_iters=6", "--checkpoint_interval=2", "--async_checkpoint=true"]
    ref, out, once = tmp_path / "ref", tmp_path / "killed", tmp_path / "once"
    run_cmd(train_cmd([*args, f"--out_dir={ref}"]), env=child_env())
    env = child_env(MYLLM_FAULT="kill_in_save@4", MYLLM_FAULT_ONCE_FILE=str(once), MYLLM_FAULT_SAVE_DELAY="1")
    proc = subprocess.run([sys.executable, MONITOR, "--backoff_base=0.1", "--poll_interval=0.1", "--kill_grace=2",
                           "--hang_timeout=600", "--startup_timeout=600", "--", sys.executable,
                           os.path.join(ROOT, "train_my_ddp.py"), *args, f"--out_dir={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert once.exists(), "the kill_in_save hook never fired"
    summary = json.load(open(out / "monitor_summary.json"))
    first, second = summary["attempts"]
    assert first["signal"] == "SIGKILL" and second["resumed_from_step"] == 2  # step 4 was never published
    assert losses(out) == losses(ref)
    a, b = load_model_state(find_latest_valid(str(ref))), load_model_state(find_latest_valid(str(out)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_waits_for_the_background_write(tiny_pretrain_run_args, tmp_path):
    """SIGTERM: the step's checkpoint is saved in the background, held open 1 s (MYLLM_FAULT_SAVE_DELAY); the run
    must wait for it before exiting 75 (exiting at once would kill the writer thread and publish nothing)."""
    from utils.constants import EXIT_INTERRUPTED
    out = tmp_path / "term"
    rc, stdout, err = sigterm_after_two_steps([*tiny_pretrain_run_args, "--max_iters=100000",
                                               "--checkpoint_interval=100000", "--async_checkpoint=true"], out,
                                              child_env(MYLLM_FAULT_SAVE_DELAY="1"))
    assert rc == EXIT_INTERRUPTED, err[-2000:]
    path = find_latest_valid(str(out))
    saved_step = json.load(open(os.path.join(path, "trainer_state.json")))["step"]
    assert saved_step == max(losses(out)) >= 2
    assert stdout.index("written in the background") < stdout.index("stop requested by signal")


def test_a_background_write_that_does_not_fit_exits_7(tiny_pretrain_run_args, tmp_path):
    """RLIMIT_FSIZE (64 KiB) under --async_checkpoint=true: the writer thread's model.safetensors fails; the error
    is logged when it happens, raised at the end of the run's wait as the synchronous save raises it (exit 7, not
    retried), and the partial step_N.tmp is removed."""
    import resource
    import signal
    from utils.constants import EXIT_DISK_FULL

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_my_ddp.py"), *tiny_pretrain_run_args,
                           f"--out_dir={out}", "--max_iters=3", "--async_checkpoint=true"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600, preexec_fn=limit)
    assert proc.returncode == EXIT_DISK_FULL, proc.stderr[-3000:]
    assert "[checkpoint] error: the background write of checkpoint step 3" in proc.stdout
    assert "step_00000003.tmp/model.safetensors did not fit" in proc.stderr
    assert os.listdir(out / "checkpoints") == []
