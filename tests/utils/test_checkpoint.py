"""checkpoint/ (plain format, protocol, verify, rng): atomic layout, verification, skipping damaged checkpoints, pruning, RNG."""
import os
import random

import numpy as np
import torch

from checkpoint.files import load_model_state, load_rank_file
from checkpoint.plain import SaveRequest, save_checkpoint
from checkpoint.rng import capture_rng_state, restore_rng_state
from checkpoint.verify import find_latest_valid, list_checkpoints, verify_checkpoint
from utils.checkpoint_json import read_json


def _save(out_dir, step, val_loss=None, keep_last=2, fault_hook=None):
    torch.manual_seed(step)
    req = SaveRequest(step=step, rank=0, world_size=1,
                      model_state={"w": torch.randn(4, 3), "b": torch.full((3,), float(step))},
                      model_config={"dim": 3}, optimizer_state={"exp_avg": torch.ones(4), "step": step},
                      extra_state={"rng": capture_rng_state(torch.device("cpu"))},
                      trainer_state={"data_cursor": {"epoch": 0, "step_in_epoch": step}, "val_loss": val_loss},
                      run_config={"lr": 0.1})
    return save_checkpoint(str(out_dir), req, keep_last=keep_last, fault_hook=fault_hook)


def test_save_load_roundtrip(tmp_path):
    path = _save(tmp_path, 5)
    assert os.path.basename(path) == "step_00000005"
    assert sorted(os.listdir(path)) == sorted(["COMPLETE", "config.json", "extra_rank0.pt", "manifest.json",
                                               "model.safetensors", "model_config.json", "optimizer_rank0.pt",
                                               "trainer_state.json"])
    assert find_latest_valid(str(tmp_path)) == path
    assert torch.equal(load_model_state(path)["b"], torch.full((3,), 5.0))
    opt = load_rank_file(path, "optimizer", 0)  # weights_only=True inside
    assert opt["step"] == 5 and torch.equal(opt["exp_avg"], torch.ones(4))
    assert read_json(os.path.join(path, "trainer_state.json"))["data_cursor"]["step_in_epoch"] == 5


def test_damaged_checkpoints_are_skipped_with_a_message(tmp_path):
    good = _save(tmp_path, 1, keep_last=10)
    truncated = _save(tmp_path, 2, keep_last=10)
    missing = _save(tmp_path, 3, keep_last=10)
    with open(os.path.join(truncated, "model.safetensors"), "r+b") as f:
        f.truncate(10)
    os.remove(os.path.join(missing, "optimizer_rank0.pt"))
    messages = []
    assert find_latest_valid(str(tmp_path), log=messages.append) == good
    assert any("step_00000003" in m and "missing file optimizer_rank0.pt" in m for m in messages)
    assert any("step_00000002" in m and "truncated" in m for m in messages)
    # same size, flipped byte: caught by the hash
    path4 = _save(tmp_path, 4, keep_last=10)
    with open(os.path.join(path4, "model.safetensors"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert verify_checkpoint(path4) == "model.safetensors does not match its sha256 (corrupted)"


def test_interrupted_save_leaves_previous(tmp_path):
    good = _save(tmp_path, 1)

    class Died(Exception):
        pass

    def die():
        raise Died()
    try:
        _save(tmp_path, 2, fault_hook=die)
    except Died:
        pass
    assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "step_00000002.tmp"))
    assert find_latest_valid(str(tmp_path)) == good
    assert _save(tmp_path, 2).endswith("step_00000002")  # a later save cleans the stale temp dir
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints", "step_00000002.tmp"))


def test_keep_last_and_best(tmp_path):
    for step, val in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5), (5, 2.2)):
        _save(tmp_path, step, val_loss=val, keep_last=2)
    steps = [s for s, _ in list_checkpoints(str(tmp_path))]
    assert steps == [5, 4, 2]  # the last two, and the best by validation loss


