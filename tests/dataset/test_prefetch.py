"""dataset/prefetch.py: batches drawn ahead on a thread are the loader's own batches, in its order; the
cursor counts only the batches handed out; a reposition drops what was drawn ahead; a bad sample fails
the next() of its own batch. And the trainer with --prefetch_batches=2 (on the CPU here; a GPU run's
default) trains and resumes as it does without."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from dataset.loader import ResumableLoader
from dataset.prefetch import PrefetchLoader, pin_batch
from tests.conftest import child_env, run_cmd, run_trainer, train_cmd
from utils.metrics import dedupe_by_step, read_metrics


class Samples:
    """Sample i is the tensor [i, i]; `bad` indices raise like a corrupt record."""

    def __init__(self, n: int, bad: tuple = ()):
        self.n, self.bad = n, set(bad)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i in self.bad:
            raise ValueError(f"corrupt sample {i}")
        return {"input_ids": torch.tensor([i, i])}


def _loader(n: int = 37, bad: tuple = ()) -> ResumableLoader:
    return ResumableLoader(Samples(n, bad), 3, 11, 0, 1, shuffle=True)


def _ids(batch) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def test_same_batches_and_cursor_as_the_loader_itself():
    """Over three epochs (drop_last wraps the epoch): batch k and the cursor after it are the plain loader's."""
    plain, ahead = _loader(), PrefetchLoader(_loader(), depth=3)
    assert ahead.num_samples == 37 and len(ahead) == len(plain)  # the wrapped loader's attributes
    assert ahead.state_dict() == plain.state_dict()
    for _ in range(3 * len(plain)):
        assert _ids(next(ahead)) == _ids(next(plain))
        assert ahead.state_dict() == plain.state_dict()  # batches drawn ahead are not in the cursor
    ahead.close()
    # closed, the wrapped loader is back at the cursor: it goes on from the last batch handed out
    assert ahead.loader.state_dict() == plain.state_dict()
    assert _ids(next(ahead.loader)) == _ids(next(plain))


def test_reposition_drops_the_batches_drawn_ahead():
    ref = _loader()
    for _ in range(4):
        next(ref)
    saved = ref.state_dict()
    expect = [_ids(next(ref)) for _ in range(5)]
    ahead = PrefetchLoader(_loader(), depth=2)
    for _ in range(9):  # well past the saved position, with 2 more drawn ahead
        next(ahead)
    ahead.load_state_dict(saved)
    assert ahead.state_dict() == saved
    assert [_ids(next(ahead)) for _ in range(5)] == expect


def test_a_bad_sample_fails_its_own_batch_and_stays_next():
    """A sample of batch k = 5 is corrupt: batches 0-4 arrive, next() number 5 raises the loader's own error,
    the cursor stays before that batch, and the next call raises it again."""
    plain = _loader()
    bad = [_ids(next(plain)) for _ in range(6)][5][1]
    ahead = PrefetchLoader(_loader(bad=(bad,)), depth=4)
    for _ in range(5):
        next(ahead)
    cursor = ahead.state_dict()
    for _ in range(2):
        with pytest.raises(ValueError, match=f"corrupt sample {bad}"):
            next(ahead)
        assert ahead.state_dict() == cursor


def test_pinned_batches_for_an_accelerator(monkeypatch):
    """pin=True puts every CPU tensor of the batch through pin_memory() (faked here: pinning needs CUDA)."""
    pinned = []

    def fake_pin(t):
        pinned.append(t)
        return t.clone()
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    b = pin_batch({"input_ids": torch.ones(2), "labels": [torch.zeros(1), torch.ones(1)], "n": 3})
    assert len(pinned) == 3 and b["n"] == 3 and torch.equal(b["labels"][1], torch.ones(1))
    pinned.clear()
    devices = []
    monkeypatch.setattr("dataset.prefetch.set_device", lambda d: devices.append((d, threading.current_thread())))
    ahead = PrefetchLoader(_loader(), depth=2, pin=True, device=torch.device("cuda", 3))
    batch = next(ahead)
    ahead.close()
    assert len(pinned) >= 1 and torch.equal(batch["input_ids"], next(_loader())["input_ids"])
    # the pinning thread made the rank's device its current one first (not GPU 0, a new thread's default)
    assert len(devices) == 1 and devices[0][0] == torch.device("cuda", 3)
    assert devices[0][1] is not threading.main_thread()


def _losses(out_dir) -> dict[int, float]:
    return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(out_dir, "metrics.jsonl"))).items()}


def test_trainer_with_batches_drawn_ahead_trains_and_resumes_the_same(tiny_pretrain_run_args, tmp_path):
    """--prefetch_batches=2 (a GPU run's default; 0 on the CPU): the same losses as without, and a crash at
    step 5 resumed from the step-3 checkpoint gives them again (the cursor saved is the trained one)."""
    args = [*tiny_pretrain_run_args, "--max_iters=6", "--gradient_accumulation_steps=2"]
    ref, ahead, crashed = tmp_path / "ref", tmp_path / "ahead", tmp_path / "crashed"
    run_cmd(train_cmd([*args, f"--out_dir={ref}", "--prefetch_batches=0"]), env=child_env())
    run_cmd(train_cmd([*args, f"--out_dir={ahead}", "--prefetch_batches=2"]), env=child_env())
    assert _losses(ahead) == _losses(ref) and sorted(_losses(ref)) == [1, 2, 3, 4, 5, 6]
    once = tmp_path / "fired"
    proc = run_trainer(train_cmd([*args, f"--out_dir={crashed}", "--prefetch_batches=2"]),
                       env=child_env(MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists()
    run_cmd(train_cmd([*args, f"--out_dir={crashed}", "--prefetch_batches=2"]), env=child_env())
    assert _losses(crashed) == _losses(ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batches_drawn_ahead_are_pinned_and_copied_without_a_sync():
    """On a GPU: the batches come pinned, and utils.device.to_device copies them with no synchronising call."""
    import warnings

    from utils.device import to_device
    ahead = PrefetchLoader(_loader(), depth=2, pin=True)
    batch = next(ahead)
    ahead.close()
    assert batch["input_ids"].is_pinned()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = to_device(batch["input_ids"], torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()] == []
    assert torch.equal(x.cpu(), batch["input_ids"])
