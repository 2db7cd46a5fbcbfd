"""checkpoint/async_writer.py in one process, through the plain format's save of the ddp engine (our DDP + AdamW,
world 1): the snapshot is taken before save() returns (an optimizer step while the writer is held open does not
reach the files), the host buffers are reused (no new buffer and the same addresses over 20 saves), a failed background write is
logged and raised by the next wait() with the previous checkpoint still the latest, and rank 0's writer
publishes only after every rank's marker, and another rank's failed write ends this rank with the same kind of error.
Deterministic: the writer is held open by a threading.Event."""
from __future__ import annotations

import os
import re
import threading

import pytest
import torch
from torch import nn

from optimizer import OptimizerConfig
from parallel.config import ParallelConfig
from checkpoint.async_writer import (AsyncCheckpointError, AsyncCheckpointer, HostBuffers, mark_rank_failed,
                                     mark_rank_written, wait_for_ranks)
from checkpoint.files import load_model_state
from checkpoint.plain import save_replicated
from checkpoint.protocol import SaveJob
from checkpoint.rng import capture_rng_state
from checkpoint.verify import find_latest_valid, list_checkpoints, verify_checkpoint
from parallel.build import build_parallel_engine
from utils.publish import temp_dir_for
from tests.trainer.test_async_checkpoint_resume import bits, checkpoint_contents


def _engine(device: str = "cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)
    return build_parallel_engine(model, ParallelConfig(), OptimizerConfig(lr=1e-2, fused=device != "cpu"),
                                 device=torch.device(device))


def _train_step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    device = next(engine.module.parameters()).device
    x, y = (t.to(device) for t in (torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)))
    engine.optimizer.zero_grad()
    ((engine.model(x) - y) ** 2).sum().backward()
    engine.optimizer.step()


def _save(engine, out, step, writer=None, fault_hook=None, log=print):
    job = SaveJob(str(out), step, trainer_state={"x": step}, model_config={"dim": 16}, run_config={"seed": 0},
                  extra_state={"rng": capture_rng_state(torch.device("cpu"))}, keep_last=3, fault_hook=fault_hook,
                  log=log)
    return save_replicated(engine, job, writer)