def test_rng_roundtrip(tmp_path):
    dev = torch.device("cpu")
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    random.gauss(0, 1)
    state = capture_rng_state(dev)
    a = (random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(2))
    torch.save(state, tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    random.seed(9); np.random.seed(9); torch.manual_seed(9)
    restore_rng_state(state, dev)
    b = (random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(2))
    assert a[:3] == b[:3] and torch.equal(a[3], b[3])


def _damage(path):
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.truncate(10)


def test_pruning_keeps_the_newest_valid_checkpoint_over_a_damaged_newer_one(tmp_path):
    """Issue 11 / 3.3: resumed from step 50 after a damaged step_60, saving step 56 with keep_last=1
    must keep step 56 (the newest valid one), not the damaged step 60 alone."""
    s50 = _save(tmp_path, 50, keep_last=5)
    s60 = _save(tmp_path, 60, keep_last=5)
    _damage(s60)
    assert find_latest_valid(str(tmp_path), log=lambda m: None) == s50
    s56 = _save(tmp_path, 56, keep_last=1)
    assert find_latest_valid(str(tmp_path), log=lambda m: None) == s56
    assert verify_checkpoint(s56) is None
    valid = [p for _, p in list_checkpoints(str(tmp_path)) if verify_checkpoint(p) is None]
    assert valid == [s56]


def test_damaged_checkpoints_count_neither_as_last_nor_as_best(tmp_path):
    for step, val in ((1, 1.0), (2, 2.0), (3, 3.0)):
        _save(tmp_path, step, val_loss=val, keep_last=10)
    _damage(os.path.join(tmp_path, "checkpoints", "step_00000001"))  # the best by val_loss, now unusable
    s4 = _save(tmp_path, 4, val_loss=2.5, keep_last=2)
    _damage(s4)  # damaged after the save: the next prune must not count it among the last two
    _save(tmp_path, 5, val_loss=4.0, keep_last=2)
    kept = [s for s, p in list_checkpoints(str(tmp_path)) if verify_checkpoint(p) is None]
    assert kept == [5, 3, 2]  # the two newest valid ones, and the best valid one (step 2, val 2.0)


# ---------------------------------------------------------------- a full disk (issue 33 item 3)

def _short_write(obj, path, *a, **k):
    """torch.save on a full disk: part of the file written, then torch's stream writer's error."""
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04partial")
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def test_full_disk_during_a_save_removes_the_partial_dir_and_keeps_the_previous(tmp_path, monkeypatch):
    from utils.disk_space import DiskFullError
    from utils.errors import exit_code_for
    good = _save(tmp_path, 1)
    monkeypatch.setattr(torch, "save", _short_write)
    try:
        _save(tmp_path, 2)
        raise AssertionError("the save did not fail")
    except DiskFullError as e:
        err = e
    code, line = exit_code_for(err)
    assert code == 7 and "\n" not in line and line.startswith("disk full: saving checkpoint ")
    assert os.path.join("step_00000002.tmp", "optimizer_rank0.pt") in line and " free on " in line
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000001"]  # no step_00000002.tmp left
    assert verify_checkpoint(good) is None and find_latest_valid(str(tmp_path)) == good


def test_full_disk_in_safetensors_and_os_errors_are_recognised():
    import errno
    from safetensors import SafetensorError
    from utils.disk_space import is_disk_full
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EFBIG, "File too large"))
    assert is_disk_full(SafetensorError("Error while serializing: I/O error: File too large (os error 27)"))
    wrapped = RuntimeError("CheckpointException ranks:dict_keys([0]) Traceback: OSError: [Errno 28] "
                           "No space left on device")  # DCP's, with the rank's traceback inside
    assert is_disk_full(wrapped)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise ValueError("while writing shard") from inner
    except ValueError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(RuntimeError("size mismatch")) and not is_disk_full(OSError(errno.EACCES, "x"))


def test_a_save_is_refused_before_writing_when_free_space_is_below_the_last_checkpoint(tmp_path, monkeypatch):
    from utils.disk_space import DiskFullError, tree_bytes
    good = _save(tmp_path, 1)
    size = tree_bytes(good)
    from checkpoint import protocol
    monkeypatch.setattr(protocol, "free_bytes", lambda p: size - 1)
    wrote = []
    monkeypatch.setattr(torch, "save", lambda *a, **k: wrote.append(a))
    try:
        _save(tmp_path, 2)
        raise AssertionError("the save was not refused")
    except DiskFullError as e:
        msg = str(e)
    assert f"the last checkpoint (step_00000001) takes {size / 1024:.1f} KiB" in msg
    assert os.path.join("checkpoints", "step_00000002") in msg and "nothing was written" in msg
    assert wrote == [] and sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000001"]
    monkeypatch.undo()  # torch.save back
    monkeypatch.setattr(protocol, "free_bytes", lambda p: size)  # exactly enough: the save goes ahead
    assert verify_checkpoint(_save(tmp_path, 2)) is None