def _data_ptrs(buffers: HostBuffers) -> list[int]:
    return [b.data_ptr() for b in buffers.tensors()]


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        if torch.is_tensor(a[k]):
            if not (a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k]))):
                return False
        elif k != "trainer_state.json.saved_at" and a[k] != b[k]:
            return False
    return True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_snapshot_is_taken_before_save_returns(tmp_path, device):
    """The async save of step 1 is held open while the training runs step 2; its files must equal the synchronous
    save of step 1, not step 2's state. On CUDA the snapshot goes through pinned host buffers (non-blocking
    copies: the test fails if the copies were not waited for before the step changed the weights)."""
    engine = _engine(device)
    _train_step(engine, 1)
    torch.manual_seed(5)  # the RNG state saved by both
    sync_path = _save(engine, tmp_path / "sync", 1)
    torch.manual_seed(5)
    release, entered = threading.Event(), threading.Event()

    def hold_open():
        entered.set()
        assert release.wait(60)
    writer = AsyncCheckpointer(log=lambda m: None, device=torch.device(device))
    path = _save(engine, tmp_path / "async", 1, writer=writer, fault_hook=hold_open)
    if device == "cuda":
        # the weights' buffers page-locked (the optimizer's state_dict() is already host tensors: not pinned)
        assert any(b.is_pinned() for b in writer.buffers.tensors())
    assert entered.wait(60) and writer.in_flight()
    assert find_latest_valid(str(tmp_path / "async"), log=lambda m: None) is None  # not published yet
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    _train_step(engine, 2)  # the live weights and Adam moments change under the held-open writer
    assert any(not torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    release.set()
    writer.wait()
    assert verify_checkpoint(path) is None
    a = checkpoint_contents(sync_path)
    b = checkpoint_contents(path)
    assert _same(a, b)
    assert any(torch.is_tensor(v) for v in b.values())


def test_host_buffers_are_reused_over_20_saves(tmp_path):
    engine = _engine()
    writer = AsyncCheckpointer(log=lambda m: None)
    asked, real = [], engine.optimizer.state_dict
    # the optimizer hands over views of its live state (no host copy of its own per save): the writer's
    # reused buffers are the only host memory the snapshot uses
    engine.optimizer.state_dict = lambda to_host=True: (asked.append(to_host), real(to_host=to_host))[1]
    _train_step(engine, 0)
    _save(engine, tmp_path, 1, writer=writer)
    writer.wait()
    allocations, ptrs, nbytes = writer.buffers.allocations, _data_ptrs(writer.buffers), writer.buffers.nbytes()
    assert allocations > 0 and nbytes > 0
    for step in range(2, 22):
        _train_step(engine, step)
        _save(engine, tmp_path, step, writer=writer)
    writer.wait()
    assert writer.buffers.allocations == allocations  # no new host buffer after the first save
    assert _data_ptrs(writer.buffers) == ptrs and writer.buffers.nbytes() == nbytes  # the same memory, rewritten
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [21, 20, 19]  # kept last 3, pruned the rest
    latest = load_model_state(find_latest_valid(str(tmp_path)))
    live = engine.module.state_dict()
    assert all(torch.equal(latest[k], live[k]) for k in live)  # the last save holds the last step's weights
    writer.close()
    assert writer.buffers.nbytes() == 0
    assert asked == [False] * 21


def test_buffers_follow_a_shape_change():
    buffers = HostBuffers()
    a = buffers.snapshot({"w": torch.ones(3)})
    b = buffers.snapshot({"w": torch.zeros(3)})
    assert a["w"].data_ptr() == b["w"].data_ptr() and buffers.allocations == 1 and torch.equal(b["w"], torch.zeros(3))
    c = buffers.snapshot({"w": torch.ones(2, 2, dtype=torch.float64)})
    assert buffers.allocations == 2 and c["w"].dtype == torch.float64 and c["w"].shape == (2, 2)


def test_failed_background_write_is_logged_and_raised_by_wait(tmp_path):
    engine = _engine()
    logged = []
    writer = AsyncCheckpointer(log=logged.append)
    _train_step(engine, 0)
    good = _save(engine, tmp_path, 2, writer=writer)
    writer.wait()

    denied = os.path.join(temp_dir_for(good), "x")

    def fail():
        raise PermissionError(13, "Permission denied", denied)
    _train_step(engine, 1)
    final = _save(engine, tmp_path, 4, writer=writer, fault_hook=fail)
    # the writer's own exception, whole: its type, the file being written, the OSError it wraps (as its cause);
    # not a message of wait()'s own that merely quotes it
    named = (rf"writing {re.escape(os.path.join(temp_dir_for(final), 'config.json'))}: PermissionError: "
             rf"\[Errno 13\] Permission denied: {re.escape(repr(denied))}")
    with pytest.raises(AsyncCheckpointError) as info:
        writer.wait()
    assert type(info.value) is AsyncCheckpointError and re.fullmatch(named, str(info.value)), str(info.value)
    assert isinstance(info.value.__cause__, PermissionError) and info.value.__cause__.filename == denied
    assert any("error: the background write of checkpoint step 4" in m for m in logged)
    assert find_latest_valid(str(tmp_path), log=lambda m: None) == good  # the previous one is the latest
    writer.wait()  # raised once: the next save may try again
    _save(engine, tmp_path, 4, writer=writer)
    writer.wait()
    assert find_latest_valid(str(tmp_path)).endswith("step_00000004")


def test_rank0_publishes_only_after_every_rank_marker(tmp_path):
    tmp = tmp_path / "step_00000002.tmp"
    tmp.mkdir()
    done = []
    t = threading.Thread(target=lambda: done.append(wait_for_ranks(str(tmp), 3, timeout=60)))
    t.start()
    mark_rank_written(str(tmp), 2)
    t.join(0.2)
    assert t.is_alive() and not done  # rank 1 has not written yet
    mark_rank_written(str(tmp), 1)
    t.join(60)
    assert done == [None] and os.listdir(tmp) == []  # the markers are not part of the checkpoint
    mark_rank_failed(str(tmp), 1, "optimizer_rank1.pt: disk quota exceeded")
    with pytest.raises(AsyncCheckpointError, match="rank 1 .*optimizer_rank1.pt: disk quota"):
        wait_for_ranks(str(tmp), 2, timeout=60)
    other = tmp_path / "step_00000004.tmp"
    other.mkdir()
    with pytest.raises(AsyncCheckpointError, match=r"ranks \[1\] did not finish"):
        wait_for_ranks(str(other), 2, timeout=0, poll=0)


@pytest.mark.parametrize("code, error", [(7, "DiskFullError"), (1, "AsyncCheckpointError")])
def test_another_ranks_failed_write_ends_this_rank_alike(monkeypatch, code, error):
    """wait() at 2 ranks: this rank's write succeeded, the agreed verdict (the collective, stubbed here) is rank 1's
    failure: this rank raises too, DiskFullError (exit 7) for a write that did not fit, else a crash."""
    import utils.dist
    from utils.disk_space import DiskFullError
    seen = []

    def agreed(verdict, device=None):
        seen.append(verdict)
        return code, "checkpoint step 4: rank 1's optimizer_rank1.pt did not fit"
    monkeypatch.setattr(utils.dist, "first_error_of_ranks", agreed)
    writer = AsyncCheckpointer(log=lambda m: None, rank=0, world_size=2)
    writer.submit("checkpoint step 4", lambda: None)
    with pytest.raises((DiskFullError, AsyncCheckpointError)) as info:
        writer.wait()
    assert type(info.value).__name__ == error and "optimizer_rank1.pt" in str(info.value)
    assert seen == [None]  # this rank's own verdict: no error
    writer.wait(agree=False)  # nothing in flight, nothing kept: returns
